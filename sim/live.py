"""A profile against the steps a live instance ran (its engine's ``step_trace``).

``pdserve profile`` times each step shape alone, back to back, in a quiet
process. A serving instance runs the same shapes slower, and not by one factor
(2-core VM of ``docs/results/simulator.md``, builtin:small float32, ranks pinned):

- by kind: a colocated instance on two threads ran decode steps at 2.0-2.6x
  their profile and back-to-back prefill chunks at 1.1-1.4x; a one-core decode
  instance ran its steps at 1.2-1.4x;
- after idling: the first step after 50 ms or more without one ran 1.6-2.1x
  (colocated prefill) and 1.5-2.3x (one-core decode), against 1.1-1.4x warm;
- beside the other engine: a one-core decode step that a prefill step covered
  ran 1.4-1.9x, against 1.2-1.4x alone (the router, the load generator and Ray
  run on the same two cores).

:func:`live_fit` fits ``live = c * compute + m * rest + offset`` over traced
steps (the profile's compute terms, per new token and per query-key pair, and
the rest of its time), each step's error relative to its own time, every term
non-negative, with a cold pair and a shared pair of factors on those parts for
steps after idling and steps beside another instance's
(:meth:`~pdserve.sim.profile.StepModel.live_time`), then the steps' noise about
that (:func:`~pdserve.sim.jitter.fit_jitter`). :func:`scaled` applies the
fit to a :class:`~pdserve.sim.profile.StepModel`. :func:`step_ratios` says how
far a run's steps were from a model, per instance, after the fact, by kind of
step (:func:`step_kinds`), and how many ran in episodes of a slower host
(:func:`slow_share`).
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
from pdserve.sim.jitter import fit_jitter
from pdserve.sim.profile import MAX_FACTOR, StepFeatures, StepModel

TRACE_STEPS = 200_000  # steps an instance keeps between two reads
SLOW_WINDOW_S = 20.0  # slow_share: the windows a run's steps are grouped in
SLOW_FACTOR = 1.3  # slow_share: a window whose median is this much over the run's is slow
FIT_ROUNDS = 4  # live_fit: the cold part is fitted against the warm time of the round before


@dataclass(frozen=True)
class LiveFit:
    """``live step = compute * compute_scale + memory * memory_scale + offset_s`` over
    ``steps`` traced steps (the profile's compute terms, and the rest of its time),
    plus ``cold_compute`` and ``cold_factor`` times those parts for a step after the
    instance sat idle, and ``shared_compute`` and ``shared_factor`` times them for a
    step that another instance's step covered by more than half."""

    compute_scale: float = 1.0
    memory_scale: float = 1.0
    offset_s: float = 0.0
    cold_compute: float = 0.0  # a step after the instance idled: its compute this much
    cold_factor: float = 0.0  # longer, and the rest of its time this much
    shared_compute: float = 0.0  # the same, for a step beside another instance's step
    shared_factor: float = 0.0
    steps: int = 0
    jitter: float = 0.0  # the steps' spread about the fitted model, and its
    jitter_s: float = 0.0  # correlation time (sim.jitter.fit_jitter)


# The fit's fields a step model takes as they are (its cold and shared factors, its noise).
_TAKEN_AS_FITTED = (
    "cold_compute",
    "cold_factor",
    "shared_compute",
    "shared_factor",
    "jitter",
    "jitter_s",
)


def _features(records: Sequence[StepRecord]) -> list[StepFeatures]:
    return [StepFeatures.of(list(zip(r.new_tokens, r.cached_tokens, strict=True))) for r in records]


def predicted(step: StepModel, records: Sequence[StepRecord]) -> np.ndarray:
    """The model's time of each traced step's shape."""
    return np.array([step.time(f) for f in _features(records)])


def loop_periods(trace: Sequence[StepRecord], busy_gap_s: float = 0.05) -> list[StepRecord]:
    """One instance's steps (in order), each lengthened by the engine loop's work
    after it: the gap to the next step where the loop went straight on (under
    ``busy_gap_s``), else the instance's median such gap. A simulated step is a
    whole loop turn, and that work slows with the step itself (beside another
    engine, the gaps on the 2-core VM grew from 0.6-0.8 ms to 1.7-2.8 ms)."""
    if not trace:
        return []
    starts = np.array([r.start_s for r in trace])
    gaps = starts[1:] - (starts[:-1] + np.array([r.seconds for r in trace[:-1]]))
    busy = (gaps >= 0) & (gaps <= busy_gap_s)
    typical = float(np.median(gaps[busy])) if busy.any() else 0.0
    after = [*np.where(busy, gaps, typical), typical]
    return [
        dataclasses.replace(r, seconds=r.seconds + float(g))
        for r, g in zip(trace, after, strict=True)
    ]


def cold_flags(step: StepModel, trace: Sequence[StepRecord]) -> np.ndarray:
    """Per step of one instance's trace (in order): whether it started after the
    instance sat idle longer than ``step.cold_after_s`` (the first one: yes)."""
    starts = np.array([r.start_s for r in trace])
    ends = starts + np.array([r.seconds for r in trace])
    idle = np.concatenate([[np.inf], starts[1:] - ends[:-1]]) if len(trace) else starts
    return np.asarray(idle > step.cold_after_s)


def shared_flags(trace: Sequence[StepRecord], others: Sequence[Sequence[StepRecord]]) -> np.ndarray:
    """Per step of ``trace``: whether other instances' steps (``others``, each in
    order, on the same clock) covered more than half of it."""
    spans = sorted((r.start_s, r.start_s + r.seconds) for t in others for r in t)
    merged: list[list[float]] = []
    for a, b in spans:  # the union of the others' steps
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return np.zeros(len(trace), dtype=bool)
    lo, hi = np.array(merged).T
    covered = np.concatenate([[0.0], np.cumsum(hi - lo)])  # covered up to each span's end

    def upto(t: float) -> float:  # covered time before t
        i = int(np.searchsorted(lo, t, side="right"))
        return float(covered[i - 1] + min(t, hi[i - 1]) - lo[i - 1]) if i else 0.0

    return np.array(
        [upto(r.start_s + r.seconds) - upto(r.start_s) > r.seconds / 2 for r in trace], dtype=bool
    )


def _cold_and_shared(
    step: StepModel, kept: list[list[StepRecord]], others: Sequence[Sequence[StepRecord]]
) -> tuple[np.ndarray, np.ndarray]:
    """1.0 for each step of ``kept`` that was cold (:func:`cold_flags`), and for each that
    shared the host with other instances' steps (:func:`shared_flags`), else 0.0."""
    cold = np.concatenate([cold_flags(step, t) for t in kept]).astype(float)
    beside = [loop_periods(t) for t in others if t]
    shared = np.concatenate(
        [shared_flags(t, kept[:i] + kept[i + 1 :] + beside) for i, t in enumerate(kept)]
    ).astype(float)
    return cold, shared


def live_fit(
    step: StepModel,
    traces: Sequence[Sequence[StepRecord]],
    others: Sequence[Sequence[StepRecord]] = (),
) -> LiveFit:
    """The scales, offset, cold and shared factors that bring ``step`` to the traced
    steps' loop turns (:func:`loop_periods`; ``traces``: each instance's steps in
    order, every trace on one clock, so that steps of different instances that
    overlapped are seen to; ``others``: more instances' steps on that clock, which
    count only as neighbours), each step's
    error relative to its own time, so short decode steps weigh as much as long
    prefills. Steps of one kind only, or not growing with their shape: one scale for
    both parts (:func:`_mean_ratio` for the latter). Without steps: no change."""
    kept = [loop_periods(t) for t in traces if t]
    records = [r for trace in kept for r in trace]
    if not records:
        return LiveFit()
    features = _features(records)
    model = np.array([step.time(f) for f in features])
    compute = np.array([step.compute_time(f) for f in features])
    cold, shared = _cold_and_shared(step, kept, others)
    live = np.array([r.seconds for r in records])
    w, n = 1.0 / live, len(records)
    rest = model - compute
    warm_c, warm_r = compute, rest  # the warm parts: refined as the fit converges
    for _ in range(FIT_ROUNDS):
        columns = [
            compute,
            rest,
            np.ones(n),
            cold * warm_c,
            cold * warm_r,
            shared * warm_c,
            shared * warm_r,
        ]
        c, m, offset, kc, kr, sc, sr = nonnegative_lstsq(
            np.column_stack([x * w for x in columns]), live * w, [None] * 3 + [MAX_FACTOR] * 4
        )
        if not (c > 0 and m > 0):  # one kind of step: one scale, one factor of each
            both = warm_c + warm_r
            c, offset, kr, sr = nonnegative_lstsq(
                np.column_stack([model * w, w, cold * both * w, shared * both * w]),
                live * w,
                [None, None, MAX_FACTOR, MAX_FACTOR],
            )
            m, kc, sc = c, kr, sr
        if c <= 0:  # steps unrelated to their shape: one scale and the noise about it
            return _with_noise(_mean_ratio(model, w, n), step, kept, cold, shared)
        warm_c, warm_r = c * compute, m * rest + offset
    return _with_noise(LiveFit(c, m, offset, kc, kr, sc, sr, n), step, kept, cold, shared)


def _mean_ratio(model: np.ndarray, w: np.ndarray, n: int) -> LiveFit:
    """One scale for both parts, no offset: the traced steps' times over the model's
    (least squares of the relative errors). A scale, not an offset, so that a batch
    larger than the traced ones still costs more."""
    r = model * w
    k = float(r.sum() / (r * r).sum())
    return LiveFit(k, k, steps=n)


def _with_noise(
    fit: LiveFit,
    step: StepModel,
    kept: list[list[StepRecord]],
    cold: np.ndarray,
    shared: np.ndarray,
) -> LiveFit:
    """``fit`` with the noise of the loop turns ``kept`` (each instance's, with their
    ``cold`` and ``shared`` flags, concatenated) about the model it makes of ``step``."""
    fitted = scaled(step, fit)
    records = [r for trace in kept for r in trace]
    times = np.array(
        [
            fitted.live_time(f, bool(k), bool(s))
            for f, k, s in zip(_features(records), cold, shared, strict=True)
        ]
    )
    live = np.array([r.seconds for r in records])
    ends = np.cumsum([len(t) for t in kept])[:-1]
    starts = [np.array([r.start_s for r in t]) for t in kept]
    sigma, corr_s = fit_jitter(starts, np.split(live / times, ends))
    return dataclasses.replace(fit, jitter=sigma, jitter_s=corr_s)


def scaled(step: StepModel, fit: LiveFit) -> StepModel:
    """``step`` with its compute terms times ``fit.compute_scale``, the rest times
    ``fit.memory_scale``, ``fit.offset_s`` added per step, its cold and shared
    factors, and its noise."""
    c, m = fit.compute_scale, fit.memory_scale
    if step.combine != "sum":  # a roofline has one time: the memory scale stands for both
        c = m
    return dataclasses.replace(
        step,
        overhead_s=step.overhead_s * m + fit.offset_s,
        s_per_token=step.s_per_token * c,
        s_per_attn=step.s_per_attn * c,
        weights_s=step.weights_s * m,
        s_per_ctx=step.s_per_ctx * m,
        s_per_seq=step.s_per_seq * m,
        **{name: getattr(fit, name) for name in _TAKEN_AS_FITTED},
    )


def step_ratios(
    step: StepModel,
    traces: dict[str, list[StepRecord]],
    others: Sequence[Sequence[StepRecord]] = (),
) -> dict[str, Any]:
    """Per instance: its steps, the median and total of its loop turns
    (:func:`loop_periods`) over ``step``'s time, the share of them in slow
    windows (:func:`slow_share`), and the total by kind of step
    (:func:`step_kinds`; ``others``: the other instances' steps of the run)."""
    out: dict[str, Any] = {}
    for name, trace in traces.items():
        if not trace:
            continue
        records = loop_periods(trace)
        model, live = predicted(step, records), np.array([r.seconds for r in records])
        starts = np.array([r.start_s for r in records])
        out[name] = {
            "steps": len(records),
            "median_ratio": round(float(np.median(live / model)), 3),
            "total_ratio": round(float(live.sum() / model.sum()), 3),
            "slow_share": round(slow_share(live / model, starts), 3),
            "kinds": kind_ratios(step_kinds(step, trace, others)),
        }
    return out


STEP_KINDS = ("decode", "chunks", "chunks with decode", "after idling")


def step_kinds(
    step: StepModel, trace: Sequence[StepRecord], others: Sequence[Sequence[StepRecord]] = ()
) -> dict[str, list[float]]:
    """One instance's loop turns by kind (``STEP_KINDS``: every row one token, no such
    row, both, or after the instance idled), each kind's ``[live s, model s, steps]``,
    the model's time with its cold and shared factors (:meth:`StepModel.live_time`;
    ``others``: the instances beside it), so a kind's ratio says how far the
    calibrated model was from those steps, and the totals of runs add up."""
    records = loop_periods(trace)
    cold = cold_flags(step, records)
    shared = shared_flags(records, [loop_periods(t) for t in others if t])
    out: dict[str, list[float]] = {}
    for r, f, c, s in zip(records, _features(records), cold, shared, strict=True):
        decode = sum(n == 1 for n in r.new_tokens)
        if c:
            kind = "after idling"
        elif decode == len(r.new_tokens):
            kind = "decode"
        else:
            kind = "chunks with decode" if decode else "chunks"
        totals = out.setdefault(kind, [0.0, 0.0, 0])
        totals[0] += r.seconds
        totals[1] += step.live_time(f, bool(c), bool(s))
        totals[2] += 1
    return out


def kind_ratios(totals: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """:func:`step_kinds` totals as each kind's live time over its model's, and steps."""
    out: dict[str, dict[str, float]] = {}
    for kind in STEP_KINDS:
        live, model, n = totals.get(kind, (0.0, 0.0, 0))
        if model > 0:
            out[kind] = {"ratio": round(float(live / model), 3), "steps": int(n)}
    return out


def slow_share(ratios: np.ndarray, starts: np.ndarray) -> float:
    """The share of one instance's steps (``ratios``: each one's live time over its
    model's; ``starts``: when each began) that ran in windows of ``SLOW_WINDOW_S``
    whose median ratio was over ``SLOW_FACTOR`` times the whole run's: the episodes
    of a slower host that no model of the cluster predicts (on the 2-vCPU VM, 10-40 s
    of decode steps at 1.4-2.4x the run's median, with the same work, docs/results/simulator.md)."""
    if not len(ratios):
        return 0.0
    window = ((starts - starts.min()) // SLOW_WINDOW_S).astype(int)
    overall, slow = float(np.median(ratios)), 0
    for w in np.unique(window):
        mask = window == w
        if np.median(ratios[mask]) > SLOW_FACTOR * overall:
            slow += int(mask.sum())
    return slow / len(ratios)


def take_steps(leaders: list[tuple[str, Any]], keep: int, out: dict[str, list[StepRecord]]) -> None:
    """Add each instance leader's (``(name, actor)``) steps since the last call to
    ``out``, then record its next ``keep`` (0 stops). A leader gone (an instance the
    planner removed) adds none."""
    import ray
    from ray.exceptions import RayActorError

    for name, leader in leaders:
        try:
            out.setdefault(name, []).extend(ray.get(leader.step_trace.remote(keep)))
        except RayActorError:
            out.setdefault(name, [])


@contextmanager
def traced(leaders: list[tuple[str, Any]]) -> Iterator[dict[str, list[StepRecord]]]:
    """Record the steps of every instance leader (``(name, actor)``) inside the block;
    the dict fills with each one's steps when the block ends (:func:`take_steps`)."""
    out: dict[str, list[StepRecord]] = {}
    take_steps(leaders, TRACE_STEPS, {})
    try:
        yield out
    finally:
        take_steps(leaders, 0, out)


@dataclass(frozen=True)
class Measured:
    """One measured run: what the load generator saw, and each instance's steps."""

    summary: dict[str, Any]
    steps: dict[str, list[StepRecord]]

    @staticmethod
    def role_traces(runs: list[Measured]) -> dict[str, list[list[StepRecord]]]:
        """Every instance's steps of every run, by role."""
        out: dict[str, list[list[StepRecord]]] = {}
        for m in runs:
            for role, traces in m.by_role().items():
                out.setdefault(role, []).extend(traces)
        return out

    @staticmethod
    def role_of(instance: str) -> str:
        """An instance's role (instances are named ``{role}{index}``)."""
        return instance.rstrip("0123456789")

    def by_role(self) -> dict[str, list[list[StepRecord]]]:
        """The traces of every instance of a role."""
        out: dict[str, list[list[StepRecord]]] = {}
        for name, records in self.steps.items():
            out.setdefault(self.role_of(name), []).append(records)
        return out

    def ratios(self, models: dict[str, StepModel], default: StepModel) -> dict[str, Any]:
        """:func:`step_ratios` of each instance's steps against its role's model in
        ``models`` (else ``default``)."""
        out: dict[str, Any] = {}
        for name, trace in self.steps.items():
            model = models.get(self.role_of(name), default)
            out.update(step_ratios(model, {name: trace}, self.beside(name)))
        return out

    def beside(self, name: str) -> list[list[StepRecord]]:
        """The steps of every instance of the run but ``name``."""
        return [t for other, t in self.steps.items() if other != name]

    @staticmethod
    def kinds(
        runs: list[Measured], models: dict[str, StepModel], default: StepModel
    ) -> dict[str, dict[str, dict[str, float]]]:
        """Per instance: its steps over all ``runs`` by kind against its role's model
        (:func:`step_kinds`, :func:`kind_ratios`)."""
        totals: dict[str, dict[str, list[float]]] = {}
        for m in runs:
            for name, trace in m.steps.items():
                seen = step_kinds(models.get(m.role_of(name), default), trace, m.beside(name))
                mine = totals.setdefault(name, {})
                for kind, values in seen.items():
                    before = mine.get(kind, [0.0, 0.0, 0])
                    mine[kind] = [a + b for a, b in zip(before, values, strict=True)]
        return {name: kind_ratios(t) for name, t in totals.items()}

    def to_json(self) -> dict[str, Any]:
        """The run as JSON: its summary, and per instance one
        ``[start_s, seconds, new_tokens, cached_tokens]`` row a step."""
        steps = {
            name: [
                [r.start_s, r.seconds, list(r.new_tokens), list(r.cached_tokens)] for r in records
            ]
            for name, records in self.steps.items()
        }
        return {"summary": self.summary, "steps": steps}

    @staticmethod
    def from_json(raw: dict[str, Any]) -> Measured:
        """The inverse of :meth:`to_json`."""
        steps = {
            name: [StepRecord(float(s), float(t), tuple(n), tuple(c)) for s, t, n, c in rows]
            for name, rows in raw["steps"].items()
        }
        return Measured(raw["summary"], steps)
