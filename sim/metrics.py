"""Per-region planner metrics from simulated instances, as the router computes them live.

:class:`RegionWindow` collects the TTFT, TPOT and output of requests that
finished in a region since the planner last looked, and the arrivals;
:func:`region_metrics` turns it and the region's instances into the
:class:`~pdserve.cluster.planner.RegionMetrics` the planner reads (p90s,
estimated prefill queue time, decode KV usage and batch, arrival rate, mean
prompt and output, and the prompt tokens a second a burst asks prefill to
drain within the TTFT SLO: :func:`drain_rate`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from pdserve.cluster.planner import RegionMetrics
from pdserve.router.observe import drain_rate, peak_rate
from pdserve.sim.instance import SimInstance


class RegionWindow:
    """What a region saw over the last ``span_s`` seconds: finished requests' TTFT,
    TPOT and output tokens, and arrivals with their prompt tokens (the live
    router's sliding window: the planner reads ``4 x interval_s``)."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.finished: deque[tuple[float, float, float | None, int]] = deque()
        self.arrivals: deque[tuple[float, int]] = deque()

    def arrived(self, at: float, prompt_len: int) -> None:
        self.arrivals.append((at, prompt_len))

    def add(self, at: float, ttft: float, tpot: float | None, output_len: int) -> None:
        self.finished.append((at, ttft, tpot, output_len))

    def trim(self, now: float) -> None:
        for q in (self.finished, self.arrivals):
            while q and q[0][0] < now - self.span_s:
                q.popleft()


def _p90(values: list[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


def region_metrics(
    region: str,
    members: Sequence[SimInstance],
    window: RegionWindow,
    now: float,
    starting: dict[str, int],
    ttft_slo_s: float = 0.0,
) -> RegionMetrics:
    """The region's metrics over the window ending ``now`` (the drain rate for
    ``ttft_slo_s``; 0 when it is 0)."""
    window.trim(now)
    ttft = [f[1] for f in window.finished]
    tpot = [f[2] for f in window.finished if f[2] is not None]
    prefills = [x for x in members if x.role == "prefill"]
    decodes = [x for x in members if x.role == "decode"]
    queue = max(
        (x.view.queued_prompt_tokens * x.view.prefill_s_per_token for x in prefills), default=0.0
    )
    usage = float(np.mean([x.kv.usage for x in decodes])) if decodes else 0.0
    batch = float(np.mean([len(x.scheduler.running) for x in decodes])) if decodes else 0.0
    span = min(window.span_s, now) if now > 0 else window.span_s
    arrivals = len(window.arrivals)
    return RegionMetrics(
        region,
        len(prefills),
        len(decodes),
        len(ttft),
        _p90(ttft),
        _p90(tpot),
        queue,
        usage,
        batch,
        arrivals / span if span > 0 else 0.0,
        sum(a[1] for a in window.arrivals) / arrivals if arrivals else 0.0,
        sum(f[3] for f in window.finished) / len(ttft) if ttft else 0.0,
        peak_rate([a[0] for a in window.arrivals], now, span),
        drain_rate([a[0] for a in window.arrivals], [a[1] for a in window.arrivals], ttft_slo_s),
        starting.get("prefill", 0),
        starting.get("decode", 0),
    )
