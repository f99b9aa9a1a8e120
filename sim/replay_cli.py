"""``pdserve sim-planners``: the command line of the traffic-shift replay, simulated
(:mod:`pdserve.sim.replay`) or, with ``--live``, on a local cluster
(:mod:`pdserve.sim.replay_live`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.flags import file_stem
from pdserve.bench.report import Slo
from pdserve.core.options import options_from
from pdserve.sim.cluster import SimRun
from pdserve.sim.flags import DeviceFlags
from pdserve.sim.replay import POLICIES, compare, outcome, phased_workload
from pdserve.sim.replay_report import comparison_table, plot_policies, write_trace


@dataclass(frozen=True, kw_only=True)
class PlannersFlags:
    """``pdserve sim-planners``' options, in the order of its flags."""

    config: str  # the cluster YAML
    profile: list[str] = field(default_factory=list)  # profile files
    traces: list[str] = field(default_factory=lambda: ["azure-conv", "azure-code"])  # in turn
    rate: float  # mean req/s of every phase
    phase_s: float = 600.0  # seconds of each trace
    policies: list[str] = field(default_factory=lambda: list(POLICIES))  # planner policies
    startup_s: float = 30.0  # seconds to start an instance
    max_prompt_len: int = 4000  # clamp prompt lengths
    max_output_len: int = 2000  # clamp output lengths
    write_trace: str | None = None  # also save the workload as a trace CSV
    live: bool = False  # each policy on a local cluster instead of simulated
    num_cpus: int = 4  # live: the local Ray's CPUs
    out: str = "bench/out/sim"  # output folder
    name: str = "planners"  # output file stem
    analytic: DeviceFlags = field(default_factory=DeviceFlags)  # an analytic profile's flags
    host_cores: float = 0.0  # the instances share a host of this many cores (0: no)
    prog: str = "pdserve sim-planners"  # the command, for the record


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve.sim.flags import add_device_flags, add_host_flag

    p = sub.add_parser(
        "sim-planners", help="replay a traffic shift under each planner policy (simulated)"
    )
    p.add_argument("--config", required=True, help="the cluster YAML that `pdserve serve` takes")
    p.add_argument("--profile", action="append", default=[], help="profile file (repeatable)")
    p.add_argument(
        "--traces",
        nargs="+",
        default=["azure-conv", "azure-code"],
        help="traces replayed one after another (names or CSV files)",
    )
    p.add_argument("--rate", type=float, required=True, help="mean req/s of every phase")
    p.add_argument("--phase-s", type=float, default=600.0, help="seconds of each trace")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--startup-s", type=float, default=30.0, help="seconds to start an instance")
    p.add_argument("--max-prompt-len", type=int, default=4000)
    p.add_argument("--max-output-len", type=int, default=2000)
    p.add_argument("--write-trace", default=None, help="also save the workload as a trace CSV")
    p.add_argument(
        "--live",
        action="store_true",
        help="run each policy on a local cluster of --config (a model that runs "
        "here) instead of simulating it",
    )
    p.add_argument("--num-cpus", type=int, default=4, help="--live: the local Ray's CPUs")
    p.add_argument("--out", default="bench/out/sim", help="output folder")
    p.add_argument("--name", type=file_stem, default="planners")
    add_device_flags(p)
    add_host_flag(p)
    p.set_defaults(func=cmd_sim_planners, prog="pdserve sim-planners")


def cmd_sim_planners(args: argparse.Namespace) -> int:
    return sim_planners(options_from(PlannersFlags, args))


def sim_planners(args: PlannersFlags) -> int:
    """Each policy replayed, simulated (or live), compared; the results written."""
    from pdserve.cluster.config import load_config
    from pdserve.sim.build import book_for
    from pdserve.sim.flags import assumptions_from
    from pdserve.sim.profile import load_profile

    config = load_config(args.config)
    work, starts = phased_workload(
        args.traces, args.rate, args.phase_s, args.max_prompt_len, args.max_output_len
    )
    if args.live:
        from pdserve.sim.replay_live import live_planners

        return live_planners(args, config, work, starts)
    profiles = [load_profile(p) for p in args.profile]
    book = book_for(config, profiles, args.analytic.device, assumptions_from(args.analytic, None))
    slo = Slo(config.router.ttft_slo_s, config.router.tpot_slo_s)
    runs = compare(config, book, work, args.policies, args.startup_s, args.host_cores)
    results = _policy_results(runs, slo, starts)
    paths = _write_planners(args, starts, runs, results)
    if args.write_trace:
        paths.append(write_trace(work, Path(args.write_trace)))
    print(comparison_table(results))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _policy_results(
    runs: dict[str, tuple[SimRun, float]], slo: Slo, starts: list[float]
) -> dict[str, dict[str, Any]]:
    """Each policy's figures (the switch: the second trace's start), wall time and timeline."""
    switch = starts[1] if len(starts) > 1 else 0.0
    return {
        p: {
            **outcome(run, slo, switch),
            "wall_s": round(wall, 2),
            "instances_over_time": run.counts,
            "planner_decisions": run.decisions,
        }
        for p, (run, wall) in runs.items()
    }


def _write_planners(
    args: PlannersFlags,
    starts: list[float],
    runs: dict[str, tuple[SimRun, float]],
    results: dict[str, dict[str, Any]],
) -> list[Path]:
    """The replay's JSON and plot; the paths written."""
    from pdserve.bench.report import header, write_json
    from pdserve.bench.serve import command_line

    out = Path(args.out)
    payload = {
        **header(command_line(args.prog, args)),
        "config": str(args.config),
        "traces": args.traces,
        "phase_starts_s": starts,
        "rate": args.rate,
        "policies": results,
    }
    counts = {p: r.counts for p, (r, _) in runs.items()}
    return [
        write_json(out / f"{args.name}.json", payload),
        plot_policies(counts, starts, args.traces, out / f"{args.name}.png"),
    ]
