"""The capacity planner: the cheapest P:D counts and layouts that meet the SLOs.

:func:`plan_region` is the planner-facing API (``pdserve plan`` calls it per
region; a proactive P:D planner can call it with its forecast rate and the
observed length mix): for each allowed (prefill TP, decode TP) layout it

1. computes the textbook plan (:mod:`pdserve.sim.textbook`) and rejects the
   layout if one request alone misses an SLO (naming the SLO and the gap);
2. simulates the region at the forecast rate grown by the headroom and
   searches the fewest decode instances meeting the TPOT percentile (prefill
   ample), then the fewest prefill instances meeting the TTFT percentile,
   each search starting at the textbook's count (:mod:`pdserve.sim.search`),
   then bumps whichever role still misses when both are at their minimum;
3. adds the spares (N+1) and simulates the result at the forecast rate for
   its goodput per device.

The cheapest feasible layout (fewest devices, then most goodput per device)
wins. :func:`plan_colocated` plans the other layout: the fewest colocated
instances (no prefill role; each prefills its own prompts with chunked prefill)
meeting both SLOs, searched from the textbook's two counts together, with the
same headroom, spares and device limit; ``plan_region(..., layout="colocated")``
prices it at each allowed tensor-parallel size (:mod:`pdserve.sim.plan_choice`
compares the two layouts). With none, :class:`InvalidArgumentError` says which SLO cannot be met,
by how much, and at which limit. :func:`plan_regions` plans every region of a
forecast. Given a :class:`~pdserve.sim.candidates.Pool` of worker processes,
regions and layouts are searched at once, each on its share of the workers,
and a search simulates the candidates it may try next together; the plan is
the one a single process finds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.build import ProfileBook
from pdserve.sim.candidates import (
    Candidates,
    LayoutCase,
    Outcome,
    Pool,
    cluster_yaml,
    open_pool,
)
from pdserve.sim.search import smallest_near
from pdserve.sim.textbook import SingleInstance, TextbookPlan, single_instance, textbook_plan

LAYOUTS = ("disaggregated", "colocated")

__all__ = [
    "LAYOUTS",
    "Infeasible",
    "LengthMix",
    "Outcome",
    "PlanLimits",
    "PlanSlo",
    "Pool",
    "RegionPlan",
    "cluster_yaml",
    "open_pool",
    "plan_colocated",
    "plan_layout",
    "plan_region",
    "plan_regions",
]


@dataclass(frozen=True)
class PlanSlo:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if not (0 < self.ttft_s < math.inf and 0 < self.tpot_s < math.inf):
            raise InvalidArgumentError("slo", "TTFT and TPOT SLOs must be > 0 and finite")
        if not 0 < self.percentile < 100:
            raise InvalidArgumentError("percentile", "must be in (0, 100)")


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths to draw requests from (a trace's, or a synthetic mix)."""

    prompt: np.ndarray  # [M] int64
    output: np.ndarray  # [M] int64

    def __post_init__(self) -> None:
        if len(self.prompt) == 0 or len(self.prompt) != len(self.output):
            raise InvalidArgumentError("lengths", "need as many prompt as output lengths, >= 1")

    def check_context(self, limit: int) -> None:
        """Refuse a mix with requests the front door would refuse: prompt + output past
        the model's context (every such request would fail, so no plan could be met)."""
        total = self.prompt + self.output
        over = int((total > limit).sum())
        if over:
            raise InvalidArgumentError(
                "lengths",
                f"{over} of {len(total)} requests of the mix ask for more than the "
                f"model's context of {limit} tokens (prompt + output up to {int(total.max())}): "
                "cap them with --max-prompt-len and --max-output-len",
            )

    def draw(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        idx = np.random.default_rng(seed).integers(0, len(self.prompt), size=n)
        return self.prompt[idx], self.output[idx]


@dataclass(frozen=True)
class PlanLimits:
    """Attributes:
    max_devices: devices the region may use.
    prefill_tp / decode_tp: tensor-parallel sizes allowed per role.
    headroom: planned load over the forecast (0.3: +30%).
    spares: instances added per role for failures (N+1: 1).
    num_requests: requests simulated per candidate (None: enough to span ten times a
        request's own latency or the TTFT SLO, whichever is longer, and at least 1,500).
    max_num_seqs / max_num_batched_tokens / block_size: engine options of every instance.
    """

    max_devices: int = 64
    prefill_tp: tuple[int, ...] = (1,)
    decode_tp: tuple[int, ...] = (1,)
    headroom: float = 0.3
    spares: int = 1
    num_requests: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_devices < 1:
            raise InvalidArgumentError("max_devices", "must be >= 1")
        if not 0 <= self.headroom < math.inf or self.spares < 0:
            raise InvalidArgumentError("headroom", "headroom and spares must be >= 0")
        for name in ("num_requests", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise InvalidArgumentError("seed", f"must be >= 0, got {self.seed}")
        if not self.prefill_tp or not self.decode_tp:
            raise InvalidArgumentError("tp", "allow at least one tensor-parallel size per role")


@dataclass(frozen=True)
class RegionPlan:
    region: str
    rate: float
    prefill_tp: int
    decode_tp: int
    prefill: int
    decode: int
    devices: int
    at_forecast: Outcome
    single: SingleInstance
    textbook: TextbookPlan
    textbook_devices: int
    simulations: int
    tried: list[str] = field(default_factory=list)  # why other layouts lost
    layout: str = "disaggregated"  # or "colocated": prefill 0, decode instances prefill too

    @property
    def label(self) -> str:
        """The layout in words: ``tp=1/2`` (prefill/decode) or ``colocated tp=1``."""
        if self.layout == "colocated":
            return f"colocated tp={self.decode_tp}"
        return f"tp={self.prefill_tp}/{self.decode_tp}"


class Infeasible(InvalidArgumentError):
    """No allowed layout meets an SLO; the message names it and the gap."""


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


def _alone(one: SingleInstance, slo: PlanSlo, tp: tuple[int, int], mix: LengthMix) -> str | None:
    """Why a layout cannot work even for one request, or None."""
    prompt = float(np.mean(mix.prompt))
    if one.prefill_s > slo.ttft_s:
        return (
            f"TTFT SLO {_ms(slo.ttft_s)} cannot be met at prefill tp={tp[0]}: a "
            f"{prompt:.0f}-token prompt alone takes {_ms(one.prefill_s)} to prefill "
            f"({_ms(one.prefill_s - slo.ttft_s)} over)"
        )
    if one.batch == 0:
        if one.max_batch == 0:
            return f"decode tp={tp[1]}: one request of the mix does not fit the KV cache"
        return (
            f"TPOT SLO {_ms(slo.tpot_s)} cannot be met at decode tp={tp[1]}: one decode "
            f"step alone takes {_ms(one.decode_floor_s)} "
            f"({_ms(one.decode_floor_s - slo.tpot_s)} over)"
        )
    return None


def _caps(limits: PlanLimits, tp: tuple[int, int]) -> tuple[int, int]:
    """The most prefill and decode instances (spares apart) the devices hold beside one
    instance of the other role and the spares."""
    cap_p = (limits.max_devices - tp[1] * (1 + limits.spares)) // tp[0] - limits.spares
    cap_d = (limits.max_devices - tp[0] * (1 + limits.spares)) // tp[1] - limits.spares
    if cap_p < 1 or cap_d < 1:
        raise Infeasible(
            "max_devices",
            f"{limits.max_devices} devices cannot hold one prefill and "
            f"one decode instance plus spares at tp={tp[0]}/{tp[1]}",
        )
    return cap_p, cap_d


def plan_layout(
    case: LayoutCase, rate: float, peak_bw: float, pool: Pool | None = None
) -> RegionPlan:
    """The cheapest counts for one layout; Infeasible names the SLO and the gap. With a
    process ``pool``, candidates the search may try next are simulated together."""
    book, mix, tp, limits, slo = case.book, case.mix, case.tp, case.limits, case.slo
    prefill, decode = book.get(tp[0], 1), book.get(tp[1], 1)
    prompt, output = float(np.mean(mix.prompt)), float(np.mean(mix.output))
    one = single_instance(prefill, decode, prompt, output, slo.tpot_s, limits.max_num_seqs, peak_bw)
    why = _alone(one, slo, tp, mix)
    if why is not None:
        raise Infeasible("slo", why)
    book_plan = textbook_plan(rate, one, output, slo.ttft_s, limits.headroom, limits.spares)
    cap_p, cap_d = _caps(limits, tp)
    n = simulated_requests(case.region, rate * (1 + limits.headroom), one, output, slo, limits)
    search = Candidates(case, rate * (1 + limits.headroom), n, pool)
    try:
        p, d = _fewest(search, book_plan, cap_p, cap_d)
    finally:
        search.close()  # a candidate started for a search that ended is not needed
    p, d = p + limits.spares, d + limits.spares
    final = Candidates(case, rate, n, pool).run(p, d)
    tb_devices = book_plan.prefill * tp[0] + book_plan.decode * tp[1]
    return RegionPlan(
        case.region,
        rate,
        tp[0],
        tp[1],
        p,
        d,
        p * tp[0] + d * tp[1],
        final,
        one,
        book_plan,
        tb_devices,
        search.simulations + 1,
    )


def plan_colocated(
    case: LayoutCase, rate: float, peak_bw: float, pool: Pool | None = None
) -> RegionPlan:
    """The fewest colocated instances at tensor-parallel size ``case.tp[1]`` meeting both
    SLOs: a region with no prefill role, each instance prefilling its own prompts (chunked
    prefill, beside its decodes). The same headroom, spares (added once: one role) and
    device limit as :func:`plan_layout`; Infeasible names the SLO and the gap."""
    book, mix, limits, slo = case.book, case.mix, case.limits, case.slo
    tp = case.tp[1]
    case = replace(case, tp=(tp, tp))
    inst = book.get(tp, 1)
    output = float(np.mean(mix.output))
    one = single_instance(
        inst, inst, float(np.mean(mix.prompt)), output, slo.tpot_s, limits.max_num_seqs, peak_bw
    )
    why = _alone(one, slo, case.tp, mix)
    if why is not None:
        raise Infeasible("slo", why)
    book_plan = textbook_plan(rate, one, output, slo.ttft_s, limits.headroom, limits.spares)
    cap = limits.max_devices // tp - limits.spares
    if cap < 1:
        raise Infeasible(
            "max_devices",
            f"{limits.max_devices} devices cannot hold one colocated instance plus spares "
            f"at tp={tp}",
        )
    n = simulated_requests(case.region, rate * (1 + limits.headroom), one, output, slo, limits)
    search = Candidates(case, rate * (1 + limits.headroom), n, pool)
    # an instance does both roles' work: the textbook's two counts (spares out) start the search
    d = _fewest_colocated(search, book_plan.prefill + book_plan.decode - 2 * limits.spares, cap)
    d += limits.spares
    final = Candidates(case, rate, n, pool).run(0, d)
    tb_devices = (book_plan.prefill + book_plan.decode) * tp
    simulations = search.simulations + 1
    return RegionPlan(
        case.region,
        rate,
        tp,
        tp,
        0,
        d,
        d * tp,
        final,
        one,
        book_plan,
        tb_devices,
        simulations,
        layout="colocated",
    )


def _fewest_colocated(search: Candidates, hint: int, cap: int) -> int:
    """The fewest colocated instances up to ``cap`` meeting both SLOs, searched from
    ``hint``; Infeasible if even ``cap`` misses."""
    slo, limits = search.slo, search.limits
    try:
        d = smallest_near(
            1,
            hint,
            cap,
            lambda k: all(search.run(0, k).meets(slo)),
            lambda ks: search.prefetch([(0, k) for k in ks]),
            search.width,
        )
        if d is None:
            raise Infeasible(
                "slo",
                f"{_shortfall(search.run(0, cap), slo)} with {cap} colocated instances "
                f"(tp={search.tp[1]}), the most {limits.max_devices} devices allow",
            )
    finally:
        search.close()  # a candidate started for a search that ended is not needed
    return d


def _fewest_of(
    search: Candidates, role: int, other: int, bare: int, hint: int, cap: int
) -> int | None:
    """The fewest instances of ``role`` (0: prefill, 1: decode) up to ``cap`` that meet its
    SLO beside ``other`` of the other role, searched from ``hint``; None if none do."""

    def counts(n: int) -> tuple[int, int]:
        return (n, other) if role == 0 else (other, n)

    return smallest_near(
        max(1, bare // 2),
        hint,
        cap,
        lambda n: search.run(*counts(n)).meets(search.slo)[role],
        lambda ns: search.prefetch([counts(n) for n in ns]),
        search.width,
    )


def _fewest(search: Candidates, book_plan: TextbookPlan, cap_p: int, cap_d: int) -> tuple[int, int]:
    """The fewest decode instances meeting TPOT with prefill ample, then the fewest
    prefill meeting TTFT there, then a bump of whichever role still misses."""
    slo, tp, limits = search.slo, search.tp, search.limits
    ample_p = min(cap_p, max(1, 2 * book_plan.prefill_bare + 1))
    # The textbook's counts at the searched rate (headroom in, spares out) start each search.
    hint_p, hint_d = book_plan.prefill - limits.spares, book_plan.decode - limits.spares
    d = _fewest_of(search, 1, ample_p, book_plan.decode_bare, hint_d, cap_d)
    if d is None:
        _missed(search.run(ample_p, cap_d), slo, "decode", cap_d, tp, limits)
    assert d is not None
    p = _fewest_of(search, 0, d, book_plan.prefill_bare, hint_p, cap_p)
    if p is None:
        _missed(search.run(cap_p, d), slo, "prefill", cap_p, tp, limits)
    assert p is not None
    while not all(search.run(p, d).meets(slo)):
        ttft_ok, _ = search.run(p, d).meets(slo)
        if ttft_ok:
            d += 1
        else:
            p += 1
        if p > cap_p or d > cap_d:
            _missed(search.run(min(p, cap_p), min(d, cap_d)), slo, "both", cap_p, tp, limits)
    return p, d


MIN_REQUESTS = 1500  # simulated per candidate at least, when the planner chooses
MAX_REQUESTS = 200_000  # most it chooses: ~2 CPU-minutes a candidate here


def simulated_requests(
    region: str, rate: float, one: SingleInstance, output: float, slo: PlanSlo, limits: PlanLimits
) -> int:
    """Requests to simulate per candidate: their arrivals must span ten times a request's
    own latency or the TTFT SLO, whichever is longer. A shorter span is a burst that
    enough instances absorb at any rate: no queue, nor a full decode batch, has time to
    show (a 200-request plan at 1e9 req/s "met" the SLOs with 124 devices)."""
    span_s = 10 * max(one.prefill_s + output * one.decode_floor_s, slo.ttft_s)
    needed = math.ceil(rate * span_s)
    given = limits.num_requests
    if given is not None and given < needed:
        raise InvalidArgumentError(
            "num_requests",
            f"{given} requests at {rate:g} req/s (with headroom) arrive within "
            f"{given / rate:.3g} s, too short for queues to show (ten times a request's own "
            f"latency or the TTFT SLO: {span_s:.3g} s): give at least {needed}",
        )
    if given is None and needed > MAX_REQUESTS:
        raise InvalidArgumentError(
            "rate",
            f"region {region}: {rate:g} req/s (with headroom) needs {needed} simulated requests a "
            f"candidate to show queues ({span_s:.3g} s of arrivals), over the {MAX_REQUESTS} "
            "the planner simulates by itself: plan a share of the traffic (the rate over k) "
            "and multiply the counts by k, or pass --num-requests",
        )
    return given if given is not None else max(MIN_REQUESTS, needed)


def _shortfall(o: Outcome, slo: PlanSlo) -> str:
    """Which SLO a candidate misses, and by how much."""
    q = f"p{slo.percentile:g}"
    if o.ttft_s > slo.ttft_s:
        return (
            f"TTFT {q} SLO {_ms(slo.ttft_s)} cannot be met: {_ms(o.ttft_s)} "
            f"({_ms(o.ttft_s - slo.ttft_s)} over)"
        )
    if o.failed:
        return f"{o.failed} requests were refused (no decode instance had room for their KV)"
    return (
        f"TPOT {q} SLO {_ms(slo.tpot_s)} cannot be met: {_ms(o.tpot_s)} "
        f"({_ms(o.tpot_s - slo.tpot_s)} over)"
    )


def _missed(
    o: Outcome, slo: PlanSlo, role: str, cap: int, tp: tuple[int, int], limits: PlanLimits
) -> None:
    raise Infeasible(
        "slo",
        f"{_shortfall(o, slo)} with {o.prefill} prefill (tp={tp[0]}) and {o.decode} decode "
        f"(tp={tp[1]}) instances, the most {limits.max_devices} devices allow ({role} at its "
        f"limit of {cap})",
    )


def plan_region(
    book: ProfileBook,
    region: str,
    rate: float,
    mix: LengthMix,
    limits: PlanLimits,
    slo: PlanSlo,
    peak_bw: float,
    pool: Pool | None = None,
    layout: str = "disaggregated",
) -> RegionPlan:
    """The cheapest feasible tensor-parallel sizes and counts of ``layout`` (disaggregated:
    each (prefill, decode) pair allowed; colocated: each size allowed to either role) for
    ``rate`` requests/s of ``mix``; with a ``pool``, the sizes are searched at once, each
    on its share of the workers."""
    if not rate > 0:
        raise InvalidArgumentError("rate", f"region {region}: forecast rate must be > 0")
    if layout not in LAYOUTS:
        raise InvalidArgumentError("layout", f"must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    _profiles(book, limits)
    plan_one = plan_colocated if layout == "colocated" else plan_layout
    sizes = sorted({*limits.prefill_tp, *limits.decode_tp})
    layouts = (
        [(t, t) for t in sizes]
        if layout == "colocated"
        else [(tp_p, tp_d) for tp_p in limits.prefill_tp for tp_d in limits.decode_tp]
    )

    def attempt(tp: tuple[int, int], share: Pool | None) -> RegionPlan:
        return plan_one(LayoutCase(book, region, mix, tp, limits, slo), rate, peak_bw, share)

    plans = side_by_side(attempt, layouts, pool, Infeasible)
    return _cheapest(region, rate, layout, layouts, plans)


def _cheapest(
    region: str,
    rate: float,
    layout: str,
    layouts: list[tuple[int, int]],
    plans: list[RegionPlan | Infeasible],
) -> RegionPlan:
    """The plan of fewest devices (then most goodput per device); the others, and why
    they lost, in its ``tried``."""
    best: RegionPlan | None = None
    errors: list[str] = []
    for tp, plan in zip(layouts, plans, strict=True):
        if isinstance(plan, Infeasible):
            name = f"colocated tp={tp[1]}" if layout == "colocated" else f"tp={tp[0]}/{tp[1]}"
            errors.append(f"{name}: {plan.message}")
            continue
        key = (plan.devices, -plan.at_forecast.goodput_rps)
        if best is None or key < (best.devices, -best.at_forecast.goodput_rps):
            if best is not None:
                errors.append(f"{best.label}: {best.devices} devices")
            best = plan
        else:
            errors.append(f"{plan.label}: {plan.devices} devices")
    if best is None:
        raise Infeasible("slo", f"region {region} at {rate:g} req/s: " + "; ".join(errors))
    best.tried.extend(errors)
    return best


def plan_regions(
    book: ProfileBook,
    forecast: dict[str, float],
    mix: LengthMix,
    limits: PlanLimits,
    slo: PlanSlo,
    peak_bw: float,
    pool: Pool | None = None,
    layout: str = "disaggregated",
) -> list[RegionPlan]:
    """:func:`plan_region` for each region's peak rate (at once, with a ``pool``); the
    first infeasible region, in the forecast's order, raises."""

    def attempt(region: str, share: Pool | None) -> RegionPlan:
        return plan_region(book, region, forecast[region], mix, limits, slo, peak_bw, share, layout)

    _profiles(book, limits)
    plans = []
    for plan in side_by_side(attempt, list(forecast), pool, InvalidArgumentError):
        if isinstance(plan, InvalidArgumentError):
            raise plan
        plans.append(plan)
    return plans


def _profiles(book: ProfileBook, limits: PlanLimits) -> None:
    """Build every allowed layout's profile now: searches running at once then only read
    the book (each candidate sent to a worker carries it)."""
    for tp in {*limits.prefill_tp, *limits.decode_tp}:
        book.get(tp, 1)


T = TypeVar("T")
R = TypeVar("R")
E = TypeVar("E", bound=Exception)


def side_by_side(
    fn: Callable[[T, Pool | None], R], items: Sequence[T], pool: Pool | None, caught: type[E]
) -> list[R | E]:
    """``fn(item, share)`` for each item, in order, or the ``caught`` error it raised.
    With a pool, the items run at once, each in a thread that waits on its share of
    the pool's workers (the simulations run there); without one, one after another
    in this process."""

    def one(item: T, share: Pool | None) -> R | E:
        try:
            return fn(item, share)
        except caught as e:
            return e

    if pool is None or len(items) < 2:
        return [one(item, pool) for item in items]
    share = pool.share(len(items))
    with ThreadPoolExecutor(len(items)) as threads:
        return list(threads.map(lambda item: one(item, share), items))
