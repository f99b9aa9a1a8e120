"""A prefill server hands requests to a decode server, in one process, without Ray.

Both servers run real one-rank engines on the tiny model and reach each other
through :class:`~tests.fakes.FakeActor` handles, the router's part played by the
test. After each prefill step the prefill executor copies the step's
``kv_sends`` into the decode engine's cache, as a rank's connector would. The
decode instance must then produce exactly the tokens the model gives when one
engine runs the request alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pdserve.decode.server as decode_server
from pdserve.core.config import DisaggregationConfig
from pdserve.core.messages import PrefillRequest, ReserveRequest
from pdserve.decode.server import DecodeServer
from pdserve.engine.engine import EngineCore
from pdserve.prefill.server import PrefillServer
from tests.fakes import FAKE_RAY, FakeActor
from tests.servers import executor_of, greedy, one_rank, send_pages_between, tiny_engine

PROMPTS = [list(range(5, 35)), list(range(200, 241)), list(range(5, 25)) + [900] * 9]


@pytest.fixture
def engines(tiny_path: Path) -> Iterator[tuple[EngineCore, EngineCore]]:
    prefill, decode = tiny_engine(tiny_path), tiny_engine(tiny_path)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


@pytest.fixture
def alone(engines: tuple[EngineCore, EngineCore]) -> list[list[int]]:
    """Each prompt's greedy tokens from one engine (asked before the servers start)."""
    engine = engines[0]
    outs = engine.generate([(f"ref{i}", p, greedy(8)) for i, p in enumerate(PROMPTS)])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def pair(
    engines: tuple[EngineCore, EngineCore], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[PrefillServer, DecodeServer]]:
    monkeypatch.setattr(decode_server, "ray", FAKE_RAY)
    prefill_engine, decode_engine = engines
    send_pages_between(prefill_engine, decode_engine)
    layout = one_rank(prefill_engine.model)
    prefill = PrefillServer("p0", prefill_engine, layout)
    decode = DecodeServer("d0", decode_engine, layout, False, DisaggregationConfig())
    prefill.register_decode("d0", FakeActor(decode))
    decode.register_prefill("p0", FakeActor(prefill, ping=lambda: True), layout)
    yield prefill, decode
    prefill.loop.stop()
    decode.loop.stop()


def test_decode_continues_the_prefill_with_the_tokens_of_one_engine(
    alone: list[list[int]], pair: tuple[PrefillServer, DecodeServer]
) -> None:
    prefill, decode = pair
    firsts = []
    for i, prompt in enumerate(PROMPTS):
        res = decode.reserve(ReserveRequest(f"r{i}", prompt, greedy(8)), "p0", None)
        assert not res.local
        firsts.append(prefill.prefill(PrefillRequest(f"r{i}", prompt, greedy(8), res)))
    outs = decode.wait([f"r{i}" for i in range(len(PROMPTS))], 60)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert [f.result(10).token_id for f in firsts] == [tokens[0] for tokens in alone]
    assert prefill.loop.wait_idle(10) and decode.loop.wait_idle(10)
    assert prefill.stats.committed == decode.stats.committed == len(PROMPTS)
    assert torch.count_nonzero(executor_of(decode.loop.engine).runner.kv_cache) > 0
