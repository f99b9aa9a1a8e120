"""The calibration of ``pdserve sim-validate``: what the live system spends beyond
the profiled steps, fitted so that simulated calibration runs match measured ones.

The runs (:func:`calibration_args`) are ``pdserve bench serve`` workloads that
each show one thing: one request at a time, bursts of 8, very short outputs
(the hand-off's share of TPOT), a steady stream (a prefill beside the decode
steps of the requests before it), long prompts one at a time (long
prefills, decode steps over long contexts), and, for a colocated instance,
long prompts in a steady stream (their chunks beside the decode steps of the
one before) and short ones one at a time. :func:`calibrate` fits the step model to the
engines' own traced steps during them (:func:`~pdserve.sim.live.live_fit`),
then the overheads outside the steps (:class:`Overhead`).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.core.messages import StepRecord
from pdserve.sim.figures import mean_figures
from pdserve.sim.fit import nonnegative_lstsq
from pdserve.sim.live import LiveFit, Measured, live_fit, scaled
from pdserve.sim.profile import Profile, StepModel
from pdserve.sim.validate_options import ValidateOptions

if TYPE_CHECKING:
    from pdserve.bench.serve import RunFlags

CALIBRATION_RATE = 0.5  # req/s, fixed gaps: each request alone
Runs = list[tuple["RunFlags", float]]  # each run's workload flags and rate


def bench_flags(workload: list[str], args: ValidateOptions) -> RunFlags:
    """``pdserve bench serve``'s workload and load flags, parsed as that command parses
    them (the prompts' seed drawn, once for every run of them)."""
    from pdserve.bench.serve import RunFlags, add_load_flags, add_workload_flags, with_prompt_seed
    from pdserve.core.options import options_from

    p = argparse.ArgumentParser()
    add_workload_flags(p)
    add_load_flags(p)
    flags = [
        *workload,
        "--num-requests",
        str(args.num_requests),
        "--seed",
        str(args.seed),
        "--no-progress",
        "--warmup",
        "2",
        "--ttft-slo-ms",
        "100000",
        "--tpot-slo-ms",
        "100000",
    ]
    return with_prompt_seed(options_from(RunFlags, p.parse_args(flags)))


def simulate(
    text: str, book: Any, ns: RunFlags, rate: float, overhead: Overhead, draws: int = 1
) -> dict[str, Any]:
    """The summary ``pdserve bench serve`` would write for workload ``ns`` at ``rate``
    against the cluster of ``text``, simulated with ``book``'s profiles and ``overhead``.

    With noise in ``overhead`` (:mod:`~pdserve.sim.jitter`) a run is one draw of it:
    ``draws`` runs, each its own, give TTFT and TPOT p50 and p90 as their mean (the
    rest of the summary is the first draw's, ``noise_draws`` says how many)."""
    runs = [simulate_once(text, book, ns, rate, overhead, seed) for seed in range(draws)]
    return runs[0] if draws == 1 else {**averaged(runs), "noise_draws": draws}


def simulate_each(
    text: str,
    book: Any,
    ns: RunFlags,
    rate: float,
    overheads: list[Overhead],
    draws: int = 1,
) -> dict[str, Any]:
    """:func:`simulate` once per overhead (each measured run of a point, with the
    steps its host ran at then), TTFT and TPOT p50 and p90 the mean over them: a
    point whose runs met hosts 1.7x apart is simulated for each host, not for their
    mean (latency is not linear in step time near saturation)."""
    runs = [simulate(text, book, ns, rate, overhead, draws) for overhead in overheads]
    return runs[0] if len(runs) == 1 else {**averaged(runs), "simulated_runs": len(runs)}


def averaged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first of ``runs``' summaries with TTFT and TPOT p50 and p90 their mean."""
    out = dict(runs[0])
    for metric, qs in mean_figures(runs).items():
        out[metric] = {**out[metric], **qs}
    return out


def simulate_once(
    text: str, book: Any, ns: RunFlags, rate: float, overhead: Overhead, seed: int
) -> dict[str, Any]:
    """:func:`simulate`'s run with the ``seed``-th draws of the noise."""
    from pdserve.cluster.config import parse_config
    from pdserve.sim.cluster import SimCluster, SimOptions
    from pdserve.sim.results import slo_of
    from pdserve.sim.workload import workload_from_args

    config = parse_config(text, "<sim>")
    work = workload_from_args(ns, rate, [1.0])
    options = SimOptions(
        fast=False,
        planner=False,
        request_overhead_s=overhead.request_s,
        request_jitter=overhead.live.jitter,
        noise_seed=seed,
        one_host=True,
        max_concurrency=ns.max_concurrency,
        request_timeout_s=ns.request_timeout,
    )
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

    def quiet(self) -> Overhead:
        """Without the steps' and requests' noise: the overheads are fitted to the
        model's mean times (a few calibration requests' draws of the noise would move
        a run's p50 by several percent, and the overheads with it)."""

        def still(fit: LiveFit) -> LiveFit:
            return dataclasses.replace(fit, jitter=0.0, jitter_s=0.0)

        roles = {role: still(fit) for role, fit in self.role_live.items()}
        return dataclasses.replace(self, live=still(self.live), role_live=roles)

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
            dataclasses.replace(
                p,
                step=step(p.step, self.live),
                role_steps={r: step(p.step, f) for r, f in self.role_live.items()},
                connectors={name: link(t) for name, t in p.connectors.items()},
            )
            for p in book.profiles
        ]
        return ProfileBook(book.model, profiles, book.device, book.assumptions)


CALIBRATION = ["--prompt-len", "256", "--output-len", "32", "--arrival", "fixed"]
BURST = ["--prompt-len", "256", "--output-len", "32", "--arrival", "burst", "--burst-size", "8"]
SHORT = ["--prompt-len", "256", "--output-len", "4", "--arrival", "fixed"]
LONG = ["--prompt-len", "1024", "--output-len", "32", "--arrival", "fixed"]
LONG_BESIDE = ["--prompt-len", "1024", "--output-len", "128", "--arrival", "fixed"]
BRIEF = ["--prompt-len", "64", "--output-len", "32", "--arrival", "fixed"]
CALIBRATION_BURST_RATE = 1.0  # req/s: a burst of 8 every 8 s, done well before the next
CALIBRATION_OVERLAP_RATE = 4.0  # req/s, fixed gaps: a prefill beside the last one's decode
# req/s, fixed gaps: a 1,024-token prompt's chunks beside the last one's decode steps
CALIBRATION_LONG_OVERLAP_RATE = 2.0
# req/s, fixed gaps: a disaggregated decode instance's steps beside long prefills (the
# one-core prefill busy about half the time, not saturated as at 2 req/s; each prefill
# within the decode of the request before, whose 128 tokens take longer than the gap)
CALIBRATION_LONG_BESIDE_RATE = 0.75


def calibration_args(args: ValidateOptions, setup: str = "disaggregated") -> Runs:
    """(flags, rate) of the calibration runs of ``setup``: one request at a time (a
    fixed gap longer than a request: no queueing, no batching), bursts of 8 (batches
    of up to 8), and one at a time again with 4 output tokens (the hand-off to decode
    weighs on their TPOT eight times as much as on 32 tokens'), a steady 4 req/s
    (each prefill runs beside the decode steps of the requests before it), and one
    at a time with 1,024-token prompts (long prefills, and decode steps over long
    contexts: fitted on 256-token prompts alone, the live decode steps at 1,024 ran
    1.26-1.30x the model, docs/results/simulator.md).

    A colocated instance also runs those long prompts at a steady 2 req/s (its
    steps that carry a long prompt's chunk beside decode rows over long contexts:
    the tail of TPOT where long prompts keep arriving, 35% under the model without
    this run, docs/results/simulator.md) and 64-token prompts one at a time (the short prompts of the
    conversation trace). A disaggregated pair runs them at 0.75 req/s instead, with
    128 output tokens, so that each prefill runs beside the decode steps of the
    request before: its decode steps beside a long prefill ran 1.2-1.35x the fitted
    model where the steady 256-token prompts had put them at 1.0x (docs/results/simulator.md); with
    32 output tokens the run held 30 such steps, too few to fit their factor, and
    2 req/s saturates its one-core prefill."""
    n = args.calibration_requests
    single, burst, short, overlap, long = (
        replace(bench_flags(w, args), num_requests=count)
        for w, count in (
            (CALIBRATION, n),
            (BURST, 2 * 8),
            (SHORT, n),
            (CALIBRATION, 3 * n),
            (LONG, n),
        )
    )
    runs = [
        (single, CALIBRATION_RATE),
        (burst, CALIBRATION_BURST_RATE),
        (short, CALIBRATION_RATE),
        (overlap, CALIBRATION_OVERLAP_RATE),
        (long, CALIBRATION_RATE),
    ]
    long_overlap = replace(
        bench_flags(LONG if setup == "colocated" else LONG_BESIDE, args), num_requests=2 * n
    )
    if setup == "colocated":
        brief = replace(bench_flags(BRIEF, args), num_requests=n)
        runs += [(long_overlap, CALIBRATION_LONG_OVERLAP_RATE), (brief, CALIBRATION_RATE)]
    else:
        runs.append((long_overlap, CALIBRATION_LONG_BESIDE_RATE))
    return runs


def _tpot(summary: dict[str, Any]) -> float:
    return float(summary["tpot_ms"]["p50"]) / 1e3


def calibrate(
    text: str,
    book: Any,
    real: list[dict[str, Any]],
    runs: Runs,
    traces: dict[str, list[list[StepRecord]]] | None = None,
    per_role: bool = True,
) -> Overhead:
    """The overheads that make the simulated calibration runs match the measured ones.

    The engines' own steps during the runs (``traces``: per role, each instance's,
    when traced) set the step model's scales, offset, and cold and shared factors
    (:func:`~pdserve.sim.live.live_fit`): one fit of them all, and with ``per_role``
    one per role of its own steps beside the other roles' (:func:`role_fits`; a
    prefill and a decode instance slow differently, alone and beside each other:
    the one fit put the disaggregated prefill's live steps at 1.3-1.6x it, docs/results/simulator.md).
    The noise of the steps about that model (:mod:`~pdserve.sim.jitter`) is
    fitted with them, and left out of the simulations below (:meth:`Overhead.quiet`).
    Then TPOT p50 of
    each run, against the simulation's sensitivity to each overhead (it differs
    with the batch and the output length), gives the per-step, per-sequence
    and per-hand-off overheads: the non-negative least-squares answer over each run's
    gap relative to its own TPOT (exact when the runs are independent; an overhead a
    setup lacks, such as the hand-off of a colocated one, has no effect and comes out
    0). Relative, so that every run counts alike: in absolute terms a run near
    saturation, whose TPOT moved 2.8x between two calibrations (docs/results/simulator.md), set them. Then TTFT p50 of the single run
    (the mean of its runs, where ``runs`` holds it more than once) gives the
    per-request one.
    """

    step = book.profiles[0].step
    by_role = traces or {}
    pooled = live_fit(step, [t for ts in by_role.values() for t in ts])
    noisy = Overhead(pooled, role_fits(step, by_role) if per_role else {})
    fitted = _tpot_overheads(text, book, real, runs, noisy.quiet())
    request = _request_overhead(text, book, real, runs, fitted)
    return dataclasses.replace(
        fitted, request_s=request, live=noisy.live, role_live=noisy.role_live
    )


def _tpot_overheads(
    text: str, book: Any, real: list[dict[str, Any]], runs: Runs, steps: Overhead
) -> Overhead:
    """``steps`` with the per-step, per-sequence and per-hand-off overheads that close the
    gaps between the runs' measured and simulated TPOT p50 (:func:`relative_fit`)."""

    def tpots(o: Overhead) -> np.ndarray:
        return np.array([_tpot(simulate(text, book, ns, rate, o)) for ns, rate in runs])

    base, probe = tpots(steps), 1e-3
    probes = (
        dataclasses.replace(steps, step_s=probe),
        dataclasses.replace(steps, seq_s=probe),
        dataclasses.replace(steps, handoff_s=probe),
    )
    columns = np.column_stack([(tpots(o) - base) / probe for o in probes])
    step_s, seq_s, handoff_s = relative_fit(columns, np.array([_tpot(r) for r in real]), base)
    return dataclasses.replace(steps, step_s=step_s, seq_s=seq_s, handoff_s=handoff_s)


def _request_overhead(
    text: str, book: Any, real: list[dict[str, Any]], runs: Runs, fitted: Overhead
) -> float:
    """The per-request overhead: the single run's measured TTFT p50 (the mean of its runs)
    over the simulated one, in seconds."""
    single, rate = runs[0]
    stepped = simulate(text, book, single, rate, fitted)
    seen = [r["ttft_ms"]["p50"] for r, run in zip(real, runs, strict=True) if run == runs[0]]
    return max(0.0, (float(np.mean(seen)) - stepped["ttft_ms"]["p50"]) / 1e3)


def relative_fit(columns: np.ndarray, seen: np.ndarray, base: np.ndarray) -> list[float]:
    """The non-negative overheads (one per column: each run's TPOT per second of it)
    that close the runs' gaps between ``seen`` and ``base`` TPOT, each gap relative to
    its own run's TPOT."""
    weight = 1 / np.maximum(seen, 1e-6)
    return nonnegative_lstsq(columns * weight[:, None], (seen - base) * weight)


def role_fits(step: StepModel, traces: dict[str, list[list[StepRecord]]]) -> dict[str, LiveFit]:
    """Per role of ``traces`` (each role's instances' steps): the fit of its steps,
    with every other role's steps as their neighbours. One role: none (the pooled
    fit stands)."""
    if len(traces) < 2:
        return {}
    return {
        role: live_fit(step, mine, [t for other, ts in traces.items() if other != role for t in ts])
        for role, mine in traces.items()
        if any(mine)
    }


def beside_fits(
    step: StepModel, traces: dict[str, list[list[StepRecord]]]
) -> tuple[LiveFit, dict[str, LiveFit]]:
    """(the fit of every traced step, one per role) for a live run's traces: each role
    its own fit beside the other's (:func:`role_fits`); a cluster of one role (a
    colocated one), the fit of all its steps; a role that ran no step, none (its
    profile stands)."""
    pooled = live_fit(step, [t for ts in traces.values() for t in ts])
    fits = role_fits(step, traces) or {role: pooled for role, ts in traces.items() if any(ts)}
    return pooled, {"prefill": LiveFit(), "decode": LiveFit(), **fits}


def own_steps(overhead: Overhead, book: Any, measured: Measured) -> Overhead:
    """``overhead`` with each role's steps set to what its engine ran at this point
    (not a prediction: it tells the error of the step times, which contention under
    load moves, from that of the simulated scheduling, routing and queueing)."""
    step = book.profiles[0].step
    fits = {
        role: live_fit(step, traces) for role, traces in measured.by_role().items() if any(traces)
    }
    return dataclasses.replace(overhead, role_live=fits)


HOST_CHECK_REQUESTS = 4  # a host check: this many single 1,024-token requests (~8 s)


def host_check_args(args: ValidateOptions) -> tuple[RunFlags, float]:
    """The short run measured before each point's run with ``--host-check``: the
    calibration's single 1,024-token requests, fewer of them."""
    return replace(bench_flags(LONG, args), num_requests=HOST_CHECK_REQUESTS), CALIBRATION_RATE


def host_check_baseline(runs: Runs) -> int:
    """Which calibration run the host checks repeat (its single 1,024-token requests)."""
    return next(
        i for i, (ns, rate) in enumerate(runs) if ns.prompt_len == 1024 and rate == CALIBRATION_RATE
    )


def host_factors(
    role_models: dict[str, StepModel],
    default: StepModel,
    baselines: list[Measured],
    checks: list[Measured],
) -> list[dict[str, float]]:
    """Per measured run, per role: how many times slower its engine ran the host check
    just before it (``checks``, one per run) than the same requests in the calibration
    (``baselines``: each calibration's run of them, their mean), each against the
    role's calibrated step model (``role_models``, else ``default``: the median loop
    turn over the model's time). The host of a 2-vCPU VM drifts: one workload moved TPOT p50 by 14% in four minutes, and one
    point's two rounds ran 1.7x apart (docs/results/simulator.md)."""

    def ratios(measured: Measured) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for name, seen in measured.ratios(role_models, default).items():
            out.setdefault(Measured.role_of(name), []).append(seen["median_ratio"])
        return {role: float(np.mean(values)) for role, values in out.items()}

    calibrated = [ratios(m) for m in baselines]
    base = {
        role: float(np.mean([c[role] for c in calibrated if role in c])) for role in calibrated[0]
    }
    return [
        {role: seen[role] / b for role, b in base.items() if b > 0 and role in seen}
        for seen in map(ratios, checks)
    ]


def rescaled(overhead: Overhead, factors: dict[str, float]) -> Overhead:
    """``overhead`` with each role's steps ``factors[role]`` times as long (the fit of
    all steps by their mean: a cluster of one role has no fit per role)."""

    def scale(fit: LiveFit, r: float) -> LiveFit:
        return dataclasses.replace(
            fit,
            compute_scale=fit.compute_scale * r,
            memory_scale=fit.memory_scale * r,
            offset_s=fit.offset_s * r,
        )

    roles = {role: scale(fit, factors.get(role, 1.0)) for role, fit in overhead.role_live.items()}
    mean = float(np.mean(list(factors.values()))) if factors else 1.0
    return dataclasses.replace(overhead, live=scale(overhead.live, mean), role_live=roles)


def calibrated_profile(book: Any, overhead: Overhead, command: str) -> Profile:
    """``book``'s profile as the calibration found the live system, for ``pdserve sim
    --profile``: its steps and each role's scaled and slowed as the engines ran them,
    with their noise (:meth:`Overhead.apply`), a request's overhead and its noise, and
    every instance on one host (a step beside another instance's is slower)."""
    applied = overhead.apply(book)
    return dataclasses.replace(
        applied.profiles[0],
        request_overhead_s=overhead.request_s,
        request_jitter=overhead.live.jitter,
        one_host=True,
        command=command,
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
