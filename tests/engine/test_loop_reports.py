"""An engine loop's step trace (what each step computed, as the simulator reads it)
and its load reports (one per interval while the load moves, a heartbeat while not)."""

from __future__ import annotations

import time

import pytest

from pdserve.core.config import build_engine_config
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import EngineCore
from pdserve.engine.loop import EngineLoop, LoadReporter
from pdserve.parallel.executor import LocalExecutor


@pytest.fixture
def loop(tiny_path):
    model = ModelConfig.from_dir(str(tiny_path))
    config = build_engine_config(
        str(tiny_path), max_num_batched_tokens=64, enable_prefix_caching=False
    )
    engine = EngineCore(config, model, LocalExecutor(model, config), None)
    loop = EngineLoop(engine, lambda outputs: None)
    yield loop
    loop.stop()


def _run(loop: EngineLoop, prompts: dict[str, int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def add(engine: EngineCore) -> None:
        for rid, n in prompts.items():
            engine.add_request(rid, [3 + i % 50 for i in range(n)], params)

    loop.call(add).result(timeout=10)
    assert loop.wait_idle(60)


def _trace(loop: EngineLoop, keep: int) -> list:
    return loop.call(lambda _engine: loop.step_trace(keep)).result(timeout=10)


def test_the_trace_holds_every_step_with_its_rows(loop) -> None:
    _run(loop, {"warm": 8}, 2)
    assert _trace(loop, 1000) == []  # nothing recorded before the trace started
    prompts, max_tokens = {"a": 100, "b": 20}, 5
    _run(loop, prompts, max_tokens)
    steps = _trace(loop, 0)
    # every prompt token computed once (chunks of a 64-token budget), then one
    # token a step for the outputs after the first
    assert sum(sum(s.new_tokens) for s in steps) == sum(prompts.values()) + 2 * (max_tokens - 1)
    assert all(sum(s.new_tokens) <= 64 for s in steps)
    assert all(len(s.new_tokens) == len(s.cached_tokens) for s in steps)
    # the last step decodes both requests, each after its prompt and earlier outputs
    assert sorted(steps[-1].cached_tokens) == [20 + max_tokens - 2, 100 + max_tokens - 2]
    assert all(s.seconds > 0 for s in steps)
    assert [s.start_s for s in steps] == sorted(s.start_s for s in steps)
    _run(loop, {"after": 8}, 2)
    assert _trace(loop, 0) == []  # stopped
    # a step with nothing to run leaves no last step (the trace records none)
    assert loop.call(lambda engine: (engine.step(), engine.last_step)).result(10) == ([], None)


def test_the_trace_keeps_the_newest_steps(loop) -> None:
    _trace(loop, 3)
    _run(loop, {"a": 8}, 10)
    steps = _trace(loop, 0)
    assert len(steps) == 3
    assert [s.cached_tokens for s in steps] == [(14,), (15,), (16,)]


def test_an_idle_instance_reports_only_a_heartbeat(loop) -> None:
    reporter = LoadReporter(loop, "i0", "decode", interval_s=0.02, heartbeat_s=0.5)
    got = []
    first = reporter.subscribe(got.append)
    assert first.running == 0
    time.sleep(1.1)  # 55 intervals, nothing changing
    assert 2 <= len(got) <= 6, len(got)  # the first timer report, then one each 0.5 s
    sent = len(got)
    _run(loop, {"a": 40}, 40)
    time.sleep(0.1)
    assert len(got) > sent  # the load moved: reports follow
    assert any(r.running == 1 or r.waiting == 1 for r in got[sent:])
    assert (got[-1].running, got[-1].waiting) == (0, 0)  # and the idle state is sent
    assert reporter.sent == len(got)
