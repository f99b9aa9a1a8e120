"""A traffic shift replayed under each planner policy: ``pdserve sim-planners``.

The workload is one trace after another (by default the Azure conversation
trace, then the code trace: prompts twice as long, outputs an eighth), each
scaled to the same mean rate and cut to ``phase_s`` seconds. The same
cluster config runs it once per planner policy with the planner applying its
decisions, and the comparison says, per policy: requests meeting both SLOs
(all, and after the switch), when the first prefill instance was asked for
and when one was serving after the switch, and device-seconds used. The plot
is P:D over time for every policy. ``--write-trace`` saves the workload as a
trace CSV that ``pdserve bench serve --trace`` replays on a live cluster;
``--live`` replays it on a local cluster of the config itself, once per policy
(:mod:`pdserve.sim.replay_live`).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.report import Slo
from pdserve.cluster.config import ClusterConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.build import ProfileBook
from pdserve.sim.cluster import SimCluster, SimOptions, SimRun
from pdserve.sim.replay_report import comparison_table, figures, plot_policies, write_trace
from pdserve.sim.workload import SimWorkload

POLICIES = ("reactive", "proactive")


def phased_workload(
    traces: list[str], rate: float, phase_s: float, max_prompt_len: int, max_output_len: int
) -> tuple[SimWorkload, list[float]]:
    """The traces one after another, each at ``rate`` req/s for ``phase_s`` seconds;
    also the times the phases start."""
    if not rate > 0 or not phase_s > 0:
        raise InvalidArgumentError("rate", "rate and phase_s must be > 0")
    arrival, prompt, output, starts = [], [], [], []
    for k, name in enumerate(traces):
        # the phase's own requests scaled to the rate: a trace is burstier than its mean
        raw = wl.limit_trace(wl.read_trace(wl.trace_path(name)), round(rate * phase_s) + 1, None)
        trace = wl.scale_trace(raw, rate=rate, max_prompt_len=max_prompt_len,
                               max_output_len=max_output_len)  # fmt: skip
        trace = wl.limit_trace(trace, None, phase_s)
        starts.append(k * phase_s)
        arrival.append(trace.arrival_s + k * phase_s)
        prompt.append(trace.prompt_len)
        output.append(trace.output_len)
    a = np.concatenate(arrival)
    return SimWorkload(a, np.concatenate(prompt), np.concatenate(output),
                       np.zeros(len(a), dtype=np.int16)), starts  # fmt: skip


def with_policy(config: ClusterConfig, policy: str) -> ClusterConfig:
    """The config with its planner applying decisions under ``policy``."""
    return dataclasses.replace(
        config, planner=dataclasses.replace(config.planner, mode="on", policy=policy)
    )


def outcome(run: SimRun, slo: Slo, switch_s: float) -> dict[str, Any]:
    """One simulated policy's figures (:func:`figures`)."""
    rec = run.recorder
    return figures(rec.slo_met(slo), rec.arrival, run.counts, run.decisions, switch_s)


def compare(
    config: ClusterConfig, book: ProfileBook, work: SimWorkload, policies: list[str],
    startup_s: float,
) -> dict[str, tuple[SimRun, float]]:  # fmt: skip
    """Each policy's run of the same workload, with its wall time."""
    runs = {}
    for policy in policies:
        start = time.perf_counter()
        options = SimOptions(fast=True, keep_itl=False, startup_s=startup_s)
        run = SimCluster(with_policy(config, policy), book, work, options).run()
        runs[policy] = (run, time.perf_counter() - start)
    return runs


# -- pdserve sim-planners ------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve.sim.flags import add_device_flags

    p = sub.add_parser(
        "sim-planners", help="replay a traffic shift under each planner policy (simulated)"
    )
    p.add_argument("--config", required=True, help="the cluster YAML that `pdserve serve` takes")
    p.add_argument("--profile", action="append", default=[], help="profile file (repeatable)")
    p.add_argument("--traces", nargs="+", default=["azure-conv", "azure-code"],
                   help="traces replayed one after another (names or CSV files)")  # fmt: skip
    p.add_argument("--rate", type=float, required=True, help="mean req/s of every phase")
    p.add_argument("--phase-s", type=float, default=600.0, help="seconds of each trace")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--startup-s", type=float, default=30.0, help="seconds to start an instance")
    p.add_argument("--max-prompt-len", type=int, default=4000)
    p.add_argument("--max-output-len", type=int, default=2000)
    p.add_argument("--write-trace", default=None, help="also save the workload as a trace CSV")
    p.add_argument("--live", action="store_true",
                   help="run each policy on a local cluster of --config (a model that runs "
                        "here) instead of simulating it")  # fmt: skip
    p.add_argument("--num-cpus", type=int, default=4, help="--live: the local Ray's CPUs")
    p.add_argument("--out", default="bench/out/sim", help="output folder")
    p.add_argument("--name", default="planners")
    add_device_flags(p)
    p.set_defaults(func=cmd_sim_planners, prog="pdserve sim-planners")


def cmd_sim_planners(args: argparse.Namespace) -> int:
    from pdserve.bench.report import header, write_json
    from pdserve.bench.serve import command_line
    from pdserve.cluster.config import load_config
    from pdserve.sim.build import book_for
    from pdserve.sim.flags import assumptions_from
    from pdserve.sim.profile import load_profile

    config = load_config(args.config)
    work, starts = phased_workload(
        args.traces, args.rate, args.phase_s, args.max_prompt_len, args.max_output_len
    )
    if args.live:
        from pdserve.sim.replay_live import cmd_live

        return cmd_live(args, config, work, starts)
    book = book_for(
        config, [load_profile(p) for p in args.profile], args.device, assumptions_from(args)
    )
    slo = Slo(config.router.ttft_slo_s, config.router.tpot_slo_s)
    runs = compare(config, book, work, args.policies, args.startup_s)
    switch = starts[1] if len(starts) > 1 else 0.0
    results = {p: {**outcome(run, slo, switch), "wall_s": round(wall, 2),
                   "instances_over_time": run.counts, "planner_decisions": run.decisions}
               for p, (run, wall) in runs.items()}  # fmt: skip
    out = Path(args.out)
    payload = {**header(command_line(args)), "config": str(args.config), "traces": args.traces,
               "phase_starts_s": starts, "rate": args.rate, "policies": results}  # fmt: skip
    paths = [write_json(out / f"{args.name}.json", payload)]
    paths.append(plot_policies({p: r.counts for p, (r, _) in runs.items()}, starts, args.traces,
                               out / f"{args.name}.png"))  # fmt: skip
    if args.write_trace:
        paths.append(write_trace(work, Path(args.write_trace)))
    print(comparison_table(results))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
