"""A profile against the steps a live instance ran (its engine's ``step_trace``).

``pdserve profile`` times each step shape alone, back to back, in a quiet
process. A serving instance runs the same shapes slower: its process also runs
Ray's threads (its step's tokens go out, pages and requests come in), and the
router, the front door and the clients share the host's cores. On the 2-core VM
of ``bench/RESULTS.md`` a live decode step took 1.2-1.4x and a prefill step
1.1-1.2x what the profile predicts for its shape, with one request at a time.

:func:`live_fit` fits ``live = scale * profile + offset`` over traced steps
(relative least squares, both terms non-negative); :func:`scaled` applies it
to a :class:`~pdserve.sim.profile.StepModel`. :func:`step_ratios` says how far
a run's steps were from a model, per instance, after the fact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.core.messages import StepRecord
from pdserve.sim.fit import nonnegative_lstsq
from pdserve.sim.profile import StepFeatures, StepModel

TRACE_STEPS = 200_000  # steps an instance keeps between two reads


@dataclass(frozen=True)
class LiveFit:
    """``live step = scale * profile + offset_s`` over ``steps`` traced steps."""

    scale: float = 1.0
    offset_s: float = 0.0
    steps: int = 0


def predicted(step: StepModel, records: Sequence[StepRecord]) -> np.ndarray:
    """The model's time of each traced step's shape."""
    return np.array([
        step.time(StepFeatures.of(list(zip(r.new_tokens, r.cached_tokens, strict=True))))
        for r in records
    ])  # fmt: skip


def live_fit(step: StepModel, records: Sequence[StepRecord]) -> LiveFit:
    """The scale and offset that bring ``step`` to the traced steps (each step's
    error relative to its own time, so short decode steps weigh as much as long
    prefills). Without steps: no change."""
    if not records:
        return LiveFit()
    model = predicted(step, records)
    live = np.array([r.seconds for r in records])
    weight = 1.0 / live
    design = np.column_stack([model * weight, weight])
    scale, offset = nonnegative_lstsq(design, live * weight)
    if scale <= 0:  # steps unrelated to their shape: keep the profile's proportions
        return LiveFit(1.0, float(np.median(live - model)), len(records))
    return LiveFit(scale, offset, len(records))


def scaled(step: StepModel, fit: LiveFit) -> StepModel:
    """``step`` with every term times ``fit.scale`` and ``fit.offset_s`` added per step."""
    k = fit.scale
    return dataclasses.replace(
        step, overhead_s=step.overhead_s * k + fit.offset_s, s_per_token=step.s_per_token * k,
        s_per_attn=step.s_per_attn * k, weights_s=step.weights_s * k,
        s_per_ctx=step.s_per_ctx * k, s_per_seq=step.s_per_seq * k,
    )  # fmt: skip


def step_ratios(step: StepModel, traces: dict[str, list[StepRecord]]) -> dict[str, Any]:
    """Per instance: its steps, and the median and total of live over ``step``'s time."""
    out: dict[str, Any] = {}
    for name, records in traces.items():
        if not records:
            continue
        model, live = predicted(step, records), np.array([r.seconds for r in records])
        out[name] = {"steps": len(records),
                     "median_ratio": round(float(np.median(live / model)), 3),
                     "total_ratio": round(float(live.sum() / model.sum()), 3)}  # fmt: skip
    return out


@contextmanager
def traced(leaders: list[tuple[str, Any]]) -> Iterator[dict[str, list[StepRecord]]]:
    """Record the steps of every instance leader (``(name, actor)``) inside the block;
    the dict fills with each one's steps when the block ends."""
    import ray

    out: dict[str, list[StepRecord]] = {}
    ray.get([leader.step_trace.remote(TRACE_STEPS) for _, leader in leaders])
    try:
        yield out
    finally:
        taken = ray.get([leader.step_trace.remote(0) for _, leader in leaders])
        for (name, _), records in zip(leaders, taken, strict=True):
            out.setdefault(name, []).extend(records)
