"""``pdserve sim-validate``: the simulator against the real system, point by point.

For each point (a setup, a workload, a rate) the same cluster config runs twice:
for real, a local cluster (ranks pinned as in ``pdserve bench
disagg-vs-colocated``) loaded by ``pdserve bench serve``'s load generator; and
simulated, :class:`~pdserve.sim.cluster.SimCluster` on that config with a
profile measured on this machine with the ranks' thread counts and cores. Both
see the same arrivals and lengths (one argument namespace builds both
workloads). The report gives TTFT and TPOT p50 and p90 of each and their
relative errors. With ``--repeat N`` each point is measured N times (the points
in turn, N rounds): the simulation is compared with the runs' mean figures, and
each later run with the first, which says how far apart two runs of the real
system land on this machine (the floor under any simulator's error).

Setups: ``colocated`` (one decode-role instance prefilling every prompt itself,
both cores) and ``disaggregated`` (one prefill and one decode instance, a core
each). Workloads: ``conv`` and ``code`` (the Azure traces, lengths scaled by
``--length-scale`` and clamped) and ``long`` (synthetic 1,024-token prompts,
32-token outputs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.messages import StepRecord
from pdserve.sim.fit import nonnegative_lstsq
from pdserve.sim.live import LiveFit, Measured, live_fit, scaled, traced
from pdserve.sim.profile import StepModel
from pdserve.sim.validate_report import TOLERANCE, compare_point, point_row

WORKLOADS: dict[str, list[str]] = {
    "conv": ["--trace", "azure-conv", "--max-prompt-len", "1024", "--max-output-len", "128"],
    "code": ["--trace", "azure-code", "--max-prompt-len", "1024", "--max-output-len", "128"],
    "long": ["--prompt-len", "1024", "--output-len", "32"],
}
SETUPS = ("colocated", "disaggregated")
# (setup, workload, rate req/s) of the default run: each workload at a low rate and
# near saturation on builtin:small, two cores
DEFAULT_POINTS = (
    "colocated:conv:0.3", "colocated:conv:1.2",
    "disaggregated:code:0.3", "disaggregated:code:1.0",
    "disaggregated:long:0.2", "colocated:long:0.8",
)  # fmt: skip
CALIBRATION_RATE = 0.5  # req/s, fixed gaps: each request alone


@dataclass(frozen=True)
class Point:
    setup: str
    workload: str
    rate: float

    @classmethod
    def parse(cls, text: str) -> Point:
        try:
            setup, workload, rate = text.split(":")
            point = cls(setup, workload, float(rate))
        except ValueError:
            raise InvalidArgumentError("point", f"{text!r} is not SETUP:WORKLOAD:RATE") from None
        if setup not in SETUPS or workload not in WORKLOADS or not point.rate > 0:
            raise InvalidArgumentError(
                "point", f"{text!r}: setup in {SETUPS}, workload in {sorted(WORKLOADS)}, rate > 0"
            )
        return point

    @property
    def name(self) -> str:
        return f"{self.setup}:{self.workload}:{self.rate:g}"


def bench_flags(workload: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """``pdserve bench serve``'s workload and load flags, parsed as that command parses them."""
    from pdserve.bench.serve import add_load_flags, add_workload_flags

    p = argparse.ArgumentParser()
    add_workload_flags(p)
    add_load_flags(p)
    flags = [*workload, "--num-requests", str(args.num_requests), "--seed", str(args.seed),
             "--no-progress", "--warmup", "2", "--ttft-slo-ms", "100000",
             "--tpot-slo-ms", "100000"]  # fmt: skip
    ns = p.parse_args(flags)
    ns.api_key, ns.model = None, None
    return ns


def workload_args(point: Point, args: argparse.Namespace) -> argparse.Namespace:
    flags = list(WORKLOADS[point.workload])
    if point.workload in ("conv", "code"):
        flags += ["--length-scale", str(args.length_scale)]
    return bench_flags(flags, args)


@contextlib.contextmanager
def pinned_here(cores: tuple[int, ...]) -> Iterator[None]:
    """This process on ``cores`` with as many torch threads, as a rank would be."""
    import torch

    from pdserve.bench.local import claim_cores

    before, threads = claim_cores(set(cores)), torch.get_num_threads()
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def per_point(measured: list[Measured], points: int) -> list[list[Measured]]:
    """Runs of ``points`` points measured in rounds (each in turn), grouped by point."""
    return [measured[i::points] for i in range(points)]


def _config_args(args: argparse.Namespace) -> argparse.Namespace:
    """What :func:`pdserve.bench.headline.cluster_setup` reads."""
    return argparse.Namespace(
        model=args.model, connector="shm", max_num_batched_tokens=256,
        prefill_max_num_batched_tokens=2048, cores=args.cores, ttft_slo_ms=100000.0,
        tpot_slo_ms=100000.0,
    )  # fmt: skip


def setup_profiles(setup: str, args: argparse.Namespace) -> tuple[str, Any]:
    """(cluster YAML, profile book) of a setup: the profile measured on the cores and
    with the threads its ranks get."""
    from pdserve.bench.headline import cluster_setup
    from pdserve.bench.report import machine_info
    from pdserve.cluster.config import parse_config
    from pdserve.sim.build import book_for
    from pdserve.sim.measure import MeasureGrid, measured_profile

    text, pins = cluster_setup(setup, _config_args(args))
    config = parse_config(text, f"<{setup}>")
    engine = config.engine_config("decode", config.regions[0])
    with pinned_here(pins["decode"]):
        profile = measured_profile(engine, MeasureGrid(), f"sim-validate {setup}", machine_info())
    return text, book_for(config, [profile], None)


def simulate(
    text: str, book: Any, ns: argparse.Namespace, rate: float, overhead: Overhead
) -> dict[str, Any]:
    from pdserve.cluster.config import parse_config
    from pdserve.sim.cluster import SimCluster, SimOptions, slo_of
    from pdserve.sim.workload import workload_from_args

    config = parse_config(text, "<sim>")
    work = workload_from_args(ns, rate, [1.0])
    options = SimOptions(fast=False, planner=False, request_overhead_s=overhead.request_s,
                         one_host=True)  # fmt: skip
    run = SimCluster(config, overhead.apply(book), work, options).run()
    return run.recorder.summary(slo_of(config))


@dataclass(frozen=True)
class Overhead:
    """What the live system spends beyond the profiled steps, from the calibration
    requests: its steps' own slowdown (``live``, from the engines' step traces),
    then per engine step (the loop between steps), per sequence of a step (its
    token streamed out through the router), per hand-off from a prefill to a decode
    instance (the RPCs, the activation and the decode loop waking, beyond the pages'
    copy) and per request (front door, router, RPCs)."""

    live: LiveFit = field(default_factory=LiveFit)
    role_live: dict[str, LiveFit] = field(default_factory=dict)  # per role, in place of live
    step_s: float = 0.0
    seq_s: float = 0.0
    handoff_s: float = 0.0
    request_s: float = 0.0

    def apply(self, book: Any) -> Any:
        from pdserve.sim.build import ProfileBook
        from pdserve.sim.profile import TransferModel

        def link(t: TransferModel) -> TransferModel:
            return TransferModel(t.latency_s + self.handoff_s, t.bytes_per_s)

        def step(s: StepModel, live: LiveFit) -> StepModel:
            s = scaled(s, live)
            return dataclasses.replace(
                s, overhead_s=s.overhead_s + self.step_s, s_per_seq=s.s_per_seq + self.seq_s
            )

        profiles = [
            dataclasses.replace(p, step=step(p.step, self.live),
                                connectors={name: link(t) for name, t in p.connectors.items()})
            for p in book.profiles
        ]  # fmt: skip
        roles = {role: step(book.profiles[0].step, fit) for role, fit in self.role_live.items()}
        return ProfileBook(book.model, profiles, book.device, book.assumptions, roles)


CALIBRATION = ["--prompt-len", "256", "--output-len", "32", "--arrival", "fixed"]
BURST = ["--prompt-len", "256", "--output-len", "32", "--arrival", "burst", "--burst-size", "8"]
SHORT = ["--prompt-len", "256", "--output-len", "4", "--arrival", "fixed"]
CALIBRATION_BURST_RATE = 1.0  # req/s: a burst of 8 every 8 s, done well before the next
CALIBRATION_OVERLAP_RATE = 4.0  # req/s, fixed gaps: a prefill beside the last one's decode


def calibration_args(args: argparse.Namespace) -> list[tuple[argparse.Namespace, float]]:
    """(flags, rate) of the calibration runs: one request at a time (a fixed gap longer
    than a request: no queueing, no batching), bursts of 8 (batches of up to 8), and
    one at a time again with 4 output tokens (the hand-off to decode weighs on their
    TPOT eight times as much as on 32 tokens'), and a steady 4 req/s (each prefill
    runs beside the decode steps of the requests before it)."""
    single, burst, short, overlap = (bench_flags(w, args) for w in (CALIBRATION, BURST, SHORT,
                                                                     CALIBRATION))  # fmt: skip
    single.num_requests = short.num_requests = args.calibration_requests
    burst.num_requests = 2 * 8
    overlap.num_requests = 3 * args.calibration_requests
    return [(single, CALIBRATION_RATE), (burst, CALIBRATION_BURST_RATE), (short, CALIBRATION_RATE),
            (overlap, CALIBRATION_OVERLAP_RATE)]  # fmt: skip


def _tpot(summary: dict[str, Any]) -> float:
    return float(summary["tpot_ms"]["p50"]) / 1e3


def calibrate(
    text: str,
    book: Any,
    real: list[dict[str, Any]],
    runs: list[tuple[argparse.Namespace, float]],
    traces: list[list[StepRecord]] | None = None,
) -> Overhead:
    """The overheads that make the simulated calibration runs match the measured ones.

    The engines' own steps during the runs (``traces``: each instance's, when traced)
    set the step model's scales, offset, and cold and shared factors
    (:func:`~pdserve.sim.live.live_fit`). Then TPOT p50 of
    each run, against the simulation's sensitivity to each overhead (it differs
    with the batch and the output length), gives the per-step, per-sequence
    and per-hand-off overheads: the non-negative least-squares answer (exact when the
    runs are independent; an overhead a setup lacks, such as the hand-off of a
    colocated one, has no effect and comes out 0). Then TTFT p50 of the single run
    gives the per-request one.
    """

    def tpots(o: Overhead) -> np.ndarray:
        return np.array([_tpot(simulate(text, book, ns, rate, o)) for ns, rate in runs])

    live = live_fit(book.profiles[0].step, traces or [])
    base, probe = tpots(Overhead(live)), 1e-3
    probes = (Overhead(live, step_s=probe), Overhead(live, seq_s=probe),
              Overhead(live, handoff_s=probe))  # fmt: skip
    columns = [(tpots(o) - base) / probe for o in probes]
    gap = np.array([_tpot(r) for r in real]) - base
    step_s, seq_s, handoff_s = nonnegative_lstsq(np.column_stack(columns), gap)
    fitted = Overhead(live, step_s=step_s, seq_s=seq_s, handoff_s=handoff_s)
    single, rate = runs[0]
    stepped = simulate(text, book, single, rate, fitted)
    request = max(0.0, (real[0]["ttft_ms"]["p50"] - stepped["ttft_ms"]["p50"]) / 1e3)
    return dataclasses.replace(fitted, request_s=request)


def measure(
    text: str, setup: str, runs: list[tuple[argparse.Namespace, float]], args: argparse.Namespace
) -> list[Measured]:
    """Each (workload flags, rate) measured in turn on one local cluster of the setup,
    with every instance's engine steps traced."""
    import ray

    from pdserve.bench.headline import cluster_setup
    from pdserve.bench.local import local_cluster
    from pdserve.bench.serve import serve_rates
    from pdserve.cluster.serve import CONTROLLER, NAMESPACE

    _, pins = cluster_setup(setup, _config_args(args))
    out = []
    with local_cluster(text, len(args.cores), pins) as (endpoints, _):
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        leaders = [(f"{role}{i}", leader) for i, (role, leader)
                   in enumerate(ray.get(controller.instance_handles.remote()))]  # fmt: skip
        target = f"grpc://{endpoints.host}:{endpoints.grpc_port}"
        for i, (ns, rate) in enumerate(runs):
            with traced(leaders) as steps:
                result = serve_rates(ns, target, [rate], label=setup, first_run=i)[0]
            out.append(Measured(result.summary, steps))
    return out


def own_steps(overhead: Overhead, book: Any, measured: Measured) -> Overhead:
    """``overhead`` with each role's steps set to what its engine ran at this point
    (not a prediction: it tells the error of the step times, which contention under
    load moves, from that of the simulated scheduling, routing and queueing)."""
    step = book.profiles[0].step
    fits = {role: live_fit(step, traces) for role, traces in measured.by_role().items()
            if any(traces)}  # fmt: skip
    return dataclasses.replace(overhead, role_live=fits)


def validate(
    points: list[Point], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows per point, and each setup's calibrated overheads."""
    rows, calibrations = [], {}
    cal = calibration_args(args)
    for setup in SETUPS:
        mine = [p for p in points if p.setup == setup]
        if not mine:
            continue
        text, book = setup_profiles(setup, args)
        flags = [workload_args(p, args) for p in mine]
        start = time.perf_counter()
        rounds = list(zip(flags, [p.rate for p in mine], strict=True)) * args.repeat
        runs = [*cal, *rounds]
        real = measure(text, setup, runs, args)
        summaries = [m.summary for m in real]
        overhead = calibrate(text, book, summaries[: len(cal)], cal,
                             Measured.all_traces(real[: len(cal)]))  # fmt: skip
        live_model = scaled(book.profiles[0].step, overhead.live)
        calibrations[setup] = {"compute_scale": round(overhead.live.compute_scale, 4),
                               "memory_scale": round(overhead.live.memory_scale, 4),
                               "step_offset_ms": round(overhead.live.offset_s * 1e3, 3),
                               "cold_compute": round(overhead.live.cold_compute, 4),
                               "cold_factor": round(overhead.live.cold_factor, 4),
                               "shared_compute": round(overhead.live.shared_compute, 4),
                               "shared_factor": round(overhead.live.shared_factor, 4),
                               "traced_steps": overhead.live.steps,
                               "step_overhead_ms": round(overhead.step_s * 1e3, 3),
                               "seq_overhead_ms": round(overhead.seq_s * 1e3, 3),
                               "handoff_overhead_ms": round(overhead.handoff_s * 1e3, 3),
                               "request_overhead_ms": round(overhead.request_s * 1e3, 3),
                               "calibration": summaries[: len(cal)],
                               "wall_s": round(time.perf_counter() - start, 1)}  # fmt: skip
        for point, ns, repeats in zip(
            mine, flags, per_point(real[len(cal) :], len(mine)), strict=True
        ):
            sim = simulate(text, book, ns, point.rate, overhead)
            rows.append(point_row(point.name, sim, repeats, live_model))
            own = simulate(text, book, ns, point.rate, own_steps(overhead, book, repeats[0]))
            rows[-1].update(
                sim_own_steps=own, compare_own_steps=compare_point(repeats[0].summary, own)
            )
    return rows, calibrations


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-validate", help="simulated against measured latency, point by point")
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS),
                   help="SETUP:WORKLOAD:RATE (setups: colocated, disaggregated; "
                        "workloads: conv, code, long)")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--length-scale", type=float, default=0.25, help="for the Azure traces")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-requests", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1,
                   help="measure every point this many times (in turn, after the calibration): "
                        "the simulation is compared with the runs' mean figures, and each "
                        "later run with the first")  # fmt: skip
    p.add_argument("--cores", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", default="bench/out/sim")
    p.add_argument("--name", default="validation")
    p.set_defaults(func=cmd_sim_validate, prog="pdserve sim-validate")


def cmd_sim_validate(args: argparse.Namespace) -> int:
    from pdserve.bench.report import header, write_json
    from pdserve.bench.serve import command_line
    from pdserve.core.builtin_models import resolve_model
    from pdserve.sim.validate_report import calibration_lines, mean_abs_error, repeat_table, table

    points = [Point.parse(p) for p in args.points]
    if args.repeat < 1:
        raise InvalidArgumentError("--repeat", f"must be at least 1, got {args.repeat}")
    resolve_model(args.model)
    rows, calibrations = validate(points, args)
    apart = mean_abs_error([run for r in rows for run in r.get("compare_runs", [])])
    payload = {**header(command_line(args)), "tolerance": TOLERANCE, "points": rows,
               "calibration": calibrations,
               "mean_abs_error": mean_abs_error([r["compare"] for r in rows]),
               "runs_mean_abs_difference": apart}  # fmt: skip
    path = write_json(Path(args.out) / f"{args.name}.json", payload)
    print(table(rows))
    if args.repeat > 1:
        print(repeat_table(rows))
    print("\nThe same, simulated with each role's steps as they ran (the first run):")
    print(table(rows, "compare_own_steps"))
    for line in calibration_lines(rows, calibrations):
        print(line)
    print(f"mean |error| {payload['mean_abs_error']}; * outside the tolerance {TOLERANCE}")
    if apart is not None:
        print(f"later runs against the first: mean |difference| {apart}")
    print(f"wrote {path}")
    return 0
