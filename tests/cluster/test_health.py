"""Health of an engine loop (dead, stalled, idle) and the cluster config's health and capacity
checks; no Ray needed."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.cluster.config import HealthConfig, parse_config
from pdserve.core.config import build_engine_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.layout import check_fits
from pdserve.core.model_config import ModelConfig
from pdserve.engine.engine import EngineCore
from pdserve.engine.loop import EngineLoop
from pdserve.parallel.executor import LocalExecutor


@pytest.fixture
def loop(tiny_path):
    model = ModelConfig.from_dir(str(tiny_path))
    config = build_engine_config(str(tiny_path), max_num_batched_tokens=64)
    engine = EngineCore(config, model, LocalExecutor(model, config), None)
    loop = EngineLoop(engine, lambda outputs: None)
    yield loop
    loop.stop()


def test_an_idle_loop_is_healthy_however_long_it_sleeps(loop) -> None:
    time.sleep(0.3)
    assert loop.problem(stall_after_s=0.05) is None


def test_a_loop_busy_without_progress_past_the_deadline_is_stalled(loop) -> None:
    release = threading.Event()
    held = loop.call(lambda engine: release.wait(10))
    time.sleep(0.4)
    problem = loop.problem(stall_after_s=0.2)
    assert problem is not None and "made no progress for" in problem
    assert loop.problem(stall_after_s=5.0) is None  # within a longer deadline
    release.set()
    held.result(timeout=5)
    time.sleep(0.1)
    assert loop.problem(stall_after_s=0.2) is None


def test_pages_held_with_no_request_are_a_leak(loop) -> None:
    leaked = loop.call(lambda engine: engine.kv.pool.allocate(3)).result(timeout=5)
    loop.call(lambda engine: None).result(timeout=5)  # the loop goes idle after this
    deadline = time.monotonic() + 5
    while loop.problem(60.0) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.problem(60.0) == "3 KV pages are held with no request left (a leak)"
    loop.call(lambda engine: engine.kv.pool.free(leaked)).result(timeout=5)
    loop.call(lambda engine: None).result(timeout=5)
    deadline = time.monotonic() + 5
    while loop.problem(60.0) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.problem(60.0) is None


def test_a_dead_loop_says_why(loop) -> None:
    class Killed(BaseException):
        pass

    def die(engine) -> None:
        raise Killed("gone")

    loop.call(die)
    deadline = time.monotonic() + 5
    while loop.problem(60.0) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.problem(60.0) == "engine loop stopped: Killed: gone"


CONFIG = """\
model: builtin:tiny
regions:
  - name: east
    prefill: {count: 2, tensor_parallel_size: 2, num_cpus_per_rank: 0.5}
    decode: {count: 1, num_cpus_per_rank: 1, num_gpus_per_rank: 1}
auth: {disabled: true}
health: {stall_timeout_s: 7, retry_backoff_s: 0.5, retry_backoff_max_s: 2}
"""


def test_health_section_and_backoff() -> None:
    health = parse_config(CONFIG).health
    assert (health.stall_timeout_s, health.ping_timeout_s) == (7.0, 5.0)
    assert [health.backoff(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 2.0]
    with pytest.raises(InvalidArgumentError, match=r"test.yaml:7: health.stall_timeout_s"):
        parse_config(CONFIG.replace("stall_timeout_s: 7", "stall_timeout_s: 0"), "test.yaml")
    with pytest.raises(InvalidArgumentError, match=r"health.retry_backoff_max_s"):
        HealthConfig(retry_backoff_s=5, retry_backoff_max_s=1)


def test_layout_needs_and_refusal() -> None:
    config = parse_config(CONFIG)
    assert config.needs() == {"CPU": 2 * 2 * 0.5 + 1.0, "GPU": 1.0}
    check_fits(config.needs(), {"CPU": 3.0, "GPU": 1.0})
    with pytest.raises(InvalidArgumentError, match="needs 3 CPUs, the cluster has 2"):
        check_fits(config.needs(), {"CPU": 2.0, "GPU": 1.0})
    with pytest.raises(InvalidArgumentError, match="needs 1 GPU, the cluster has 0"):
        check_fits(config.needs(), {"CPU": 8.0})
