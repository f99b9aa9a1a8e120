"""``pdserve sim-validate``'s points simulated and compared with their measured runs:
with the calibration, with the steps each point's first run ran, and with
``--host-check`` with the steps scaled by the host's drift."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.sim.calibrate import (
    Overhead,
    Runs,
    host_factors,
    own_steps,
    rescaled,
    simulate,
    simulate_each,
)
from pdserve.sim.live import Measured, scaled
from pdserve.sim.validate_fit import with_noise
from pdserve.sim.validate_options import ValidateOptions
from pdserve.sim.validate_points import Point
from pdserve.sim.validate_report import compare_point, point_row

if TYPE_CHECKING:
    from pdserve.bench.serve import RunFlags


def per_point(measured: list[Measured], points: int) -> list[list[Measured]]:
    """Runs of ``points`` points measured in rounds (each in turn), grouped by point."""
    return [measured[i::points] for i in range(points)]


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
