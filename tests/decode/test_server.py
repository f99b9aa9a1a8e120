"""The decode role around a real one-rank engine, its peers fake actors (no Ray).

Each test builds a :class:`DecodeServer` on the tiny model with its lease and
heartbeat timers sped up, and checks one promise: where a prompt is prefilled,
what a reservation holds, what a hand-off starts, what reaches a subscriber, and
that every way a reservation can end (commit, expiry, abort, cancel, a lost
prefill instance) frees its pages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pdserve.decode.server as decode_server
from pdserve.core.config import DisaggregationConfig
from pdserve.core.errors import InstanceFailedError, OverloadedError
from pdserve.core.layout import Layout
from pdserve.core.messages import DecodeRequest, Reservation, ReserveRequest, TokenBatch
from pdserve.core.step import KVArrival
from pdserve.decode.server import DecodeServer
from pdserve.engine.engine import EngineCore
from pdserve.transfer.handoff import HandOff
from tests.fakes import FAKE_RAY, FakeActor
from tests.servers import eventually, executor_of, greedy, one_rank, tiny_engine

PROMPT = list(range(5, 35))  # 30 tokens (8 pages): prefilled elsewhere
SHORT = [5, 6, 7, 8]  # at most local_prefill_max_tokens: prefilled here


@pytest.fixture
def engine(tiny_path: Path) -> Iterator[EngineCore]:
    engine = tiny_engine(tiny_path)
    yield engine
    engine.shutdown()


@pytest.fixture
def make_server(
    engine: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., DecodeServer]]:
    monkeypatch.setattr(decode_server, "ray", FAKE_RAY)
    monkeypatch.setattr(decode_server, "LEASE_CHECK_S", 0.02)
    monkeypatch.setattr(decode_server, "HEARTBEAT_S", 0.02)
    servers: list[DecodeServer] = []

    def make(needs_arrival_marks: bool = False) -> DecodeServer:
        config = DisaggregationConfig(local_prefill_max_tokens=len(SHORT))
        servers.append(
            DecodeServer("d0", engine, one_rank(engine.model), needs_arrival_marks, config)
        )
        return servers[-1]

    yield make
    for server in servers:
        server.loop.stop()
        if server.loop.fatal is None:
            engine.check_integrity()


@pytest.fixture
def server(make_server: Callable[..., DecodeServer]) -> DecodeServer:
    return make_server()


def prefill_actor(drop_gate: threading.Event | None = None) -> FakeActor:
    """A prefill leader: answers pings, and drops requests (once ``drop_gate`` opens)."""
    return FakeActor(
        ping=lambda: True,
        drop=lambda request_id: drop_gate is None or drop_gate.wait(30),
    )


def hand_off(res: Reservation, first_token: int = 7, prefill_id: str = "p0") -> HandOff:
    """What the prefill instance sends once ``res``'s pages are written."""
    prefill_layout = Layout(1, 1, 1, ((0, 4),))
    return HandOff(
        res.request_id,
        PROMPT,
        greedy(6),
        first_token,
        1,
        res.block_ids,
        prefill_id,
        prefill_layout,
        time.time(),
    )


def idle(server: DecodeServer) -> bool:
    return server.loop.wait_idle(10.0)


def finish_reason(server: DecodeServer, request_id: str) -> str | None:
    (out,) = server.wait([request_id], 30)
    return out.outputs[0].finish_reason


@pytest.fixture
def short_alone(engine: EngineCore) -> list[int]:
    """SHORT's greedy tokens from the engine run directly (ask before ``server``)."""
    return engine.generate([("reference", SHORT, greedy(6))])[0].outputs[0].token_ids


@pytest.fixture
def prompt_cached(engine: EngineCore) -> None:
    """Run PROMPT once (before ``server``): 28 of its 30 tokens stay in the prefix cache."""
    engine.generate([("earlier", PROMPT, greedy(2))])


def test_a_short_prompt_is_prefilled_here(short_alone: list[int], server: DecodeServer) -> None:
    res = server.reserve(ReserveRequest("r1", SHORT, greedy(6)), "p0", None)
    assert res == Reservation("r1", "d0", [], 0, res.ttl_s, local=True)
    (out,) = server.wait(["r1"], 30)
    assert out.outputs[0].token_ids == short_alone
    assert server.stats.reserved == 0 and server.leases.leases == {}
    assert idle(server)


def test_a_prompt_mostly_cached_here_is_prefilled_here(
    prompt_cached: None, server: DecodeServer
) -> None:
    res = server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), "p0", None)
    assert res.local
    assert finish_reason(server, "r1") == "length"
    assert idle(server)


def test_a_reservation_holds_the_prompts_pages_under_a_lease(server: DecodeServer) -> None:
    res = server.reserve(ReserveRequest("r1", PROMPT, greedy(6), ttl_s=30.0), "p0", None)
    assert not res.local and res.num_cached_tokens == 0 and res.ttl_s == 30.0
    assert len(res.block_ids) == 8
    table = server.loop.call(lambda engine: engine.kv.block_table("r1")).result()
    assert table == res.block_ids
    assert server.leases.leases["r1"].prefill_id == "p0"
    assert server.stats.reserved == 1
    assert not server.loop.call(lambda engine: engine.is_idle()).result()
    server.cancel("r1")
    assert idle(server)


def test_a_hand_off_starts_decoding_from_its_first_token(server: DecodeServer) -> None:
    res = server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), "p0", None)
    assert server.commit(hand_off(res, first_token=7))
    (out,) = server.wait(["r1"], 30)
    assert out.outputs[0].token_ids[0] == 7 and len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].finish_reason == "length"
    assert server.stats.committed == 1 and server.leases.leases == {}
    assert not server.commit(hand_off(res))  # the lease was taken once
    assert idle(server)


def test_every_new_token_reaches_the_subscriber_in_batches(server: DecodeServer) -> None:
    batches: list[TokenBatch] = []
    sink = FakeActor(deliver=batches.append)
    res = server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), "p0", sink)
    assert server.commit(hand_off(res, first_token=7))
    assert eventually(lambda: any(u.finished for b in batches for u in b.updates))
    assert idle(server)
    updates = [u for b in batches for u in b.updates]
    assert all(b.instance_id == "d0" for b in batches)
    assert all(u.request_id == "r1" for u in updates)
    # The first token went to the router from the prefill: five more follow.
    assert sum(len(u.new_token_ids) for u in updates) == 5
    last = updates[-1]
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 6
    assert {"transfer", "decode"} <= set(last.phases)
    assert not any(u.finished for u in updates[:-1])


def test_an_unclaimed_lease_expires_and_frees_its_pages(server: DecodeServer) -> None:
    res = server.reserve(ReserveRequest("r1", PROMPT, greedy(6), ttl_s=0.05), None, None)
    assert eventually(lambda: server.stats.expired == 1)
    assert finish_reason(server, "r1") == "abort"
    assert not server.commit(hand_off(res, prefill_id="p0"))
    assert idle(server)


def test_an_expired_lease_is_freed_only_once_its_prefill_dropped_the_request(
    server: DecodeServer,
) -> None:
    gate = threading.Event()
    prefill = prefill_actor(drop_gate=gate)
    server.register_prefill("p0", prefill, one_rank(server.loop.engine.model))
    server.reserve(ReserveRequest("r1", PROMPT, greedy(6), ttl_s=0.05), "p0", None)
    assert eventually(lambda: prefill.called("drop") == [("r1",)])
    # Until the prefill answers, it may still write into the pages: they stay held.
    time.sleep(0.1)
    assert server.leases.leases["r1"].revoking
    assert not server.loop.call(lambda engine: engine.is_idle()).result()
    assert not server.commit(hand_off(Reservation("r1", "d0", [], 0, 1.0)))
    gate.set()
    assert finish_reason(server, "r1") == "abort"
    assert server.stats.expired == 1 and server.leases.leases == {}
    assert idle(server)


def test_a_lost_prefill_instance_releases_only_its_reservations(server: DecodeServer) -> None:
    prefill = prefill_actor()
    server.register_prefill("p0", prefill, one_rank(server.loop.engine.model))
    server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), "p0", None)
    server.reserve(ReserveRequest("r2", list(range(100, 130)), greedy(6)), None, None)
    assert eventually(lambda: len(prefill.called("ping")) >= 2)  # heartbeats go out
    prefill.kill()
    assert eventually(lambda: server.stats.peer_lost == 1)
    assert finish_reason(server, "r1") == "abort"
    assert "p0" not in server.prefills
    assert list(server.leases.leases) == ["r2"]
    server.cancel("r2")
    assert idle(server)


def test_abort_ends_a_request_wherever_it_is(server: DecodeServer) -> None:
    server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), None, None)
    assert server.abort("r1")
    assert finish_reason(server, "r1") == "abort"
    server.submit(DecodeRequest("r2", SHORT, greedy(200)), None)
    assert eventually(lambda: executor_of(server.loop.engine).plans_of("r2"))
    assert server.abort("r2")
    assert finish_reason(server, "r2") == "abort"
    assert not server.abort("never-seen")
    assert server.stats.aborted == 2
    assert idle(server)


def test_a_full_instance_refuses_a_reservation_with_a_retry_hint(server: DecodeServer) -> None:
    reserved = []
    with pytest.raises(OverloadedError, match="no room") as err:
        for i in range(20):  # 64 pages hold 8 prompts of 8 pages
            prompt = list(range(40 * i + 100, 40 * i + 130))
            server.reserve(ReserveRequest(f"r{i}", prompt, greedy(6)), None, None)
            reserved.append(f"r{i}")
    assert err.value.retry_after_s == 0.5
    assert len(reserved) == 8 and server.stats.refused == 1
    for rid in reserved:
        server.cancel(rid)
    assert idle(server)


def test_cancel_frees_the_reservation_without_telling_the_subscriber(
    server: DecodeServer,
) -> None:
    sink = FakeActor(deliver=lambda batch: None)
    server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), "p0", sink)
    server.cancel("r1")
    assert idle(server)
    assert sink.called("deliver") == [] and server.leases.leases == {}


def test_with_arrival_marks_a_committed_request_waits_for_every_rank(
    make_server: Callable[..., DecodeServer],
) -> None:
    server = make_server(needs_arrival_marks=True)
    server.register_prefill("p0", prefill_actor(), one_rank(server.loop.engine.model))
    res = server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), "p0", None)
    assert server.commit(hand_off(res))
    assert finish_reason(server, "r1") == "length"
    plans = executor_of(server.loop.engine).plans_of("r1")
    assert plans[0].kv_arrivals == [KVArrival("r1", [1])]  # one route into the one rank
    assert all(p.kv_arrivals == [] for p in plans[1:])


def test_a_dead_rank_fails_every_waiter(server: DecodeServer) -> None:
    executor_of(server.loop.engine).fail = lambda plan: InstanceFailedError("rank 1 died")
    server.submit(DecodeRequest("r1", SHORT, greedy(6)), None)
    with pytest.raises(InstanceFailedError, match="decode d0 stopped: rank 1 died"):
        server.wait(["r1"], 30)


def test_a_hand_off_from_a_forgotten_prefill_is_refused_cleanly(
    make_server: Callable[..., DecodeServer],
) -> None:
    server = make_server(needs_arrival_marks=True)
    server.register_prefill("p0", prefill_actor(), one_rank(server.loop.engine.model))
    res = server.reserve(ReserveRequest("r1", PROMPT, greedy(6)), "p0", None)
    server.forget_prefill("p0")
    assert not server.commit(hand_off(res))
    assert finish_reason(server, "r1") == "abort"
    assert idle(server)


def test_each_reservation_ends_one_way_in_the_lease_stats(server: DecodeServer) -> None:
    gate = threading.Event()
    server.register_prefill("p0", prefill_actor(drop_gate=gate), one_rank(server.loop.engine.model))
    server.reserve(ReserveRequest("r1", PROMPT, greedy(6), ttl_s=0.05), "p0", None)
    assert eventually(lambda: server.stats.expired == 1)
    assert server.abort("r1")  # while the prefill has not answered the drop yet
    gate.set()
    assert finish_reason(server, "r1") == "abort"
    assert idle(server)
    s = server.stats
    assert s.reserved == s.committed + s.expired + s.aborted + s.peer_lost
