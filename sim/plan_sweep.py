"""Disaggregated against colocated goodput per device over a grid of SLOs.

    python -m pdserve.sim.plan_sweep --profile sim/profiles/h200-llama3-8b.json \\
        --trace azure-conv azure-code --rate 100 --ttft-ms 100 300 1000 \\
        --tpot-ms 15 30 100

For each trace (its prompt and output lengths, as ``pdserve plan --trace`` takes
them) and each (TTFT, TPOT) SLO pair, plans one region at ``--rate`` in both
layouts (:func:`~pdserve.sim.plan_choice.choose_regions`) and prints a markdown
table: each layout's counts, devices, goodput per device (requests/s within both
SLOs at the forecast, over the devices) and SLO attainment, and the
recommendation.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import workload as wl
from pdserve.sim.plan import Infeasible, LengthMix, PlanLimits, PlanSlo, RegionPlan, open_pool
from pdserve.sim.plan_choice import choose_regions


@dataclass(frozen=True)
class SweepOptions:
    profile: str
    traces: tuple[str, ...]
    rate: float
    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    percentile: float
    max_devices: int
    jobs: int
    out: str | None


def _cell(p: RegionPlan | Infeasible) -> dict[str, Any]:
    if isinstance(p, Infeasible):
        return {"infeasible": p.message}
    o = p.at_forecast
    return {
        "prefill": p.prefill,
        "decode": p.decode,
        "devices": p.devices,
        "goodput_per_device": o.goodput_rps / p.devices,
        "attainment": o.attainment,
    }


def _text(c: dict[str, Any]) -> str:
    if "infeasible" in c:
        return "infeasible"
    counts = f"{c['decode']}" if c["prefill"] == 0 else f"{c['prefill']}P+{c['decode']}D"
    return (
        f"{counts} = {c['devices']} GPUs, {c['goodput_per_device']:.2f} req/s/GPU, "
        f"{c['attainment']:.1%}"
    )


def sweep(opts: SweepOptions) -> list[dict[str, Any]]:
    """One row per trace and SLO pair: each layout's plan and the recommendation."""
    from pdserve.sim.analytic import DEVICES
    from pdserve.sim.build import ProfileBook
    from pdserve.sim.flags import Assumptions
    from pdserve.sim.profile import load_profile

    prof = load_profile(opts.profile)
    book = ProfileBook(prof.model, [prof], None, Assumptions())
    limits = PlanLimits(max_devices=opts.max_devices)
    rows = []
    with open_pool(opts.jobs) as pool:
        for trace in opts.traces:
            t = wl.read_trace(wl.trace_path(trace))
            mix = LengthMix(t.prompt_len, t.output_len)
            for ttft in opts.ttft_ms:
                for tpot in opts.tpot_ms:
                    slo = PlanSlo(ttft / 1e3, tpot / 1e3, opts.percentile)
                    row: dict[str, Any] = {"trace": trace, "ttft_ms": ttft, "tpot_ms": tpot}
                    try:
                        (c,) = choose_regions(
                            book,
                            {"r": opts.rate},
                            mix,
                            limits,
                            slo,
                            DEVICES[prof.device].mem_bw,
                            pool,
                        )
                        row |= {k: _cell(p) for k, p in c.plans.items()}
                        row["recommended"] = c.chosen.layout
                    except Infeasible as e:
                        row |= {"recommended": None, "why": e.message}
                    rows.append(row)
                    print(_row(row), flush=True)
    return rows


def _row(r: dict[str, Any]) -> str:
    cells = [_text(r[k]) if k in r else "infeasible" for k in ("disaggregated", "colocated")]
    return (
        f"| {r['trace']} | {r['ttft_ms']:g} | {r['tpot_ms']:g} | {cells[0]} | {cells[1]} | "
        f"{r['recommended'] or 'neither'} |"
    )


HEADER = (
    "| trace | TTFT ms | TPOT ms | disaggregated | colocated | recommended |\n"
    "|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.plan_sweep", description=__doc__)
    p.add_argument("--profile", default="sim/profiles/h200-llama3-8b.json")
    p.add_argument("--trace", nargs="+", default=["azure-conv", "azure-code"])
    p.add_argument("--rate", type=float, default=100.0, help="forecast req/s of the region")
    p.add_argument("--ttft-ms", type=float, nargs="+", default=[100.0, 300.0, 1000.0])
    p.add_argument("--tpot-ms", type=float, nargs="+", default=[15.0, 30.0, 100.0])
    p.add_argument("--percentile", type=float, default=90.0)
    p.add_argument("--max-devices", type=int, default=64)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None, help="write the rows (JSON)")
    a = p.parse_args(argv)
    opts = SweepOptions(
        a.profile,
        tuple(a.trace),
        a.rate,
        tuple(a.ttft_ms),
        tuple(a.tpot_ms),
        a.percentile,
        a.max_devices,
        a.jobs,
        a.out,
    )
    print(HEADER, flush=True)
    rows = sweep(opts)
    if opts.out:
        Path(opts.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
