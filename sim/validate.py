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

Its parts, by job: the points (:mod:`pdserve.sim.validate_points`), measuring them
(:mod:`~pdserve.sim.validate_measure`), the fit (:mod:`~pdserve.sim.calibrate`,
:mod:`~pdserve.sim.validate_fit`), comparing (:mod:`~pdserve.sim.validate_compare`)
and the report (:mod:`~pdserve.sim.validate_report`); this module runs them in
order and holds the command line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pdserve.bench.flags import file_stem
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from
from pdserve.sim.calibrate import calibrate, calibration_args, host_check_args, host_check_baseline
from pdserve.sim.kept import kept_entry, kept_runs, kept_setup, read_kept
from pdserve.sim.live import Measured
from pdserve.sim.validate_compare import point_rows
from pdserve.sim.validate_fit import calibration_row, with_noise, write_calibrated
from pdserve.sim.validate_measure import measure, setup_profiles
from pdserve.sim.validate_options import DEFAULT_POINTS, ValidateOptions
from pdserve.sim.validate_points import SETUPS, Point, workload_args
from pdserve.sim.validate_report import print_results, write_results


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
    path, payload = write_results(args, rows, calibrations, measured)
    print_results(args, points, rows, calibrations, payload)
    print(f"wrote {path}")
    return 0
