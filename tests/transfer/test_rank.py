"""A rank's transfer hooks move each layer's pages, re-sharded, over every connector.

Two prefill ranks (TP=2, two KV heads each) stream a request's pages into one
decode rank (TP=1, all four heads) through :class:`RankTransfer`, all in this
process: ``on_layer`` after each layer, ``after_step`` to end the routes and
flush, ``before_step`` on the decode side to wait for the pages. Ray is stood
in for as in ``test_connectors``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.core.errors import TransferError
from pdserve.core.layout import Layout
from pdserve.core.step import KVArrival, KVSend, ScheduledSeq, StepPlan
from pdserve.transfer import object_store, pairs, shm
from pdserve.transfer.rank import RankTransfer
from pdserve.transfer.routes import plan_routes, routes_into
from tests.fakes import FAKE_RAY, FakeActor

LAYERS, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 4, 4, 8, 4, 8
PREFILL = Layout(2, 1, 1, ((0, LAYERS),))
DECODE = Layout(1, 1, 1, ((0, LAYERS),))
SRC_BLOCKS, DST_BLOCKS = [1, 2, 5], [6, 0, 3]


@pytest.fixture
def no_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    monkeypatch.setattr(object_store, "ray", FAKE_RAY)
    monkeypatch.setattr(pairs, "ray", FAKE_RAY)


# "auto": both sides' own connector is shm, the decode rank is on another node
@pytest.fixture(params=["shm", "object_store", "p2p", "auto"])
def ranks(
    request: pytest.FixtureRequest, no_ray: None
) -> Iterator[tuple[list[RankTransfer], RankTransfer]]:
    """Two paired prefill ranks, each with a cache of distinct values, and the decode rank."""
    connector, across = request.param, None
    if connector == "auto":
        connector, across = "shm", "object_store"
    decode = RankTransfer(
        "d0", 0, DECODE, KV_HEADS, connector, 30, across_nodes=across, node_id="node-b"
    )
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    decode.receiver.allocate(shape, torch.float32, torch.device("cpu"))
    # The decode rank's actor methods the object-store and p2p connectors call.
    receiver: Any = decode.receiver
    actor = FakeActor(
        receive_pages=lambda *args: decode.receive_message(*args),
        kv_accept=lambda pair_id: receiver.accept(pair_id),
    )
    endpoint = decode.endpoint(actor, "node-b")
    prefills = []
    for rank in range(2):
        prefill = RankTransfer(
            "p0", rank, PREFILL, KV_HEADS, connector, across_nodes=across, node_id="node-a"
        )
        numel = LAYERS * 2 * BLOCKS * BLOCK_SIZE * 2 * HEAD_DIM
        cache = torch.arange(float(numel)) + rank * numel
        prefill.kv_cache = cache.view(LAYERS, 2, BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
        prefill.pair(DECODE, [endpoint])
        prefills.append(prefill)
    yield prefills, decode
    for transfer in [*prefills, decode]:
        transfer.close()


def step(final: bool) -> StepPlan:
    seq = ScheduledSeq("r1", [3] * 10, 0, SRC_BLOCKS)
    return StepPlan(1, [seq], kv_sends=[KVSend("r1", "d0", SRC_BLOCKS, DST_BLOCKS, final)])


def test_pages_land_in_the_decode_rank_resharded_by_head(ranks) -> None:
    prefills, decode = ranks
    plan = step(final=True)
    for prefill in prefills:
        for layer in range(LAYERS):
            prefill.on_layer(layer, plan)
        assert prefill.after_step(plan)
    if decode.receiver.needs_arrival_marks:
        # The decode rank waits for one end mark per route into it (two prefill ranks);
        # other connectors' pages are in place once the senders' flush returned.
        expected = routes_into(plan_routes(KV_HEADS, PREFILL, DECODE), 0)
        assert expected == 2
        decode.before_step(StepPlan(2, [], kv_arrivals=[KVArrival("r1", [expected])]))
    got = decode.receiver.kv_cache
    assert got is not None
    for rank, prefill in enumerate(prefills):
        assert prefill.kv_cache is not None
        heads = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(got[:, :, DST_BLOCKS, :, heads], prefill.kv_cache[:, :, SRC_BLOCKS])
    untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
    assert got[:, :, untouched].abs().sum() == 0


def test_requests_of_one_step_share_one_message_per_layer_and_rank(ranks) -> None:
    """Two requests stream to one decode rank: each layer is one message with two runs."""
    prefills, decode = ranks
    other_src, other_dst = [3, 4], [1, 2]  # consecutive on both sides
    seqs = [ScheduledSeq("r1", [3] * 10, 0, SRC_BLOCKS), ScheduledSeq("r2", [4] * 5, 0, other_src)]
    sends = [
        KVSend("r1", "d0", SRC_BLOCKS, DST_BLOCKS, True),
        KVSend("r2", "d0", other_src, other_dst, True),
    ]
    plan = StepPlan(1, seqs, kv_sends=sends)
    for prefill in prefills:
        for layer in range(LAYERS):
            prefill.on_layer(layer, plan)
        assert prefill.after_step(plan)
        assert sum(sender.stats.messages for sender in prefill.senders()) == LAYERS
    if decode.receiver.needs_arrival_marks:
        arrivals = [KVArrival(r, [2]) for r in ("r1", "r2")]
        decode.before_step(StepPlan(2, [], kv_arrivals=arrivals))
    got = decode.receiver.kv_cache
    assert got is not None
    for rank, prefill in enumerate(prefills):
        assert prefill.kv_cache is not None
        heads = slice(2 * rank, 2 * rank + 2)
        for src, dst in ((SRC_BLOCKS, DST_BLOCKS), (other_src, other_dst)):
            assert torch.equal(got[:, :, dst, :, heads], prefill.kv_cache[:, :, src])
    untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS + other_dst]
    assert got[:, :, untouched].abs().sum() == 0


def test_a_step_without_sends_moves_nothing(ranks) -> None:
    prefills, decode = ranks
    plan = StepPlan(1, [ScheduledSeq("r1", [3], 0, SRC_BLOCKS)])
    prefills[0].on_layer(0, plan)
    assert prefills[0].after_step(plan)
    assert decode.receiver.kv_cache is not None
    assert decode.receiver.kv_cache.abs().sum() == 0
    assert prefills[0].sender.stats.messages == 0


def test_a_missing_end_mark_times_out_on_the_decode_rank(no_ray: None) -> None:
    decode = RankTransfer("d0", 0, DECODE, KV_HEADS, "p2p", arrival_timeout_s=0.05)
    assert decode.receiver.needs_arrival_marks
    try:
        with pytest.raises(TransferError, match="pages of r1 did not arrive"):
            decode.before_step(StepPlan(2, [], kv_arrivals=[KVArrival("r1", [1])]))
    finally:
        decode.close()


def test_marks_of_a_request_that_ended_before_its_wait_are_dropped(no_ray: None) -> None:
    """A request aborted, expired or ended at its first token leaves no mark behind."""
    decode = RankTransfer("d0", 0, DECODE, KV_HEADS, "p2p", arrival_timeout_s=0.05)
    try:
        decode.receiver.record_mark("r1")
        decode.receiver.record_mark("r2")
        decode.before_step(StepPlan(3, [], finished_request_ids=["r1"]))
        assert not decode.receiver.wait_landed("r1", 1, 0.0)
        assert decode.receiver.wait_landed("r2", 1, 0.0)
    finally:
        decode.close()


def test_requests_that_end_while_nothing_runs_reach_the_ranks_with_the_next_step() -> None:
    from pdserve.core.config import SchedulerConfig
    from pdserve.core.request import Request, RequestStatus
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.kv_cache_manager import KVCacheManager
    from pdserve.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(16, 4), 64)
    scheduler.reserve(Request("gone", [1, 2, 3], SamplingParams()))
    scheduler.finish("gone", RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().is_empty  # nothing runs: this plan is never executed
    scheduler.add_request(Request("next", [4, 5, 6], SamplingParams()))
    assert scheduler.schedule().finished_request_ids == ["gone"]


def test_auto_sends_to_its_own_node_over_shm_and_to_another_over_the_object_store(
    no_ray: None,
) -> None:
    """``auto`` picks per decode rank by the Ray node each runs on; a named connector is
    used for every rank, wherever it runs."""
    prefill = RankTransfer(
        "p0", 0, DECODE, KV_HEADS, "shm", across_nodes="object_store", node_id="a"
    )
    decodes = {
        node: RankTransfer(f"d-{node}", 0, DECODE, KV_HEADS, "shm", 30, "object_store", node)
        for node in ("a", "b")
    }
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    prefill.kv_cache = torch.arange(float(torch.Size(shape).numel())).view(shape)
    try:
        for node, decode in decodes.items():
            decode.receiver.allocate(shape, torch.float32, torch.device("cpu"))
            actor = FakeActor(receive_pages=decode.receive_message)
            prefill.pair(DECODE, [decode.endpoint(actor, node)])
        assert prefill.remote is not None
        assert set(prefill.sender.endpoints) == {("d-a", 0)}
        assert set(prefill.remote.endpoints) == {("d-b", 0)}
        seq = ScheduledSeq("r1", [3] * 10, 0, SRC_BLOCKS)
        sends = [KVSend("r1", f"d-{n}", SRC_BLOCKS, DST_BLOCKS, True) for n in "ab"]
        plan = StepPlan(1, [seq], kv_sends=sends)
        for layer in range(LAYERS):
            prefill.on_layer(layer, plan)
        assert prefill.after_step(plan)
        for decode in decodes.values():
            got = decode.receiver.kv_cache
            assert got is not None
            assert torch.equal(got[:, :, DST_BLOCKS], prefill.kv_cache[:, :, SRC_BLOCKS])
        counted = {(d, s.connector): s.messages for d, s in prefill.stats()}
        assert counted == {
            ("sent", "shm"): LAYERS,
            ("received", "shm"): 0,
            ("sent", "object_store"): LAYERS,
        }
        assert [(d, s.connector, s.messages) for d, s in decodes["b"].stats()][-1] == (
            "received",
            "object_store",
            LAYERS,
        )
        # the rank on node b comes back on node a: shm again, the object store's entry gone
        prefill.pair(DECODE, [decodes["b"].endpoint(FakeActor(), "a")])
        assert set(prefill.sender.endpoints) == {("d-a", 0), ("d-b", 0)}
        assert prefill.remote.endpoints == {}
        # a named connector: the same for every node (shm refuses one it cannot reach)
        named = RankTransfer("p1", 0, DECODE, KV_HEADS, "shm", node_id="a")
        named.pair(DECODE, [decodes["b"].endpoint(FakeActor(), "b")])
        assert named.remote is None and set(named.sender.endpoints) == {("d-b", 0)}
        named.close()
    finally:
        for transfer in [prefill, *decodes.values()]:
            transfer.close()


def test_a_rank_of_a_named_connector_refuses_object_store_messages(no_ray: None) -> None:
    decode = RankTransfer("d0", 0, DECODE, KV_HEADS, "shm")
    try:
        with pytest.raises(TransferError, match="takes pages over shm, not the object store"):
            decode.receive_message(b"", np.zeros(0, np.uint8), np.zeros(0, np.uint8))
    finally:
        decode.close()
