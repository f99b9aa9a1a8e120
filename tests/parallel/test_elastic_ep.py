"""Elastic EP on real ranks: a follower rank is killed mid-stream; the survivor keeps serving."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster.expert_load import ExpertLoadReader
from pdserve.cluster.instances import Instance
from pdserve.core.config import DisaggregationConfig
from pdserve.core.errors import InvalidArgumentError, TransferError
from pdserve.core.layout import Layout
from pdserve.core.step import KVArrival, StepPlan
from pdserve.models.eplb import Placement, shrink, static_placement
from pdserve.parallel.rank_spec import GenerateItem
from pdserve.transfer.rank import RankTransfer
from tests.reference import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
# Every prompt over 2 tokens is prefilled on the prefill instance, cached or not.
REMOTE = DisaggregationConfig(local_prefill_max_tokens=2, local_prefill_cached_fraction=1.0)


def _kill_mid_stream(ray, llm: LLM, prompts: list[str], victim: int, sigkill: bool) -> list:
    """Stream the prompts (two at a time) and kill rank ``victim`` a few steps in."""
    group = llm.instance
    leader, target = group.leader, group.workers[victim]
    pid = ray.get(target.__ray_call__.remote(lambda _: os.getpid())) if sigkill else 0
    items = [GenerateItem(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    pending = leader.generate.remote(items)
    deadline = time.monotonic() + 60
    while ray.get(leader.elastic_status.remote()).steps < 4:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.001)
    if sigkill:
        os.kill(pid, signal.SIGKILL)
    else:
        ray.kill(target)
    done, _ = ray.wait([pending], timeout=0)
    assert not done, "the kill came after the stream ended"
    return [o.outputs[0].token_ids for o in ray.get(pending, timeout=120)]


def test_killing_a_follower_mid_stream_keeps_greedy_tokens(ray_session, references) -> None:
    """Mixtral (4 experts), ep=2: rank 1 (experts 2, 3) dies; rank 0 reads them and goes on."""
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        expert_parallel_size=2,
        num_cpus_per_rank=0.5,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    try:
        tokens = _kill_mid_stream(ray_session, llm, prompts, victim=1, sigkill=True)
        assert tokens == reference  # no repeated, no missing token
        status = ray_session.get(llm.instance.leader.elastic_status.remote())
        assert status.members == (0,) and len(status.recoveries) == 1
        recovery = status.recoveries[0]
        assert recovery.dead == (1,) and recovery.loaded_slots == 2 * 3  # 2 experts x 3 layers
        assert recovery.resumed_at > recovery.failed_at
        # The controller's read of the expert counters drops the dead rank and counts it.
        instance = Instance("d0", "decode", llm.instance)
        load = ExpertLoadReader().read([instance], 30)["d0"]
        assert len(llm.instance.workers) == 1 and load.ep_rank_failures == 1
        assert load.ep_ranks == 1
        assert sorted(load.tokens) == [0, 1, 2]
        # A request submitted after the kill is served by the survivor.
        after = llm.generate(prompts[:2], GREEDY)
        assert [o.outputs[0].token_ids for o in after] == reference[:2]
        llm.check_idle()
    finally:
        llm.shutdown()


def test_replicas_on_survivors_spare_the_checkpoint(ray_session, references, monkeypatch) -> None:
    """ep=4 with 4 redundant slots: every expert has a replica elsewhere, so the three
    survivors re-place rank 2's experts without reading the checkpoint. Over gloo (the
    test above uses shared memory): the surviving followers, waiting for the next plan,
    are released by the leader leaving the old group."""
    monkeypatch.setenv("PDSERVE_SHM_COLLECTIVES", "0")
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        expert_parallel_size=4,
        redundant_experts=4,
        num_cpus_per_rank=0.5,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    try:
        tokens = _kill_mid_stream(ray_session, llm, prompts, victim=2, sigkill=False)
        assert tokens == reference
        status = ray_session.get(llm.instance.leader.elastic_status.remote())
        assert status.members == (0, 1, 3) and status.recoveries[0].loaded_slots == 0
        _, placement = ray_session.get(llm.instance.leader.expert_placement.remote())
        assert all(len(slots) == 6 and set(slots) == {0, 1, 2, 3} for slots in placement.values())
        after = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in after] == reference
        llm.check_idle()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("connector", ["shm", "p2p"])
def test_disaggregated_decode_loses_a_rank_and_prefill_routes_follow(
    ray_session, references, connector
) -> None:
    """Prefill (1 rank) -> decode (ep=2): decode rank 1 is killed mid-stream. The decode
    leader regroups and re-pairs; the prefill rank drops its route to the lost rank;
    streams in flight and requests sent after (KV from the prefill) match transformers."""
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector=connector,
        decode=dict(expert_parallel_size=2),
        num_cpus_per_rank=0.5,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        disaggregation=REMOTE,
    )
    prefill, decode = llm.backend.prefill, llm.backend.decode
    routes = prefill.leader.__ray_call__.remote(
        lambda a: [(r.src_rank, r.dst_rank) for r in a.worker.transfer.routes[decode.instance_id]]
    )
    try:
        assert ray_session.get(routes) == [(0, 0), (0, 1)]
        pid = ray_session.get(decode.group.workers[1].__ray_call__.remote(lambda _: os.getpid()))
        outputs: list = []
        stream = threading.Thread(target=lambda: outputs.extend(llm.generate(prompts, GREEDY)))
        stream.start()
        deadline = time.monotonic() + 60
        while ray_session.get(decode.leader.elastic_status.remote()).steps < 4:
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.001)
        os.kill(pid, signal.SIGKILL)
        assert stream.is_alive(), "the kill came after the stream ended"
        stream.join(timeout=120)
        assert [o.outputs[0].token_ids for o in outputs] == reference  # none repeated or missing
        status = ray_session.get(decode.leader.elastic_status.remote())
        assert status.members == (0,) and status.recoveries[0].dead == (1,)
        # The prefill rank re-planned from the decode's new layout: one route, to rank 0.
        routes = prefill.leader.__ray_call__.remote(
            lambda a: [
                (r.src_rank, r.dst_rank) for r in a.worker.transfer.routes[decode.instance_id]
            ]
        )
        assert ray_session.get(routes) == [(0, 0)]
        assert ray_session.get(decode.leader.kv_spec.remote()).layout.world_size == 1
        # New requests after the kill: their KV comes from the prefill instance.
        remote = sum(1 for p in prompts if len(p) > 2)
        before = ray_session.get(prefill.leader.stats.remote()).leases["committed"]
        assert before == remote
        after = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in after] == reference
        p = ray_session.get(prefill.leader.stats.remote())
        assert p.leases["committed"] == 2 * remote and p.sent["failures"] == 0
        llm.check_idle()
    finally:
        llm.shutdown()


def test_a_decode_rank_dead_before_its_pages_were_sent_falls_back_to_recompute(
    ray_session, references
) -> None:
    """Decode rank 1 dies while the pair is idle: until the decode instance notices (its
    next step) and re-pairs, a prefill's send to the lost rank fails; that request is
    prefilled on the decode instance instead. Every request ends with reference tokens."""
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector="object_store",
        decode=dict(expert_parallel_size=2),
        num_cpus_per_rank=0.5,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        disaggregation=REMOTE,
    )
    decode = llm.backend.decode
    try:
        pid = ray_session.get(decode.group.workers[1].__ray_call__.remote(lambda _: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        outputs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert ray_session.get(decode.leader.elastic_status.remote()).members == (0,)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
        llm.check_idle()
    finally:
        llm.shutdown()


def test_a_prefill_instance_loses_a_rank_and_sends_from_the_survivor(
    ray_session, references
) -> None:
    """Prefill ep=2 -> decode (1 rank), point-to-point: prefill rank 1 dies while idle; the
    next prefill step (it sends KV) fails, regroups and runs again on rank 0, which held
    every route already (attention is replicated: the lowest rank is every head's source)."""
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector="p2p",
        prefill=dict(expert_parallel_size=2),
        num_cpus_per_rank=0.5,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        disaggregation=REMOTE,
    )
    prefill = llm.backend.prefill
    try:
        pid = ray_session.get(prefill.group.workers[1].__ray_call__.remote(lambda _: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        outputs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        status = ray_session.get(prefill.leader.elastic_status.remote())
        assert status.members == (0,) and len(status.recoveries) == 1
        assert ray_session.get(prefill.leader.kv_spec.remote()).layout.world_size == 1
        p = ray_session.get(prefill.leader.stats.remote())
        assert p.leases["committed"] == sum(1 for q in prompts if len(q) > 2)
        llm.check_idle()
    finally:
        llm.shutdown()


def test_a_step_run_again_does_not_wait_again_for_pages_that_landed() -> None:
    """The step an elastic leader re-runs on the survivors carries the same arrivals: the
    pages landed (and their marks were consumed) the first time."""
    transfer = RankTransfer("d", 0, Layout(1, 1, 1, ((0, 2),)), 2, "object_store", 0.5)
    plan = StepPlan(7, [], kv_arrivals=[KVArrival("r", [1])])
    transfer.receiver.record_mark("r")  # the one route into this rank finished
    transfer.before_step(plan)
    transfer.before_step(plan)  # the re-run: returns at once (no TransferError)
    with pytest.raises(TransferError):  # a later step with the arrival again does wait
        transfer.before_step(StepPlan(8, [], kv_arrivals=[KVArrival("r", [1])]))
    transfer.close()


@pytest.mark.parametrize(
    "options",
    [
        dict(elastic_ep=True),  # no expert parallelism
        dict(elastic_ep=True, expert_parallel_size=2, tensor_parallel_size=2),  # KV shards
    ],
)
def test_elastic_ep_on_a_layout_that_cannot_take_it_is_refused(references, options) -> None:
    folder, _, _ = references("mixtral")
    with pytest.raises(InvalidArgumentError) as err:
        LLM(str(folder), num_cpus_per_rank=0.5, **options)
    assert err.value.field == "elastic_ep"


def test_shrinking_a_placement_keeps_the_survivors_experts() -> None:
    """8 experts + 4 replicas over 4 ranks, rank 1 (experts 3, 4, 5) lost: the
    survivors keep theirs, 4 and 5 replace replicas, 3 is already on rank 3."""
    old = static_placement(8, 4, 4)  # (0 1 2)(3 4 5)(6 7 0)(1 2 3)
    new = shrink(old, [0, 2, 3], 8)
    new.check(8)
    assert new.ep == 3 and new.slots_per_rank == 3
    for i, r in enumerate([0, 2, 3]):
        kept = set(old.rank_slots(r)) & set(new.rank_slots(i))
        assert len(kept) >= 2
    assert shrink(old, [0, 2, 3], 8) == new  # every survivor computes the same
    # Slots grow where the survivors could not hold every expert otherwise.
    assert shrink(static_placement(8, 0, 4), [0, 1, 3], 8).slots_per_rank == 3
    assert shrink(Placement((0, 1, 2, 2, 3, 3), 2), [1], 4).slots == (0, 1, 2, 3)
