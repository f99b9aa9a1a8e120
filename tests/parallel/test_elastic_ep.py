"""Elastic EP on real ranks: a follower rank is killed mid-stream; the survivor keeps serving."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster.expert_load import ExpertLoadReader
from pdserve.cluster.instances import Instance
from pdserve.core.errors import InvalidArgumentError
from pdserve.parallel.eplb import Placement, shrink, static_placement
from pdserve.parallel.worker import GenerateItem
from tests.reference import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


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
