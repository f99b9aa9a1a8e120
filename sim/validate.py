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

With ``--calibrate-around`` the calibration runs are measured again after the
points and the fit takes both: on a host whose speed drifts by 10-20% over
minutes (``docs/results/simulator.md``), the calibration then stands for the host over
the points rather than for the minutes before them.

``--keep-traces`` also writes what was measured (per setup the cluster YAML,
the profile, every run's workload, summary and engines' traced steps), and
``--from-traces`` calibrates and simulates again on such a file without
measuring anything, so a change to the calibration or the step model can be
tried on runs that took the better part of an hour to measure.

The points: :mod:`pdserve.sim.validate_points`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.flags import file_stem
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from
from pdserve.sim.calibrate import (
    Overhead,
    Runs,
    calibrate,
    calibrated_profile,
    calibration_args,
    host_check_args,
    host_check_baseline,
    host_factors,
    own_steps,
    rescaled,
    simulate,
    simulate_each,
)
from pdserve.sim.kept import kept_entry, kept_runs, kept_setup, read_kept
from pdserve.sim.live import Measured, scaled, traced
from pdserve.sim.validate_options import DEFAULT_POINTS, ValidateOptions
from pdserve.sim.validate_points import (
    SETUPS,
    Point,
    workload_args,
    written_lines,
)
from pdserve.sim.validate_report import TOLERANCE, compare_point, point_row

if TYPE_CHECKING:
    from pdserve.bench.headline import ClusterSetup
    from pdserve.bench.serve import RunFlags


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


def with_noise(overhead: Overhead, args: ValidateOptions) -> Overhead:
    """``overhead`` as the points are simulated: with its fitted noise under
    ``--noise-draws``, else without (:meth:`Overhead.quiet`)."""
    return overhead if args.noise_draws else overhead.quiet()


def per_point(measured: list[Measured], points: int) -> list[list[Measured]]:
    """Runs of ``points`` points measured in rounds (each in turn), grouped by point."""
    return [measured[i::points] for i in range(points)]


def _config_args(args: ValidateOptions) -> ClusterSetup:
    """The setups' clusters: the model on the cores, SLOs no run misses."""
    from pdserve.bench.headline import ClusterSetup

    return ClusterSetup(
        model=args.model,
        cores=args.cores,
        connector="shm",
        max_num_batched_tokens=256,
        prefill_max_num_batched_tokens=2048,
        ttft_slo_ms=100000.0,
        tpot_slo_ms=100000.0,
    )


def setup_config(setup: str, args: ValidateOptions) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(cluster YAML, each role's cores) of a setup."""
    from pdserve.bench.headline import cluster_setup

    return cluster_setup(setup, _config_args(args))


def setup_profiles(setup: str, args: ValidateOptions) -> tuple[str, Any]:
    """(cluster YAML, profile book) of a setup: the profile measured on the cores and
    with the threads its ranks get."""
    from pdserve.bench.report import machine_info
    from pdserve.cluster.config import parse_config
    from pdserve.sim.build import book_for
    from pdserve.sim.measure import MeasureGrid, measured_profile

    text, pins = setup_config(setup, args)
    config = parse_config(text, f"<{setup}>")
    engine = config.engine_config("decode", config.regions[0])
    with pinned_here(pins["decode"]):
        profile = measured_profile(engine, MeasureGrid(), f"sim-validate {setup}", machine_info())
    return text, book_for(config, [profile], None)


def measure(text: str, setup: str, runs: Runs, args: ValidateOptions) -> list[Measured]:
    """Each (workload flags, rate) measured in turn on one local cluster of the setup,
    with every instance's engine steps traced."""
    import ray

    from pdserve.bench.headline import cluster_setup
    from pdserve.bench.local import local_cluster
    from pdserve.bench.serve import serve_rates
    from pdserve.cluster.connect import CONTROLLER, NAMESPACE

    _, pins = cluster_setup(setup, _config_args(args))
    out = []
    with local_cluster(text, len(args.cores), pins) as (endpoints, _):
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        leaders = [
            (f"{role}{i}", leader)
            for i, (role, leader) in enumerate(ray.get(controller.instance_handles.remote()))
        ]
        target = f"grpc://{endpoints.grpc_address}"
        for i, (ns, rate) in enumerate(runs):
            with traced(leaders) as steps:
                result = serve_rates(ns, target, [rate], label=setup, first_run=i)[0]
            out.append(Measured(result.summary, steps))
    return out


def calibration_row(
    overhead: Overhead, book: Any, runs: list[Measured], start: float
) -> dict[str, Any]:
    """What a setup's calibration found: the live step model's scales, the per-step,
    per-sequence, per-handoff and per-request overheads, the calibration runs, and their
    steps by kind against the calibrated model (:meth:`Measured.kinds`)."""
    step = book.profiles[0].step
    roles = {role: scaled(step, fit) for role, fit in overhead.role_live.items()}
    return {
        "compute_scale": round(overhead.live.compute_scale, 4),
        "memory_scale": round(overhead.live.memory_scale, 4),
        "step_offset_ms": round(overhead.live.offset_s * 1e3, 3),
        "cold_compute": round(overhead.live.cold_compute, 4),
        "cold_factor": round(overhead.live.cold_factor, 4),
        "shared_compute": round(overhead.live.shared_compute, 4),
        "shared_factor": round(overhead.live.shared_factor, 4),
        "traced_steps": overhead.live.steps,
        "jitter": round(overhead.live.jitter, 4),
        "jitter_s": round(overhead.live.jitter_s, 4),
        "step_overhead_ms": round(overhead.step_s * 1e3, 3),
        "seq_overhead_ms": round(overhead.seq_s * 1e3, 3),
        "handoff_overhead_ms": round(overhead.handoff_s * 1e3, 3),
        "request_overhead_ms": round(overhead.request_s * 1e3, 3),
        "role_fits": {role: dataclasses.asdict(fit) for role, fit in overhead.role_live.items()},
        "calibration": [m.summary for m in runs],
        "steps_by_kind": Measured.kinds(runs, roles, scaled(step, overhead.live)),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def validate(
    points: list[Point], args: ValidateOptions, kept: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Rows per point, each setup's calibrated overheads, and what was measured (per
    setup: the cluster YAML, the profile and every run with its traced steps). With
    ``kept`` (that last, from an earlier run) nothing is measured: the calibration and
    the simulation run again on the runs it holds."""
    rows, calibrations, measured = [], {}, {}
    for setup in SETUPS:
        mine = [p for p in points if p.setup == setup]
        if not mine:
            continue
        cal = calibration_args(args, setup)
        flags = [workload_args(p, args) for p in mine]
        start = time.perf_counter()
        rounds = list(zip(flags, [p.rate for p in mine], strict=True)) * args.repeat
        if args.host_check:  # a short check run before each
            rounds = [run for r in rounds for run in (host_check_args(args), r)]
        after = cal if args.calibrate_around else []  # again, after the points
        text, book = kept_setup(kept, setup) if kept is not None else setup_profiles(setup, args)
        runs = [*cal, *rounds, *after]
        real = (
            kept_runs(kept, setup, runs) if kept is not None else measure(text, setup, runs, args)
        )
        measured[setup] = kept_entry(text, book, runs, real)
        ends = len(real) - len(after)  # where the points' runs end
        fitted = real[: len(cal)] + real[ends:]
        overhead = calibrate(
            text,
            book,
            [m.summary for m in fitted],
            cal + after,
            Measured.role_traces(fitted),
            per_role=args.role_fit,
        )
        calibrations[setup] = calibration_row(overhead, book, fitted, start)  # noise fitted
        if args.write_profiles:
            calibrations[setup]["written"] = write_calibrated(setup, text, book, overhead, args)
        overhead = with_noise(overhead, args)
        calibrations[setup]["around"] = bool(after)
        base = host_check_baseline(cal)  # what a host check repeats, in each calibration
        baselines = [real[base], *([real[ends + base]] if after else [])]
        rows += point_rows(mine, flags, text, book, overhead, real[:ends], cal, baselines, args)
    return rows, calibrations, measured


def write_calibrated(
    setup: str, text: str, book: Any, overhead: Overhead, args: ValidateOptions
) -> dict[str, str]:
    """Write the setup's cluster YAML and its calibrated profile (noise included:
    :func:`~pdserve.sim.calibrate.calibrated_profile`) under ``--out``, for ``pdserve
    sim``; their paths."""
    from pdserve.bench.serve import command_line
    from pdserve.sim.profile import save_profile

    stem = Path(args.out) / f"{args.name}-{setup}"
    config = stem.with_name(f"{stem.name}.yaml")
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    profile = calibrated_profile(book, overhead, command_line(args.prog, args))
    path = save_profile(profile, stem.with_name(f"{stem.name}-profile.json"))
    return {"config": str(config), "profile": str(path)}


def point_rows(
    mine: list[Point],
    flags: list[RunFlags],
    text: str,
    book: Any,
    overhead: Overhead,
    real: list[Measured],
    cal: Runs,
    baselines: list[Measured],
    args: ValidateOptions,
) -> list[dict[str, Any]]:
    """One setup's rows: each point simulated with the calibration (``overhead``), with
    the steps its first run ran, and with ``--host-check`` with the steps scaled by
    the checks measured before its runs (``real``: calibration runs, then the rounds)
    against the same requests in the calibration (``baselines``: before the points,
    and after them with ``--calibrate-around``, as the fit took both)."""
    live_model = scaled(book.profiles[0].step, overhead.live)
    role_models = {r: scaled(book.profiles[0].step, f) for r, f in overhead.role_live.items()}
    points_real, checks = real[len(cal) :], None
    draws = max(1, args.noise_draws)
    if args.host_check:
        points_real, checks = points_real[1::2], per_point(points_real[0::2], len(mine))
    rows = []
    for k, (point, ns, repeats) in enumerate(
        zip(mine, flags, per_point(points_real, len(mine)), strict=True)
    ):
        sim = simulate(text, book, ns, point.rate, overhead, draws)
        row = point_row(point.name, sim, repeats, live_model, role_models)
        own_fit = with_noise(own_steps(overhead, book, repeats[0]), args)
        own = simulate(text, book, ns, point.rate, own_fit, draws)
        row.update(sim_own_steps=own, compare_own_steps=compare_point(repeats[0].summary, own))
        if checks is not None:
            factors = host_factors(role_models, live_model, baselines, checks[k])
            checked = simulate_each(
                text, book, ns, point.rate, [rescaled(overhead, f) for f in factors], draws
            )
            row.update(
                host_factors=factors,
                sim_host_checked=checked,
                compare_host_checked=compare_point(row.get("real_mean", row["real"]), checked),
            )
        rows.append(row)
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-validate", help="simulated against measured latency, point by point")
    p.add_argument("--model", default="builtin:small")
    _add_point_flags(p)
    _add_fit_flags(p)
    _add_trace_flags(p)
    p.set_defaults(func=cmd_sim_validate, prog="pdserve sim-validate")


def _add_point_flags(p: argparse.ArgumentParser) -> None:
    """The points, their workloads and runs."""
    p.add_argument(
        "--points",
        nargs="+",
        default=list(DEFAULT_POINTS),
        help="SETUP:WORKLOAD:RATE[:cN][:tS] (setups: colocated, disaggregated; "
        "workloads: conv, code, long; cN: at most N requests in flight; "
        "tS: a request times out S seconds after it was sent)",
    )
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--length-scale", type=float, default=0.25, help="for the Azure traces")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-requests", type=int, default=8)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every point this many times (in turn, after the calibration): "
        "the simulation is compared with the runs' mean figures, and each "
        "later run with the first",
    )
    p.add_argument("--cores", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", default="bench/out/sim")
    p.add_argument("--name", type=file_stem, default="validation")


def _add_fit_flags(p: argparse.ArgumentParser) -> None:
    """How the calibration fits the steps and what the simulation is given."""
    p.add_argument(
        "--role-fit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit each role's steps on their own, beside the other role's "
        "(--no-role-fit: one fit of every instance's steps)",
    )
    p.add_argument(
        "--host-check",
        action="store_true",
        help="before each measured run, four single 1,024-token requests (as in "
        "the calibration): the simulation is also given each role's steps "
        "scaled by how much slower the engines ran them than in the "
        "calibration (the host's drift)",
    )
    p.add_argument(
        "--calibrate-around",
        action="store_true",
        help="measure the calibration runs again after the points and fit on both: "
        "a host whose speed drifts over minutes is calibrated at its mean "
        "over the points, not at that of the minutes before them",
    )
    p.add_argument(
        "--noise-draws",
        type=int,
        default=0,
        metavar="N",
        help="simulate the steps' and requests' noise about the calibrated model "
        "(its spread and how long a deviation lasts, fitted on the traced "
        "steps; pdserve.sim.jitter), N draws of it, and compare the mean of "
        "their figures (0: no noise)",
    )


def _add_trace_flags(p: argparse.ArgumentParser) -> None:
    """What is written besides the figures, and runs read back instead of measured."""
    p.add_argument(
        "--keep-traces",
        action="store_true",
        help="also write NAME-traces.json: per setup the cluster YAML, the profile "
        "and every measured run with its engines' traced steps",
    )
    p.add_argument(
        "--write-profiles",
        action="store_true",
        help="also write each setup's cluster YAML and calibrated profile "
        "(NAME-SETUP.yaml, NAME-SETUP-profile.json) and print, per point, the "
        "`pdserve sim` command that simulates it with them",
    )
    p.add_argument(
        "--from-traces",
        default=None,
        metavar="FILE",
        help="measure nothing: calibrate and simulate again on a --keep-traces "
        "file's runs (the same points, --repeat and request counts)",
    )


def checked_points(args: ValidateOptions) -> list[Point]:
    """The points, once every flag is checked: a bad one is an error now, not after
    the better part of an hour of calibration."""
    from pdserve.bench.headline import check_cores
    from pdserve.sim.workload import workload_from_args

    points = [Point.parse(p) for p in args.points]
    for flag, value in (
        ("--repeat", args.repeat),
        ("--calibration-requests", args.calibration_requests),
    ):
        if value < 1:
            raise InvalidArgumentError(flag, f"must be at least 1, got {value}")
    if args.noise_draws < 0:
        raise InvalidArgumentError("--noise-draws", f"must be at least 0, got {args.noise_draws}")
    if not args.from_traces:  # measuring: the cores of both setups
        check_cores(args.cores, sorted({p.setup for p in points}))
    for point in points:
        workload_from_args(workload_args(point, args), point.rate, [1.0])
    return points


def cmd_sim_validate(args: argparse.Namespace) -> int:
    return sim_validate(options_from(ValidateOptions, args))


def sim_validate(args: ValidateOptions) -> int:
    """The points checked, measured (or read back), simulated; the results written."""
    from pdserve.models.builtin import resolve_model

    points = checked_points(args)
    kept = read_kept(Path(args.from_traces)) if args.from_traces else None
    if kept is None:
        resolve_model(args.model)
    rows, calibrations, measured = validate(points, args, kept)
    path, payload = _write_results(args, rows, calibrations, measured)
    _print_results(args, points, rows, calibrations, payload)
    print(f"wrote {path}")
    return 0


def _write_results(
    args: ValidateOptions,
    rows: list[dict[str, Any]],
    calibrations: dict[str, Any],
    measured: dict[str, Any],
) -> tuple[Path, dict[str, Any]]:
    """The validation's JSON (and, with --keep-traces, the runs' traces): its path and
    what it holds."""
    from pdserve.bench.report import header, write_json
    from pdserve.bench.serve import command_line
    from pdserve.sim.validate_report import mean_abs_error

    apart = mean_abs_error([run for r in rows for run in r.get("compare_runs", [])])
    payload = {
        **header(command_line(args.prog, args)),
        "tolerance": TOLERANCE,
        "points": rows,
        "calibration": calibrations,
        "mean_abs_error": mean_abs_error([r["compare"] for r in rows]),
        "runs_mean_abs_difference": apart,
    }
    path = write_json(Path(args.out) / f"{args.name}.json", payload)
    if args.keep_traces:
        traces = write_json(
            Path(args.out) / f"{args.name}-traces.json",
            {**header(command_line(args.prog, args)), "setups": measured},
        )
        print(f"wrote {traces}")
    return path, payload


def _print_results(
    args: ValidateOptions,
    points: list[Point],
    rows: list[dict[str, Any]],
    calibrations: dict[str, Any],
    payload: dict[str, Any],
) -> None:
    from pdserve.sim.validate_report import (
        calibration_lines,
        failed_lines,
        host_check_lines,
        repeat_table,
        table,
    )

    print(table(rows))
    for line in failed_lines(rows):
        print(line)
    if args.repeat > 1:
        print(repeat_table(rows))
    print("\nThe same, simulated with each role's steps as they ran (the first run):")
    print(table(rows, "compare_own_steps"))
    if args.host_check:
        print("\nThe same, simulated with each role's steps scaled by the host checks:")
        print("\n".join(host_check_lines(rows)))
    print(
        "\n".join(
            [*calibration_lines(rows, calibrations), *written_lines(points, args, calibrations)]
        )
    )
    print(f"mean |error| {payload['mean_abs_error']}; * outside the tolerance {TOLERANCE}")
    apart = payload["runs_mean_abs_difference"]
    if apart is not None:
        print(f"later runs against the first: mean |difference| {apart}")
