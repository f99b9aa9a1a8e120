"""Per-region planner metrics from simulated instances, as the router computes them live.

:class:`RegionWindow` collects the TTFT and TPOT of requests that finished in
a region since the planner last looked; :func:`region_metrics` turns it and
the region's instances into the :class:`~pdserve.cluster.planner.RegionMetrics`
the planner reads (p90s, estimated prefill queue time, decode KV usage and batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.cluster.planner import RegionMetrics
from pdserve.sim.instance import SimInstance


@dataclass
class RegionWindow:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)

    def add(self, ttft: float, tpot: float | None) -> None:
        self.ttft.append(ttft)
        if tpot is not None:
            self.tpot.append(tpot)

    def take(self) -> tuple[list[float], list[float]]:
        out = (self.ttft, self.tpot)
        self.ttft, self.tpot = [], []
        return out


def _p90(values: list[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


def region_metrics(
    region: str, members: Sequence[SimInstance], window: RegionWindow
) -> RegionMetrics:
    """The region's metrics over the window (which this empties)."""
    ttft, tpot = window.take()
    prefills = [x for x in members if x.role == "prefill"]
    decodes = [x for x in members if x.role == "decode"]
    queue = max(
        (x.view.queued_prompt_tokens * x.view.prefill_s_per_token for x in prefills), default=0.0
    )
    usage = float(np.mean([x.kv.usage for x in decodes])) if decodes else 0.0
    batch = float(np.mean([len(x.scheduler.running) for x in decodes])) if decodes else 0.0
    return RegionMetrics(
        region, len(prefills), len(decodes), len(ttft), _p90(ttft), _p90(tpot), queue, usage, batch
    )
