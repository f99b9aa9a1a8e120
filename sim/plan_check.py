"""``pdserve plan --check``: the plan's promise against the plan served here.

A plan promises an SLO attainment: its own simulation of the recommended
layout at the forecast. With ``--check`` the recommended plan of a one-region
forecast is served on this machine (its cluster YAML, each rank on a core of
its own, the profile's dtype), loaded at the forecast rate with the plan's
length mix by ``pdserve bench serve``'s load generator, and the attainment
measured there is printed beside the promised one. The plan keeps its promise
when the measured attainment is at least the promised one less
:data:`PROMISE_MARGIN`.

Only a plan made from a profile of this machine can be checked here (``pdserve
profile --config``: the calibrated one, which prices what a served request pays
beyond its steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from pdserve.core.errors import InvalidArgumentError

PROMISE_MARGIN = 0.05  # attainment points a served plan may fall short of its promise


def local_yaml(plan_yaml: str, dtype: str, cpus_per_rank: float = 1.0) -> str:
    """A plan's cluster YAML as a local cluster of this machine serves it: pages over
    shared memory, ``cpus_per_rank`` CPUs (and torch threads) per rank, the weights in
    ``dtype`` (the profile's), ports chosen by the system, no API keys (it listens on
    127.0.0.1 only)."""
    raw = yaml.safe_load(plan_yaml)
    raw["connector"] = "shm"
    raw.setdefault("engine", {})["dtype"] = dtype
    for region in raw["regions"]:
        for role in ("prefill", "decode"):
            region.setdefault(role, {})["num_cpus_per_rank"] = cpus_per_rank
    raw["server"] = {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0}
    raw["auth"] = {"disabled": True}
    text: str = yaml.safe_dump(raw, sort_keys=False)
    return text


@dataclass(frozen=True)
class PlanCheck:
    """A plan served here: what it promised and what it attained."""

    region: str
    layout: str
    rate: float
    promised: float  # SLO attainment of the plan's simulation at the forecast
    measured: float  # of the served plan, under the same load
    summary: dict[str, Any]  # the load generator's summary of the run

    @property
    def kept(self) -> bool:
        return self.measured >= self.promised - PROMISE_MARGIN

    def line(self) -> str:
        verdict = "kept" if self.kept else "NOT kept"
        s = self.summary
        return (
            f"check {self.region}: {self.layout} served here at {self.rate:g} req/s: SLO "
            f"attainment {self.measured:.1%} measured, {self.promised:.1%} promised: {verdict} "
            f"(TTFT p90 {s['ttft_ms'].get('p90', float('nan')):.1f} ms, TPOT p90 "
            f"{s['tpot_ms'].get('p90', float('nan')):.1f} ms, {s['num_failed']} failed)"
        )


def checkable(plan: dict[str, Any], device: str | None) -> dict[str, Any]:
    """The one region of ``plan`` (``pdserve plan --out``'s JSON) a check serves; an
    error when it cannot be served here."""
    if device is not None:
        raise InvalidArgumentError(
            "check", f"a plan for {device} devices cannot be served on this machine's CPUs"
        )
    regions = plan["regions"]
    if len(regions) != 1:
        raise InvalidArgumentError("check", f"checks a one-region plan, not {len(regions)}")
    return dict(regions[0])
