"""Admission control and the retry budget: reject early rather than fail everyone.

:class:`Admission` caps the requests in flight per region. The cap starts at
the configured ceiling; with adaptive admission on, every window of observed
TTFTs whose 90th percentile misses the SLO cuts the cap by 30%, and every
window that meets it raises the cap by one (additive increase, multiplicative
decrease), so under overload the router sheds load instead of letting every
admitted request miss its SLO.

:class:`RetryBudget` is a token bucket filled by admitted requests: each retry
(another decode instance after a refusal, a re-run after a failure) takes a
token, so an outage cannot turn into a retry storm.

:class:`ColdStartQueue` holds the requests of a region that has no instance to
serve them (scaled to zero) while the controller starts one: a bounded number
per region, each for a bounded time.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Callable

from pdserve.core.errors import OverloadedError

WINDOW = 32
FLOOR = 4


class Admission:
    """Per-region in-flight caps; requests of negative priority get only a share of it.

    A request with ``priority < 0`` (offline batch work, best-effort clients) is
    admitted only while the region's requests in flight are under
    ``low_priority_share`` of its cap, so the rest of the cap stays free for
    online traffic: under overload the low-priority requests are refused first.
    """

    def __init__(
        self, ceiling: int, ttft_slo_s: float, adaptive: bool, low_priority_share: float = 0.5
    ) -> None:
        self.ceiling = ceiling
        self.ttft_slo_s = ttft_slo_s
        self.adaptive = adaptive
        self.low_priority_share = low_priority_share
        self.limits: dict[str, float] = {}
        self._ttfts: dict[str, deque[float]] = {}
        self.rejected = 0
        self.rejected_low_priority = 0

    def limit(self, region: str, priority: int = 0) -> int:
        cap = self.limits.get(region, self.ceiling)
        return int(cap * self.low_priority_share) if priority < 0 else int(cap)

    def admit(self, region: str, inflight: int, priority: int = 0) -> bool:
        if inflight < self.limit(region, priority):
            return True
        self.rejected += 1
        if priority < 0:
            self.rejected_low_priority += 1
        return False

    def observe(self, region: str, ttft_s: float) -> None:
        if not self.adaptive:
            return
        window = self._ttfts.setdefault(region, deque(maxlen=WINDOW))
        window.append(ttft_s)
        if len(window) < WINDOW:
            return
        p90 = sorted(window)[int(0.9 * (len(window) - 1))]
        current = self.limits.get(region, float(self.ceiling))
        if p90 > self.ttft_slo_s:
            self.limits[region] = max(min(FLOOR, float(self.ceiling)), current * 0.7)
        else:
            self.limits[region] = min(float(self.ceiling), current + 1)
        window.clear()


class RetryBudget:
    def __init__(self, ratio: float, minimum: float = 3.0, capacity: float = 100.0) -> None:
        self.ratio = ratio
        self.tokens = minimum
        self.minimum = minimum
        self.capacity = capacity
        self.spent = 0
        self.denied = 0

    def on_request(self) -> None:
        self.tokens = min(self.capacity, self.tokens + self.ratio)

    def try_spend(self) -> bool:
        if self.tokens >= 1 - 1e-9:  # ratios like 0.1 add up to 0.999...
            self.tokens -= 1
            self.spent += 1
            return True
        self.denied += 1
        return False


class ColdStartTimeoutError(OverloadedError):
    """A request waited ``cold_start_timeout_s`` and its region still has no instance."""

    grpc_code = "UNAVAILABLE"
    http_status = 503


class ColdStartQueue:
    """Requests waiting for their region's first instance; one per router, on its loop.

    ``wait`` holds a request until ``opened(region)`` (an instance of the region
    became available) or its deadline. At most ``bound`` requests wait per region;
    more are refused at once (``OverloadedError``), and one past its deadline fails
    with :class:`ColdStartTimeoutError`, both with a retry hint: how long the last
    cold start took. The first request to wait in an empty queue calls ``demand``
    (region, the roles it lacks): the controller's wake-up call, set by the router
    actor; without it nothing would start, so nothing waits (``enabled``).
    """

    def __init__(self, bound: int, timeout_s: float) -> None:
        self.bound = bound
        self.timeout_s = timeout_s
        self.demand: Callable[[str, tuple[str, ...]], None] | None = None
        self.waiting: dict[str, int] = defaultdict(int)
        self.refused = 0
        self.timed_out = 0
        self.last_start_s = 1.0  # the retry hint until a cold start was seen
        self._opened: dict[str, asyncio.Event] = {}
        self._since: dict[str, float] = {}  # region -> when its first request waited

    @property
    def enabled(self) -> bool:
        return self.bound > 0 and self.demand is not None

    async def wait(self, region: str, roles: tuple[str, ...], deadline: float) -> None:
        """Return once ``region`` opened; raise when the queue is full or at ``deadline``."""
        lacking = " and ".join(roles)
        if self.waiting[region] >= self.bound:
            self.refused += 1
            raise OverloadedError(
                f"region {region!r} has no {lacking} instance yet and {self.waiting[region]} "
                "requests already wait for one to start (router.cold_start_queue); retry later",
                retry_after_s=round(self.last_start_s, 1),
            )
        if self.waiting[region] == 0 and self.demand is not None:
            self._since.setdefault(region, time.monotonic())
            self.demand(region, roles)
        opened = self._opened.setdefault(region, asyncio.Event())
        self.waiting[region] += 1
        try:
            await asyncio.wait_for(opened.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.timed_out += 1
            raise ColdStartTimeoutError(
                f"no {lacking} instance of region {region!r} started within "
                f"{self.timeout_s:g} s (router.cold_start_timeout_s); retry later",
                retry_after_s=round(self.last_start_s, 1),
            ) from None
        finally:
            self.waiting[region] -= 1

    def opened(self, region: str) -> None:
        """An instance of ``region`` became available: wake every request waiting there."""
        since = self._since.pop(region, None)
        if since is not None:
            self.last_start_s = max(time.monotonic() - since, 0.1)
        event = self._opened.pop(region, None)
        if event is not None:
            event.set()
