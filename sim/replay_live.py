"""``pdserve sim-planners --live``: the traffic shift replayed on a local cluster.

The live counterpart of the simulated comparison in :mod:`pdserve.sim.replay`:
the same phased workload, written as a trace CSV and replayed by ``pdserve bench
serve``'s load generator, once per planner policy, each on a fresh local
cluster started from the given config with its planner applying decisions
(``mode: on``, ``policy`` set per run). The proactive planner sizes the region
from a profile: the first ``--profile`` given, or one measured here first on
the decode instance's engine config with one torch thread (a rank's share of
the cores). Every second the controller's status gives the region's serving
instance counts; at the end its scale log gives the planner's decisions. The
figures are the simulated comparison's (:func:`~pdserve.sim.replay_report.figures`).

On a machine of a few cores, an added instance shares the same cores: a run
shows what the planners decide on the live system (when, and from which
signal), not the capacity an instance adds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from pdserve.bench.report import RequestRecord, Slo, meets_slo
from pdserve.cluster.config import ClusterConfig
from pdserve.core.messages import StepRecord
from pdserve.sim.replay_report import (
    beside_table,
    comparison_table,
    figures,
    plot_policies,
    startup_seen,
    write_trace,
)
from pdserve.sim.workload import SimWorkload

if TYPE_CHECKING:
    from pdserve.bench.serve import RunFlags
    from pdserve.sim.replay_cli import PlannersFlags

POLL_S = 1.0  # how often the controller's instance counts are read


@dataclass
class LiveRun:
    """One policy's live run: its requests, counts over time and decisions (seconds
    from the load's start), and the steps its first instances' engines ran until
    the counts first changed (:func:`counts_polled`)."""

    records: list[RequestRecord]
    counts: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    wall_s: float
    steps: dict[str, list[StepRecord]]


def policy_yaml(text: str, policy: str, profile: str | None) -> str:
    """The config YAML with its planner on, under ``policy`` (and ``profile``)."""
    raw = yaml.safe_load(text)
    planner = raw.setdefault("planner", {})
    planner.update(mode="on", policy=policy)
    if profile is not None:
        planner["profile"] = profile
    return yaml.safe_dump(raw, sort_keys=False)


def measure_profile(config: ClusterConfig, path: Path, command: str) -> Path:
    """A profile of the config's first region's decode engine, measured on one thread."""
    import torch

    from pdserve.bench.report import machine_info
    from pdserve.sim.measure import MeasureGrid, measured_profile
    from pdserve.sim.profile import save_profile

    engine = config.engine_config("decode", config.regions[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profile = measured_profile(engine, MeasureGrid(), command, machine_info())
    finally:
        torch.set_num_threads(threads)
    return save_profile(profile, path)


@contextlib.contextmanager
def counts_polled(
    controller: Any, region: str, t0: float, leaders: list[tuple[str, Any]]
) -> Iterator[tuple[list[dict[str, Any]], dict[str, list[StepRecord]]]]:
    """Read the region's serving instance counts every ``POLL_S`` inside the block,
    and the steps of its first instances' ``leaders`` (``(name, actor)``) while the
    counts are the first ones (then the host runs other instances beside them).
    Yields the rows and, per leader, the steps that started before the counts changed."""
    import ray

    from pdserve.sim.live import TRACE_STEPS, take_steps

    rows: list[dict[str, Any]] = []
    steps: dict[str, list[StepRecord]] = {}
    done, tracing = threading.Event(), True
    take_steps(leaders, TRACE_STEPS, {})

    def poll() -> None:
        nonlocal tracing
        while not done.is_set():
            status = ray.get(controller.status.remote())
            g = next(x for x in status.regions if x.name == region)
            rows.append(
                {
                    "t_s": round(time.monotonic() - t0, 2),
                    f"{region}.prefill": g.prefill,
                    f"{region}.decode": g.decode,
                }
            )
            if tracing and rows[-1] | {"t_s": 0} != rows[0] | {"t_s": 0}:
                tracing = False  # keep the steps begun by the last poll at the first counts
                take_steps(leaders, 0, steps)
                cut = t0 + rows[-2]["t_s"]
                for name in steps:
                    steps[name] = [r for r in steps[name] if r.start_s < cut]
            elif tracing:
                take_steps(leaders, TRACE_STEPS, steps)
            done.wait(POLL_S)

    thread = threading.Thread(target=poll, name="counts", daemon=True)
    thread.start()
    try:
        yield rows, steps
    finally:
        done.set()
        thread.join()
        if tracing:
            take_steps(leaders, 0, steps)


def run_policy(text: str, policy: str, profile: str | None, ns: RunFlags, num_cpus: int) -> LiveRun:
    """Replay ``ns``'s trace on a local cluster of ``text`` under ``policy``."""
    import ray

    from pdserve.bench.local import local_cluster
    from pdserve.bench.serve import serve_rates
    from pdserve.cluster.config import parse_config
    from pdserve.cluster.connect import CONTROLLER, NAMESPACE
    from pdserve.sim.capacity import capacity_for

    text = policy_yaml(text, policy, profile)
    config = parse_config(text, "<live>")
    region = config.regions[0].name
    with local_cluster(text, num_cpus, capacity=capacity_for(config)) as (endpoints, _):
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        target = f"grpc://{endpoints.grpc_address}"
        leaders = [
            (f"{role}{i}", leader)
            for i, (role, leader) in enumerate(ray.get(controller.instance_handles.remote()))
        ]
        t0, wall0 = time.monotonic(), time.time()
        with counts_polled(controller, region, t0, leaders) as (counts, steps):
            result = serve_rates(ns, target, [None], label=policy)[0]
        events = ray.get(controller.status.remote()).scale_events
    decisions = [
        {
            "t_s": round(e.at - wall0, 2),
            "action": e.action,
            "reason": e.reason,
            "prefill": e.prefill,
            "decode": e.decode,
        }
        for e in events
        if e.source == "planner" and e.at >= wall0
    ]
    return LiveRun(result.records, counts, decisions, time.monotonic() - t0, steps)


def simulated_beside(
    config: ClusterConfig,
    profile: str,
    work: SimWorkload,
    policy: str,
    run: LiveRun,
    switch_s: float,
    args: PlannersFlags,
) -> dict[str, Any]:
    """The live run's policy simulated on the same workload, with each role's steps
    as the live engines ran them while the counts were the first ones (fitted to
    those traced steps, each role beside the other's:
    :func:`~pdserve.sim.calibrate.role_fits`) and the instances sharing
    this machine's cores (``--host-cores``, else the cores this process may use),
    an added instance starting as fast as the run's did (else ``--startup-s``):
    what the simulator predicts once told how fast this host runs the engines. What
    the live system spends outside the steps (the front door, the hand-off's RPCs)
    is not fitted here (``pdserve sim-validate`` does that)."""
    import os

    from pdserve.sim.build import book_for
    from pdserve.sim.calibrate import Overhead, beside_fits
    from pdserve.sim.live import Measured
    from pdserve.sim.profile import load_profile
    from pdserve.sim.replay import compare, outcome

    book = book_for(config, [load_profile(profile)], None)
    step, traces = book.profiles[0].step, Measured({}, run.steps).by_role()
    pooled, fits = beside_fits(step, traces)
    book = Overhead(pooled, fits).apply(book)
    cores = args.host_cores or len(os.sched_getaffinity(0))
    startup = startup_seen(run.counts, run.decisions)  # as an added instance started here
    startup = args.startup_s if startup is None else startup
    sim, _ = compare(config, book, work, [policy], startup, cores)[policy]
    slo = Slo(config.router.ttft_slo_s, config.router.tpot_slo_s)
    fitted = {role: dataclasses.asdict(f) for role, f in {"all": pooled, **fits}.items()}
    return {
        **outcome(sim, slo, switch_s),
        "host_cores": cores,
        "startup_s": round(startup, 2),
        "step_fits": fitted,
        "summary": sim.recorder.summary(slo),
        "instances_over_time": sim.counts,
        "planner_decisions": sim.decisions,
    }


def simulated_counts(results: dict[str, dict[str, Any]], first_s: float) -> dict[str, Any]:
    """Each policy's simulated counts over time on the live runs' clock (which starts
    at the trace's first request, ``first_s`` in virtual time)."""
    return {
        p: [{**row, "t_s": row["t_s"] - first_s} for row in r["simulated"]["instances_over_time"]]
        for p, r in results.items()
    }


def met_and_arrivals(records: list[RequestRecord], slo: Slo) -> tuple[np.ndarray, np.ndarray]:
    """Per request, in the trace's order: whether it met both SLOs, and when it was due."""
    ordered = sorted(records, key=lambda r: r.index)
    met = np.array([meets_slo(r, slo) for r in ordered], dtype=bool)
    return met, np.array([r.scheduled_s for r in ordered])


def replay_flags(work: SimWorkload, trace: Path, slo: Slo) -> RunFlags:
    """``pdserve bench serve``'s flags that replay ``trace`` as it is (no warm-up; the
    prompts' seed drawn once, for every policy's run)."""
    from pdserve.bench.serve import RunFlags, add_load_flags, add_workload_flags, with_prompt_seed
    from pdserve.core.options import options_from

    p = argparse.ArgumentParser()
    add_workload_flags(p)
    add_load_flags(p)
    ttft, tpot = (100000.0 if s is None else s * 1e3 for s in (slo.ttft_s, slo.tpot_s))
    ns = p.parse_args(
        [
            "--trace",
            str(trace),
            "--num-requests",
            str(len(work)),
            "--warmup",
            "0",
            "--no-progress",
            "--ttft-slo-ms",
            str(ttft),
            "--tpot-slo-ms",
            str(tpot),
        ]
    )
    return with_prompt_seed(options_from(RunFlags, ns))


def live_planners(
    args: PlannersFlags, config: ClusterConfig, work: SimWorkload, starts: list[float]
) -> int:
    """``pdserve sim-planners --live``: each policy on a local cluster of ``args.config``."""
    from pdserve.bench.report import summarize
    from pdserve.bench.serve import command_line

    out = Path(args.out)
    slo = Slo(config.router.ttft_slo_s, config.router.tpot_slo_s)
    trace = write_trace(work, Path(args.write_trace or out / f"{args.name}-trace.csv"))
    profile = args.profile[0] if args.profile else None
    if profile is None:  # the proactive planner's model, and the simulation beside each run
        path = out / f"{args.name}-profile.json"
        profile = str(measure_profile(config, path, command_line(args.prog, args)))
    ns = replay_flags(work, trace, slo)
    # the replay's clock starts at the trace's first request
    phases = [s - float(work.arrival_s[0]) for s in starts]
    switch = phases[1] if len(phases) > 1 else 0.0
    sim_switch = starts[1] if len(starts) > 1 else 0.0  # the same instant, simulated
    text = Path(args.config).read_text()
    results: dict[str, dict[str, Any]] = {}
    for policy in args.policies:
        run = run_policy(text, policy, profile, ns, args.num_cpus)
        met, arrival = met_and_arrivals(run.records, slo)
        sim = simulated_beside(config, profile, work, policy, run, sim_switch, args)
        results[policy] = {
            **figures(met, arrival, run.counts, run.decisions, switch),
            "wall_s": round(run.wall_s, 1),
            "summary": summarize(run.records, slo),
            "instances_over_time": run.counts,
            "planner_decisions": run.decisions,
            "simulated": sim,
        }
    paths = _write_live(args, results, phases, profile, trace, float(work.arrival_s[0]))
    print(comparison_table(results))
    print("\nEach run beside its simulation with the steps as the live engines ran them:")
    print(beside_table(results))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _write_live(
    args: PlannersFlags,
    results: dict[str, dict[str, Any]],
    phases: list[float],
    profile: str,
    trace: Path,
    first_arrival_s: float,
) -> list[Path]:
    """The live replay's JSON and plot (``phases``: when each trace began, on the replay's
    clock); the paths written, the trace's last."""
    from pdserve.bench.report import header, write_json
    from pdserve.bench.serve import command_line

    out = Path(args.out)
    payload = {
        **header(command_line(args.prog, args)),
        "config": str(args.config),
        "live": True,
        "traces": args.traces,
        "phase_starts_s": phases,
        "rate": args.rate,
        "profile": profile,
        "policies": results,
    }
    counts = {p: r["instances_over_time"] for p, r in results.items()}
    return [
        write_json(out / f"{args.name}.json", payload),
        plot_policies(
            counts,
            phases,
            args.traces,
            out / f"{args.name}.png",
            "time",
            simulated_counts(results, first_arrival_s),
        ),
        trace,
    ]
