"""What ``pdserve sim-validate``'s calibration found, as its results record it, the
calibrated profile it writes with ``--write-profiles``, and the overheads the points
are simulated with."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from pdserve.sim.calibrate import Overhead, calibrated_profile
from pdserve.sim.live import Measured, scaled
from pdserve.sim.validate_options import ValidateOptions


def with_noise(overhead: Overhead, args: ValidateOptions) -> Overhead:
    """``overhead`` as the points are simulated: with its fitted noise under
    ``--noise-draws``, else without (:meth:`Overhead.quiet`)."""
    return overhead if args.noise_draws else overhead.quiet()


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
