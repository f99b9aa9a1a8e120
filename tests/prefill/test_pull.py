"""A prefill instance pulls a prompt's prefix from a peer prefill instance's cache.

Two real one-rank engines in one process: the peer prefilled the prompt before
and holds its pages; the puller is asked to prefill the same prompt with the
peer named. The peer's export copies its cached pages into the puller's
reserved pages (the test's stand-in for a rank's connector); the puller then
computes only the rest, and its first token is the one a lone engine gives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.core.errors import RequestAbortedError
from pdserve.core.messages import PeerPrefix, PrefillRequest
from pdserve.prefill.server import PrefillServer
from tests.fakes import FakeActor
from tests.servers import BLOCK_SIZE, executor_of, greedy, one_rank, send_pages_between, tiny_engine

PROMPT = list(range(11, 11 + 5 * BLOCK_SIZE + 2))


@pytest.fixture
def pair(tiny_path: Path) -> Iterator[tuple[PrefillServer, PrefillServer, int]]:
    """(puller, peer, the prompt's first token from one engine)."""
    peer_engine, puller_engine = tiny_engine(tiny_path), tiny_engine(tiny_path)
    (out,) = peer_engine.generate([("ref", PROMPT, greedy(1))])
    send_pages_between(peer_engine, puller_engine)
    layout = one_rank(peer_engine.model)
    peer, puller = (
        PrefillServer("p1", peer_engine, layout),
        PrefillServer("p0", puller_engine, layout),
    )
    puller.register_peer("p1", FakeActor(peer), layout)
    peer.register_peer("p0", FakeActor(puller), layout)
    yield puller, peer, out.outputs[0].token_ids[0]
    for server in (puller, peer):
        server.loop.stop()
        server.loop.engine.shutdown()


def prompt_tokens_computed(server: PrefillServer, request_id: str) -> int:
    plans = executor_of(server.loop.engine).plans_of(request_id)
    return sum(s.num_tokens for p in plans for s in p.seqs if s.request_id == request_id)


def test_the_prefix_comes_from_the_peer_and_the_first_token_is_one_engines(
    pair: tuple[PrefillServer, PrefillServer, int],
) -> None:
    puller, peer, first = pair
    request = PrefillRequest("r", PROMPT, greedy(4), peer=PeerPrefix("p1", 5))
    assert puller.prefill(request).result(30).token_id == first
    assert prompt_tokens_computed(puller, "r") == len(PROMPT) - 5 * BLOCK_SIZE
    assert peer.stats.exported == 1 and puller.stats.peer_filled == 1
    assert puller.loop.wait_idle(10) and peer.loop.wait_idle(10)
    puller.loop.engine.assert_idle()
    peer.loop.engine.assert_idle()


def test_a_peer_without_the_prefix_costs_a_recompute(
    pair: tuple[PrefillServer, PrefillServer, int],
) -> None:
    puller, peer, first = pair
    peer.loop.call(lambda e: e.kv.reset_prefix_cache()).result()
    request = PrefillRequest("r", PROMPT, greedy(4), peer=PeerPrefix("p1", 5))
    assert puller.prefill(request).result(30).token_id == first
    assert prompt_tokens_computed(puller, "r") == len(PROMPT)
    assert puller.stats.peer_filled == 0
    assert puller.loop.wait_idle(10)
    puller.loop.engine.assert_idle()


def test_a_drop_while_pulling_frees_the_pages_once_the_peer_answered(
    pair: tuple[PrefillServer, PrefillServer, int],
) -> None:
    puller, peer, _ = pair
    gate = threading.Event()
    executor_of(peer.loop.engine).gate = gate  # the export waits inside the peer's loop
    future = puller.prefill(PrefillRequest("gone", PROMPT, greedy(4), peer=PeerPrefix("p1", 5)))
    assert puller.drop("gone")
    with pytest.raises(RequestAbortedError):
        future.result(10)
    assert not puller.loop.wait_idle(0.2), "its pages stay reserved while the peer may write"
    gate.set()
    assert puller.loop.wait_idle(10) and peer.loop.wait_idle(10)
    puller.loop.engine.assert_idle()
    assert prompt_tokens_computed(puller, "gone") == 0


def test_an_unknown_peer_is_ignored(pair: tuple[PrefillServer, PrefillServer, int]) -> None:
    puller, _, first = pair
    request = PrefillRequest("r", PROMPT, greedy(4), peer=PeerPrefix("p9", 5))
    assert puller.prefill(request).result(30).token_id == first
    assert prompt_tokens_computed(puller, "r") == len(PROMPT)
