"""Scale to zero without Ray: its config fields, the planner's calm clock, the cold-start queue."""

from __future__ import annotations

import asyncio
import re

import pytest

from pdserve.cluster.config import PlannerConfig, parse_config
from pdserve.cluster.planner import Planner, RegionMetrics
from pdserve.core.errors import InvalidArgumentError, OverloadedError
from pdserve.router.admission import ColdStartQueue, ColdStartTimeoutError
from pdserve.router.config import RouterConfig

AT_ZERO = """\
model: builtin:tiny
regions:
  - name: east
    prefill: {count: 0, min: 0}
    decode: {count: 0, min: 0, max: 2}
    warm_pool: %s
router: {cold_start_queue: %s, cold_start_timeout_s: 5}
"""


def test_a_region_may_start_at_zero_with_a_warm_pool() -> None:
    config = parse_config(AT_ZERO % (1, 4))
    region = config.regions[0]
    assert (region.prefill.count, region.decode.count, region.warm_pool) == (0, 0, 1)
    assert config.router.cold_start_queue == 4 and config.router.cold_start_timeout_s == 5
    assert config.needs()["CPU"] == 1.0  # the pool holds what its instance asks for


@pytest.mark.parametrize(
    ("pool", "queue", "field"),
    [(-1, 4, "regions[0].warm_pool"), (1, -1, "router.cold_start_queue")],
)
def test_negative_pool_or_queue_is_refused_naming_the_field(pool, queue, field) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(f"{field}: must be")):
        parse_config(AT_ZERO % (pool, queue))


def test_the_calm_clock_restarts_when_a_region_at_zero_starts_again() -> None:
    config = parse_config(AT_ZERO % (0, 4))
    p = Planner(
        PlannerConfig(mode="on", idle_s=10, cooldown_s=0), 2.0, 0.2, {"east": config.regions[0]}
    )
    quiet = dict(
        region="east",
        prefill_count=0,
        requests=0,
        ttft_p90_s=None,
        tpot_p90_s=None,
        prefill_queue_s=0.0,
        decode_kv_usage=0.0,
        decode_batch=0.0,
    )
    for t in (0.0, 50.0, 100.0):  # at zero for long: nothing to give back
        assert p.decide(RegionMetrics(decode_count=0, **quiet), now=t) is None
    woken = RegionMetrics(decode_count=1, **quiet)
    assert p.decide(woken, now=101.0) is None  # just started: it serves idle_s at least
    waiting = RegionMetrics(decode_count=1, cold_waiting=1, **quiet)
    assert p.decide(waiting, now=120.0) is None  # requests wait: not calm
    assert p.decide(woken, now=121.0) is None
    decision = p.decide(woken, now=131.5)
    assert decision is not None and decision.action == "remove_decode"


def test_the_cold_start_queue_is_bounded_timed_and_asks_for_an_instance_once() -> None:
    async def run() -> None:
        queue = ColdStartQueue(bound=2, timeout_s=0.2)
        asked: list[tuple[str, tuple[str, ...]]] = []
        queue.demand = lambda region, roles: asked.append((region, roles))
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(queue.wait("east", ("decode",), loop.time() + 5))
        second = asyncio.ensure_future(queue.wait("east", ("decode",), loop.time() + 5))
        await asyncio.sleep(0.01)
        with pytest.raises(OverloadedError, match="cold_start_queue") as full:
            await queue.wait("east", ("decode",), loop.time() + 5)
        assert full.value.retry_after_s > 0 and asked == [("east", ("decode",))]
        queue.opened("east")
        await asyncio.gather(first, second)
        with pytest.raises(ColdStartTimeoutError, match="cold_start_timeout_s") as late:
            await queue.wait("east", ("decode",), loop.time() + 0.05)
        assert late.value.http_status == 503 and late.value.grpc_code == "UNAVAILABLE"
        assert dict(queue.waiting) == {"east": 0} and (queue.refused, queue.timed_out) == (1, 1)

    asyncio.run(run())


def test_a_router_config_refuses_a_bad_cold_start_timeout() -> None:
    with pytest.raises(InvalidArgumentError, match=r"router\.cold_start_timeout_s"):
        RouterConfig(cold_start_timeout_s=0)
