"""A warm pool that stopped (its version retired, or the controller stops) stays empty:
the health loop's refill starts nothing, and a start under way is shut down when up."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from pdserve.cluster.pool import WarmPool


class _Started:
    def __init__(self) -> None:
        self.down = False
        self.group = SimpleNamespace(start_phases={"load": 0.1})

    def shutdown(self) -> None:
        self.down = True


def _controller(gate: threading.Event) -> Any:
    started: list[_Started] = []

    def start_new(spec: Any, role: str, instance_id: str) -> _Started:
        gate.wait(10)
        started.append(_Started())
        return started[-1]

    membership = SimpleNamespace(new_id=lambda prefix: f"{prefix}-1", start_new=start_new)
    return SimpleNamespace(
        specs={"east": SimpleNamespace(warm_pool=1)},
        lock=threading.RLock(),
        stopping=False,
        membership=membership,
        started=started,
        health=SimpleNamespace(backoff=lambda n: 0.0),
        event=lambda text: None,
    )


def _settle(pool: WarmPool) -> None:
    deadline = time.monotonic() + 10
    while pool.filling["east"] and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_stopped_pool_is_not_refilled_by_the_health_loop() -> None:
    gate = threading.Event()
    gate.set()
    c = _controller(gate)
    pool = WarmPool(c)
    pool.fill("east")
    _settle(pool)
    assert pool.size("east") == 1 and len(c.started) == 1
    pool.stop()  # Controller.retire: the version takes no traffic any more
    assert c.started[0].down and pool.size("east") == 0
    for _ in range(3):  # health loop turns
        pool.fill_due()
        _settle(pool)
    assert len(c.started) == 1 and pool.size("east") == 0


def test_a_start_under_way_when_the_pool_stops_is_shut_down_when_up() -> None:
    gate = threading.Event()
    c = _controller(gate)
    pool = WarmPool(c)
    pool.fill("east")  # its start waits at the gate
    pool.stop()
    gate.set()
    _settle(pool)
    assert len(c.started) == 1 and c.started[0].down and pool.size("east") == 0


def test_a_pooled_instance_becomes_prefill_only_where_prefill_is_set_up_as_the_pool() -> None:
    from pdserve.cluster.config import parse_config

    def pool_of(prefill: str) -> WarmPool:
        config = parse_config(
            "model: builtin:tiny\nregions:\n  - name: east\n    warm_pool: 1\n"
            f"    prefill: {{count: 1{prefill}}}\n    decode: {{count: 1}}\n"
        )
        c = _controller(threading.Event())
        c.config, c.specs = config, {"east": config.regions[0]}
        return WarmPool(c)

    assert pool_of("").fits("east", "prefill") and pool_of("").fits("east", "decode")
    for other in (", engine: {max_num_batched_tokens: 2048}", ", num_cpus_per_rank: 2"):
        pool = pool_of(other)
        assert not pool.fits("east", "prefill") and pool.fits("east", "decode")
        pool.ready["east"].append(_Started())  # type: ignore[arg-type]
        assert pool.take("east", "prefill") is None and pool.size("east") == 1  # left for decode
