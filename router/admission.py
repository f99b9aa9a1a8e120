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
"""

from __future__ import annotations

from collections import deque

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
