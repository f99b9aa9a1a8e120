"""Fitting a :class:`~pdserve.sim.profile.StepModel` to measured steps.

The ``sum`` form of the step model is linear in its coefficients, so a least
squares fit on the samples' features finds them. Rows are weighted by
``1 / seconds`` (relative error: a 2 ms decode step matters as much as a
200 ms prefill), and coefficients that come out negative are dropped and the
rest refitted (a small active-set non-negative least squares), so every term
stays physical. ``weights_s`` is folded into ``overhead_s`` (both constant).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.profile import Sample, StepModel

TERMS = ("overhead_s", "s_per_token", "s_per_attn", "s_per_ctx", "s_per_seq")


def _design(samples: Sequence[Sample]) -> np.ndarray:
    # columns in TERMS order; [n_samples, 5]
    return np.array(
        [
            [1.0, s.features.new_tokens, s.features.attn, s.features.context, s.features.seqs]
            for s in samples
        ]
    )


def fit_step_model(samples: Sequence[Sample]) -> StepModel:
    """Non-negative, relative-error least squares fit of the ``sum`` step model."""
    if len(samples) < len(TERMS):
        raise InvalidArgumentError(
            "samples", f"need at least {len(TERMS)} measured steps to fit, got {len(samples)}"
        )
    x = _design(samples)
    y = np.array([s.seconds for s in samples])
    if not (y > 0).all():
        raise InvalidArgumentError("samples", "every measured step time must be > 0")
    w = 1.0 / y
    active = list(range(len(TERMS)))
    coef = np.zeros(len(TERMS))
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    terms: dict[str, Any] = {name: float(c) for name, c in zip(TERMS, coef, strict=True)}
    return StepModel(**terms)


def fit_robust(
    samples: Sequence[Sample], outlier_rel: float = 0.5
) -> tuple[StepModel, list[Sample]]:
    """Fit, drop samples the fit misses by more than ``outlier_rel`` (a step that a
    neighbouring process slowed), refit; returns (model, dropped samples)."""
    model = fit_step_model(samples)
    keep = [
        s for s in samples if abs(model.time(s.features) - s.seconds) <= outlier_rel * s.seconds
    ]
    if len(keep) == len(samples) or len(keep) < len(TERMS):
        return model, []
    dropped = [s for s in samples if s not in keep]
    return fit_step_model(keep), dropped


def fit_error(model: StepModel, samples: Sequence[Sample]) -> dict[str, float]:
    """Relative errors |predicted - measured| / measured: mean and max, overall and per phase."""
    out: dict[str, float] = {}
    groups = {"all": list(samples)}
    for s in samples:
        groups.setdefault(s.phase, []).append(s)
    for name, group in groups.items():
        if not group:
            continue
        err = np.array([abs(model.time(s.features) - s.seconds) / s.seconds for s in group])
        out[f"{name}_mean_rel"] = round(float(err.mean()), 4)
        out[f"{name}_max_rel"] = round(float(err.max()), 4)
    return out


def nonnegative_lstsq(
    a: np.ndarray, b: np.ndarray, upper: Sequence[float | None] | None = None
) -> list[float]:
    """``x >= 0`` minimising ``|a x - b|``, for a few columns: the best least-squares
    answer over the subsets of columns whose answer is non-negative (columns without
    effect, all zero, stay 0). With ``upper`` (a bound or None per column), a
    coefficient that comes out above its bound is held at it and the others refitted,
    the largest excess first: a factor fitted on a few rows can run off to any size,
    and a model must stay within what it checks."""
    n = a.shape[1]
    bounds = list(upper) if upper is not None else [None] * n
    held: dict[int, float] = {}
    while True:
        free = [j for j in range(n) if j not in held]
        rest = b - sum((a[:, j] * v for j, v in held.items()), np.zeros_like(b))
        x = _nonnegative_subsets(a[:, free], rest)
        full = [0.0] * n
        for j, v in held.items():
            full[j] = v
        for j, v in zip(free, x, strict=True):
            full[j] = v
        over = [
            (v / bound, j)
            for j, v in zip(free, x, strict=True)
            if (bound := bounds[j]) is not None and v > bound
        ]
        if not over:
            return full
        j = max(over)[1]
        held[j] = float(bounds[j] or 0.0)


def _nonnegative_subsets(a: np.ndarray, b: np.ndarray) -> list[float]:
    n = a.shape[1]
    live = [j for j in range(n) if np.abs(a[:, j]).max() > 1e-9]
    best: tuple[float, list[float]] = (float(np.sum(b**2)), [0.0] * n)
    for mask in range(1, 1 << len(live)):
        cols = [j for i, j in enumerate(live) if mask >> i & 1]
        x = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (x < 0).any():
            continue
        residual = float(np.sum((a[:, cols] @ x - b) ** 2))
        if residual < best[0] - 1e-15:
            full = [0.0] * n
            for j, v in zip(cols, x, strict=True):
                full[j] = float(v)
            best = (residual, full)
    return best[1]
