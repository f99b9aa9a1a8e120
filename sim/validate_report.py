"""What ``pdserve sim-validate`` writes and prints: the JSON of its points and
calibrations, the side-by-side table, then how far the live steps were from the
calibrated step model at each point and what each setup's calibration found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.sim.figures import FIGURES, KEYS, figure, mean_figures
from pdserve.sim.live import Measured
from pdserve.sim.profile import StepModel
from pdserve.sim.validate_options import ValidateOptions
from pdserve.sim.validate_points import Point, written_lines

TOLERANCE = {"p50": 0.10, "p90": 0.15}  # the goal: relative error of sim vs real


def table(rows: list[dict[str, Any]], key: str = "compare", run: int | None = None) -> str:
    """Markdown: per point, each figure real / simulated (or, with ``run``, the first
    measured run / the later run ``run`` of ``row[key]``), the error, * outside the
    tolerance; then how many figures are within it."""
    label = "real / sim" if run is None else "run 1 / run " + str(run + 2)
    lines = [
        "| point | " + " | ".join(f"{k} {label} ms (error)" for k in KEYS) + " |",
        "| --- |" + " ---: |" * len(KEYS),
    ]
    within = 0
    for row in rows:
        cells = []
        compared = row[key] if run is None else row[key][run]
        within += sum(compared[k]["ok"] for k in KEYS)
        for k in KEYS:
            c = compared[k]
            err = "n/a" if c["error"] is None else f"{c['error']:+.1%}"
            real = "n/a" if c["real"] is None else f"{c['real']:.1f}"
            sim = "n/a" if c["sim"] is None else f"{c['sim']:.1f}"
            cells.append(f"{real} / {sim} ({err}){'' if c['ok'] else ' *'}")
        lines.append(f"| {row['point']} | " + " | ".join(cells) + " |")
    lines.append(f"{within} of {len(rows) * len(KEYS)} figures within the tolerance")
    return "\n".join(lines)


def repeat_table(rows: list[dict[str, Any]]) -> str:
    """Each later measured run of every point against its first run (with ``--repeat``)."""
    repeats = len(rows[0].get("compare_runs", [])) if rows else 0
    parts = [
        "\nThe real system against itself: each later run of a point against its first "
        "(the simulation above is compared with the runs' mean figures)"
    ]
    parts += [table(rows, "compare_runs", run) for run in range(repeats)]
    return "\n".join(parts)


def _fit_text(f: dict[str, Any], offset_ms: float, steps: int) -> str:
    """One fit of the step model: ``f`` holds its scales, cold and shared factors and noise."""
    return (
        f"compute x{f['compute_scale']:.4g}, the rest x{f['memory_scale']:.4g}, "
        f"+ {offset_ms:.3g} ms; after idling, compute x{1 + f['cold_compute']:.2f} and the "
        f"rest x{1 + f['cold_factor']:.2f}; beside another instance's step, "
        f"x{1 + f['shared_compute']:.2f} and x{1 + f['shared_factor']:.2f}; noise sd "
        f"{f['jitter']:.3f} in log over {f['jitter_s'] * 1e3:.0f} ms (from {steps} traced steps)"
    )


def kinds_text(kinds: dict[str, dict[str, dict[str, float]]]) -> str:
    """Per instance, each kind of step's live time over the model's and how many
    (:meth:`~pdserve.sim.live.Measured.kinds`)."""
    return "; ".join(
        f"{name} " + ", ".join(f"{kind} {k['ratio']}x of {k['steps']}" for kind, k in seen.items())
        for name, seen in kinds.items()
    )


def failed_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per point where either side had failed requests (timeouts, refusals): how many,
    each measured run's and the simulation's, and the simulation's reasons."""
    lines = []
    for row in rows:
        failed = row["failed"]
        if failed["sim"] or any(failed["real"]):
            real = ", ".join(str(n) for n in failed["real"])
            why = "; ".join(f"{n} {e}" for e, n in row["sim"].get("errors", {}).items())
            lines.append(
                f"{row['point']}: failed requests, real {real} / sim {failed['sim']}"
                + (f" ({why})" if why else "")
            )
    return lines


def calibration_lines(rows: list[dict[str, Any]], calibrations: dict[str, Any]) -> list[str]:
    lines = [line for row in rows for line in _live_step_lines(row)]
    for setup, c in calibrations.items():
        lines.append(
            f"{setup}: the calibration runs' steps / calibrated step model by kind "
            f"(totals): {kinds_text(c['steps_by_kind'])}"
        )
        lines.append(_calibrated_line(setup, c))
    return lines


def _live_step_lines(row: dict[str, Any]) -> list[str]:
    """A point's live steps over the calibrated model: by instance, by kind, and the share
    of each run's steps in slow windows."""
    ratios = ", ".join(f"{name} {r['median_ratio']}x" for name, r in row["live_steps"].items())
    kinds = {name: r["kinds"] for name, r in row["live_steps"].items()}
    slow = "; ".join(
        f"run {i + 1} " + ", ".join(f"{name} {r['slow_share']:.0%}" for name, r in run.items())
        for i, run in enumerate(row.get("live_steps_runs", []))
    )
    return [
        f"{row['point']}: live steps / calibrated step model (median): {ratios}",
        f"{row['point']}: the same by kind of step (totals): {kinds_text(kinds)}",
        f"{row['point']}: steps in slow windows (20 s whose median step over "
        f"its model is 1.3x the run's): {slow}",
    ]


def _calibrated_line(setup: str, c: dict[str, Any]) -> str:
    """A setup's calibration: each role's fit (or the one of all steps) and the overheads."""
    fits = {
        role: _fit_text(f, f["offset_s"] * 1e3, f["steps"])
        for role, f in c.get("role_fits", {}).items()
    }
    if not fits:
        fits = {"steps'": _fit_text(c, c["step_offset_ms"], c["traced_steps"])}
    return (
        f"{setup}: "
        + "; ".join(f"{who} {text}" for who, text in fits.items())
        + f", then +{c['step_overhead_ms']} ms a step, "
        f"+{c['seq_overhead_ms']} ms a sequence of a step, +{c['handoff_overhead_ms']} ms "
        f"a hand-off, +{c['request_overhead_ms']} ms a request (calibrated on single "
        "requests of 32 and 4 tokens, bursts of 8, 4 req/s and single 1,024-token prompts"
        + (
            ", 1,024-token prompts at 2 req/s and single 64-token ones"
            if setup == "colocated"
            else ", 1,024-token prompts of 128 output tokens at 0.75 req/s"
        )
        + (", before and after the points)" if c.get("around") else ")")
    )


def compare_point(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Per metric and percentile: real ms, simulated ms, relative error, within tolerance."""
    out: dict[str, Any] = {}
    for (metric, q), key in zip(FIGURES, KEYS, strict=True):
        r, s = figure(real, metric, q), figure(sim, metric, q)
        err = None if not r or s is None else (s - r) / r
        out[key] = {
            "real": r,
            "sim": s,
            "error": None if err is None else round(err, 4),
            "ok": err is not None and abs(err) <= TOLERANCE[q],
        }
    return out


def mean_abs_error(compares: list[dict[str, Any]]) -> float | None:
    """The mean |error| over every figure of ``compares`` (:func:`compare_point` results)."""
    errors = [abs(c["error"]) for cmp in compares for c in cmp.values() if c["error"] is not None]
    return round(sum(errors) / len(errors), 4) if errors else None


def point_row(
    name: str,
    sim: dict[str, Any],
    repeats: list[Measured],
    live_model: StepModel,
    role_models: dict[str, StepModel] | None = None,
) -> dict[str, Any]:
    """A point's row: the simulation against the measured run (against the mean of
    the runs' figures when it ran more than once), each instance's steps against the
    calibrated step model (its role's, in ``role_models``, else ``live_model``), and
    each later run against the first (how far the real system is from itself)."""
    first = repeats[0].summary
    real = mean_figures([m.summary for m in repeats]) if len(repeats) > 1 else first
    runs_steps = [m.ratios(role_models or {}, live_model) for m in repeats]
    row: dict[str, Any] = {
        "point": name,
        "real": first,
        "sim": sim,
        "compare": compare_point(real, sim),
        "live_steps": runs_steps[0],
        "live_steps_runs": runs_steps,
        "failed": {"real": [m.summary["num_failed"] for m in repeats], "sim": sim["num_failed"]},
    }
    if len(repeats) > 1:
        row.update(
            real_mean=real,
            real_runs=[m.summary for m in repeats[1:]],
            compare_runs=[compare_point(first, m.summary) for m in repeats[1:]],
        )
    return row


def host_check_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``--host-check``'s table and each point's factors, run by run."""
    lines = [table(rows, "compare_host_checked")]
    for row in rows:
        factors = "; ".join(
            ", ".join(f"{r} x{f:.3f}" for r, f in run.items()) for run in row["host_factors"]
        )
        lines.append(f"{row['point']}: host checks against the calibration, run by run: {factors}")
    return lines


def write_results(
    args: ValidateOptions,
    rows: list[dict[str, Any]],
    calibrations: dict[str, Any],
    measured: dict[str, Any],
) -> tuple[Path, dict[str, Any]]:
    """The validation's JSON (and, with --keep-traces, the runs' traces): its path and
    what it holds."""
    from pdserve.bench.report import header, write_json
    from pdserve.bench.serve import command_line

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


def print_results(
    args: ValidateOptions,
    points: list[Point],
    rows: list[dict[str, Any]],
    calibrations: dict[str, Any],
    payload: dict[str, Any],
) -> None:
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
