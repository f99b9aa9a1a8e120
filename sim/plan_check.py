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
from typing import TYPE_CHECKING, Any

import yaml

from pdserve.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pdserve.sim.plan_cli import PlanFlags

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


def checkable(plan: dict[str, Any], analytic: str | None, profiles: list[Any]) -> dict[str, Any]:
    """The one region of ``plan`` (``pdserve plan --out``'s JSON) a check serves; an
    error when it cannot be served here: the plan is not for this machine's CPUs (an
    analytic ``--device``, or a profile measured elsewhere) or covers several regions."""
    where = analytic or next((p.device for p in profiles if p.device != "cpu"), None)
    if where is not None:
        raise InvalidArgumentError(
            "check", f"a plan for {where} devices cannot be served on this machine's CPUs"
        )
    if not profiles:
        raise InvalidArgumentError(
            "check", "needs a profile of this machine (pdserve profile --config CONFIG)"
        )
    regions = plan["regions"]
    if len(regions) != 1:
        raise InvalidArgumentError("check", f"checks a one-region plan, not {len(regions)}")
    return dict(regions[0])


def check_plan(entry: dict[str, Any], args: PlanFlags, dtype: str) -> PlanCheck:
    """Serve the plan of one region (``entry``: its JSON, as ``--out`` writes it) as a
    local cluster here and load it at the forecast's peak with the plan's length mix,
    ``args.check_requests`` requests arriving as a Poisson process."""
    from pdserve.bench.local import local_cluster, local_cpus
    from pdserve.bench.serve import RunFlags, serve_rates
    from pdserve.cluster.config import parse_config

    text = local_yaml(entry["cluster_yaml"], dtype)
    mix = args.mix
    flags = RunFlags(
        trace=mix.trace,
        length_scale=mix.length_scale,
        prompt_len=mix.prompt_len,
        prompt_len_std=mix.prompt_len_std,
        output_len=mix.output_len,
        output_len_std=mix.output_len_std,
        max_prompt_len=mix.max_prompt_len,
        max_output_len=mix.max_output_len,
        num_requests=args.check_requests,
        seed=args.seed,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        no_progress=True,
    )
    with local_cluster(text, local_cpus(parse_config(text, "<plan check>"))) as (endpoints, _):
        target = f"grpc://{endpoints.grpc_address}"
        result = serve_rates(flags, target, [float(entry["rate"])], label="plan check")[0]
    promised = float(entry["at_forecast"]["attainment"])
    return PlanCheck(
        entry["region"],
        entry["layout"],
        float(entry["rate"]),
        promised,
        float(result.summary["attainment"]),
        result.summary,
    )
