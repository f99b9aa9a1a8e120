"""A decode instance pre-filled from a peer prefill instance's cache, in one process.

The prefill server holds a prompt's prefix in its device pool (it prefilled the
prompt earlier); the decode server is asked to reserve for the same prompt with
that peer named. The peer's export copies its cached pages into the decode
engine's pages (the test's stand-in for a rank's connector, as in
``test_pair``); the decode engine then computes only the rest, and its tokens
equal one engine's run of the prompt.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import pdserve.decode.server as decode_server
from pdserve.core.config import DisaggregationConfig
from pdserve.core.messages import PeerPrefix, ReserveRequest
from pdserve.decode.server import DecodeServer
from pdserve.engine.engine import EngineCore
from pdserve.prefill.server import PrefillServer
from tests.fakes import FAKE_RAY, FakeActor
from tests.servers import BLOCK_SIZE, executor_of, greedy, one_rank, send_pages_between, tiny_engine

PROMPT = list(range(7, 7 + 6 * BLOCK_SIZE + 3))  # six full pages and a partial one


@pytest.fixture
def engines(tiny_path: Path) -> Iterator[tuple[EngineCore, EngineCore]]:
    prefill, decode = tiny_engine(tiny_path), tiny_engine(tiny_path)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


@pytest.fixture
def alone(engines: tuple[EngineCore, EngineCore]) -> list[int]:
    """The prompt's greedy tokens from the prefill engine, which then holds its pages."""
    (out,) = engines[0].generate([("ref", PROMPT, greedy(8))])
    return out.outputs[0].token_ids


@pytest.fixture
def servers(
    engines: tuple[EngineCore, EngineCore], alone: list[int], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[PrefillServer, DecodeServer, FakeActor]]:
    monkeypatch.setattr(decode_server, "ray", FAKE_RAY)
    prefill_engine, decode_engine = engines
    send_pages_between(prefill_engine, decode_engine)
    layout = one_rank(prefill_engine.model)
    prefill = PrefillServer("p0", prefill_engine, layout)
    decode = DecodeServer("d0", decode_engine, layout, False, DisaggregationConfig())
    actor = FakeActor(prefill, ping=lambda: True)
    prefill.register_decode("d0", FakeActor(decode))
    decode.register_prefill("p0", actor, layout)
    yield prefill, decode, actor
    prefill.loop.stop()
    decode.loop.stop()


def computed_here(decode: DecodeServer, request_id: str) -> int:
    """Prompt tokens the decode engine computed for the request."""
    plans = executor_of(decode.loop.engine).plans_of(request_id)
    seqs = [s for p in plans for s in p.seqs if s.request_id == request_id]
    return sum(
        min(s.num_tokens, len(PROMPT) - s.start_pos) for s in seqs if s.start_pos < len(PROMPT)
    )


def reserve(decode: DecodeServer, request_id: str, peer: PeerPrefix | None) -> bool:
    request = ReserveRequest(request_id, PROMPT, greedy(8), peer=peer)
    return decode.reserve(request, "p0", None).local


def test_the_peers_pages_are_reused_and_the_tokens_equal_one_engines(
    alone: list[int], servers: tuple[PrefillServer, DecodeServer, FakeActor]
) -> None:
    prefill, decode, _ = servers
    assert reserve(decode, "r", PeerPrefix("p0", 6)), "mostly held by the peer: prefilled here"
    (out,) = decode.wait(["r"], 60)
    assert out.outputs[0].token_ids == alone
    assert computed_here(decode, "r") == len(PROMPT) - 6 * BLOCK_SIZE
    assert prefill.stats.exported == 1 and decode.stats.peer_filled == 1
    assert prefill.loop.wait_idle(10) and decode.loop.wait_idle(10)
    prefill.loop.engine.assert_idle()
    decode.loop.engine.assert_idle()


def test_a_peer_that_lost_the_prefix_or_died_costs_a_recompute_not_a_wrong_token(
    alone: list[int], servers: tuple[PrefillServer, DecodeServer, FakeActor]
) -> None:
    prefill, decode, actor = servers
    prefill.loop.call(lambda e: e.kv.reset_prefix_cache()).result()
    assert reserve(decode, "lost", PeerPrefix("p0", 6))
    (lost,) = decode.wait(["lost"], 60)
    decode.loop.call(lambda e: e.kv.reset_prefix_cache()).result()
    actor.kill()
    assert reserve(decode, "dead", PeerPrefix("p0", 6))
    (dead,) = decode.wait(["dead"], 60)
    assert lost.outputs[0].token_ids == dead.outputs[0].token_ids == alone
    assert computed_here(decode, "lost") == computed_here(decode, "dead") == len(PROMPT)
    assert decode.stats.peer_filled == 0
    assert decode.loop.wait_idle(10)
    decode.loop.engine.assert_idle()


def test_a_short_peer_prefix_or_an_unpaired_peer_leaves_the_ordinary_path(
    servers: tuple[PrefillServer, DecodeServer, FakeActor],
) -> None:
    prefill, decode, _ = servers
    assert not reserve(decode, "short", PeerPrefix("p0", 2)), "too little to prefill here"
    assert not reserve(decode, "stranger", PeerPrefix("p9", 6)), "not paired with this decode"
    assert prefill.stats.exported == 0
    for rid in ("short", "stranger"):
        decode.abort(rid)
    assert decode.loop.wait_idle(10)
    decode.loop.engine.assert_idle()


def test_an_abort_before_the_pages_landed_frees_everything_once(
    servers: tuple[PrefillServer, DecodeServer, FakeActor],
) -> None:
    prefill, decode, _ = servers
    gate = threading.Event()
    executor_of(prefill.loop.engine).gate = gate  # the export waits inside the peer's loop
    assert reserve(decode, "gone", PeerPrefix("p0", 6))
    assert decode.abort("gone")
    gate.set()
    (out,) = decode.wait(["gone"], 30)
    assert out.outputs[0].finish_reason == "abort"
    assert prefill.loop.wait_idle(10) and decode.loop.wait_idle(10)
    decode.loop.engine.assert_idle()
    prefill.loop.engine.assert_idle()


def test_a_peer_serves_a_tenants_pages_to_that_tenant_only(
    alone: list[int], servers: tuple[PrefillServer, DecodeServer, FakeActor]
) -> None:
    # The peer holds the prompt's pages of the shared tenant (``alone``) and of tenant t.
    prefill, decode, _ = servers
    salted = dataclasses.replace(greedy(8), cache_salt="t")
    prefill.loop.call(lambda e: e.generate([("t-ref", PROMPT, salted)])).result()
    for rid, salt, filled in (("t", "t", 1), ("u", "u", 1)):  # u's: none filled
        params = dataclasses.replace(greedy(8), cache_salt=salt)
        request = ReserveRequest(rid, PROMPT, params, peer=PeerPrefix("p0", 6))
        assert decode.reserve(request, "p0", None).local
        (out,) = decode.wait([rid], 60)
        assert out.outputs[0].token_ids == alone
        assert decode.stats.peer_filled == filled, rid  # u's hashes name no page of the peer
    assert computed_here(decode, "t") == len(PROMPT) - 6 * BLOCK_SIZE
    assert computed_here(decode, "u") == len(PROMPT)
    assert prefill.loop.wait_idle(10) and decode.loop.wait_idle(10)
    decode.loop.engine.assert_idle()
