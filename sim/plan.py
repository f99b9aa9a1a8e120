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
wins. With none, :class:`InvalidArgumentError` says which SLO cannot be met,
by how much, and at which limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.report import Slo
from pdserve.cluster.config import ClusterConfig, parse_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.build import ProfileBook
from pdserve.sim.cluster import SimCluster, SimOptions
from pdserve.sim.search import smallest_near
from pdserve.sim.textbook import SingleInstance, TextbookPlan, single_instance, textbook_plan
from pdserve.sim.workload import SimWorkload


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
                "lengths", f"{over} of {len(total)} requests of the mix ask for more than the "
                f"model's context of {limit} tokens (prompt + output up to {int(total.max())}): "
                "cap them with --max-prompt-len and --max-output-len",
            )  # fmt: skip

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
class Outcome:
    """One simulated candidate: its percentiles (s), failures and goodput."""

    prefill: int
    decode: int
    ttft_s: float
    tpot_s: float
    failed: int
    goodput_rps: float

    def meets(self, slo: PlanSlo) -> tuple[bool, bool]:
        """(TTFT met, TPOT met); a refused request (no decode instance had room for its
        KV) counts against decode."""
        return (self.ttft_s <= slo.ttft_s, self.failed == 0 and self.tpot_s <= slo.tpot_s)


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


def cluster_yaml(model: str, region: str, prefill: int, decode: int, tp_p: int, tp_d: int,
                 limits: PlanLimits, slo: PlanSlo) -> str:  # fmt: skip
    """The cluster YAML of a plan: what `pdserve serve` and `pdserve sim` take."""
    return (
        f"model: {model}\n"
        f"engine: {{max_num_seqs: {limits.max_num_seqs}, "
        f"max_num_batched_tokens: {limits.max_num_batched_tokens}, "
        f"block_size: {limits.block_size}, enable_prefix_caching: false}}\n"
        f"regions:\n  - name: {region}\n"
        f"    prefill: {{count: {prefill}, min: {min(prefill, 1)}, max: {max(prefill, 1)}, "
        f"tensor_parallel_size: {tp_p}}}\n"
        f"    decode: {{count: {decode}, min: 1, max: {max(decode, 1)}, "
        f"tensor_parallel_size: {tp_d}}}\n"
        f"slo: {{ttft_ms: {slo.ttft_s * 1e3:g}, tpot_ms: {slo.tpot_s * 1e3:g}}}\n"
        f"router: {{max_inflight_per_region: 1000000}}\n"
        f'planner: {{mode: "off"}}\n'
    )


@dataclass(frozen=True)
class Pool:
    """Worker processes that simulate candidates side by side."""

    executor: Executor
    workers: int


@contextmanager
def open_pool(jobs: int) -> Iterator[Pool | None]:
    """A pool of ``jobs`` worker processes (None for one job: simulate in this process).

    Workers are spawned (not forked), so they start from a clean interpreter."""
    if jobs < 1:
        raise InvalidArgumentError("jobs", f"must be >= 1, got {jobs}")
    if jobs == 1:
        yield None
        return
    import multiprocessing

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as executor:
        yield Pool(executor, jobs)


class _Search:
    """Simulations of one region and layout at one rate (memoised by counts).

    With a ``pool`` (a process pool), :meth:`prefetch` simulates several candidates
    at once, one per worker; :meth:`run` then finds them done.
    """

    def __init__(self, book: ProfileBook, region: str, rate: float, mix: LengthMix,
                 tp: tuple[int, int], limits: PlanLimits, slo: PlanSlo, n: int,
                 pool: Pool | None = None) -> None:  # fmt: skip
        self.book, self.region, self.rate, self.mix = book, region, rate, mix
        self.tp, self.limits, self.slo, self.pool = tp, limits, slo, pool
        self.cache: dict[tuple[int, int], Outcome] = {}
        arrival = wl.arrival_times("poisson", rate, n, None, seed=limits.seed)
        prompt, output = mix.draw(n, limits.seed + 1)
        self.work = SimWorkload(arrival, prompt, output, np.zeros(n, dtype=np.int16))

    @property
    def width(self) -> int:
        """Candidates worth simulating at once: the pool's workers (1 without one)."""
        return self.pool.workers if self.pool is not None else 1

    def yaml(self, p: int, d: int) -> str:
        return cluster_yaml(
            self.book.model.name, self.region, p, d, *self.tp, self.limits, self.slo
        )

    def config(self, p: int, d: int) -> ClusterConfig:
        return parse_config(self.yaml(p, d), "<plan>")

    def run(self, p: int, d: int) -> Outcome:
        if (p, d) not in self.cache:
            self.cache[(p, d)] = simulate_candidate(self.yaml(p, d), self.book, self.work, self.slo)
        return self.cache[(p, d)]

    def prefetch(self, counts: Sequence[tuple[int, int]]) -> None:
        """Simulate the candidates not yet simulated, at once on the pool."""
        todo = [c for c in dict.fromkeys(counts) if c not in self.cache]
        if self.pool is None or len(todo) < 2:
            return
        submit = self.pool.executor.submit
        jobs = [submit(simulate_candidate, self.yaml(*c), self.book, self.work, self.slo)
                for c in todo]  # fmt: skip
        for c, job in zip(todo, jobs, strict=True):
            self.cache[c] = job.result()


def simulate_candidate(text: str, book: ProfileBook, work: SimWorkload, slo: PlanSlo) -> Outcome:
    """One candidate's percentiles, failures and goodput (a pool worker runs it too)."""
    config = parse_config(text, "<plan>")
    sim = SimCluster(config, book, work, SimOptions(fast=True, keep_itl=False, planner=False))
    rec = sim.run().recorder
    ok = rec.error == 0
    ttft = rec.first[ok] - rec.arrival[ok]
    n = rec.tokens[ok].astype(np.float64)
    multi = n > 1
    tpot = (rec.end[ok][multi] - rec.first[ok][multi]) / (n[multi] - 1)
    q = slo.percentile
    meets = rec.slo_met(Slo(slo.ttft_s, slo.tpot_s))
    window = float(np.nanmax(rec.end) - rec.arrival.min())
    region = config.regions[0]
    return Outcome(
        region.prefill.count, region.decode.count,
        float(np.percentile(ttft, q)) if len(ttft) else math.inf,
        float(np.percentile(tpot, q)) if len(tpot) else 0.0, int((~ok).sum()),
        float(meets.sum()) / window if window > 0 else 0.0,
    )  # fmt: skip


class Infeasible(InvalidArgumentError):
    """No allowed layout meets an SLO; the message names it and the gap."""


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


def _alone(one: SingleInstance, slo: PlanSlo, tp: tuple[int, int], mix: LengthMix) -> str | None:
    """Why a layout cannot work even for one request, or None."""
    prompt = float(np.mean(mix.prompt))
    if one.prefill_s > slo.ttft_s:
        return (f"TTFT SLO {_ms(slo.ttft_s)} cannot be met at prefill tp={tp[0]}: a "
                f"{prompt:.0f}-token prompt alone takes {_ms(one.prefill_s)} to prefill "
                f"({_ms(one.prefill_s - slo.ttft_s)} over)")  # fmt: skip
    if one.batch == 0:
        if one.max_batch == 0:
            return f"decode tp={tp[1]}: one request of the mix does not fit the KV cache"
        return (f"TPOT SLO {_ms(slo.tpot_s)} cannot be met at decode tp={tp[1]}: one decode "
                f"step alone takes {_ms(one.decode_floor_s)} "
                f"({_ms(one.decode_floor_s - slo.tpot_s)} over)")  # fmt: skip
    return None


def plan_layout(book: ProfileBook, region: str, rate: float, mix: LengthMix, tp: tuple[int, int],
                limits: PlanLimits, slo: PlanSlo, peak_bw: float,
                pool: Pool | None = None) -> RegionPlan:  # fmt: skip
    """The cheapest counts for one layout; Infeasible names the SLO and the gap. With a
    process ``pool``, candidates the search may try next are simulated together."""
    prefill, decode = book.get(tp[0], 1), book.get(tp[1], 1)
    prompt, output = float(np.mean(mix.prompt)), float(np.mean(mix.output))
    one = single_instance(prefill, decode, prompt, output, slo.tpot_s, limits.max_num_seqs, peak_bw)
    why = _alone(one, slo, tp, mix)
    if why is not None:
        raise Infeasible("slo", why)
    book_plan = textbook_plan(rate, one, output, slo.ttft_s, limits.headroom, limits.spares)
    cap_p = (limits.max_devices - tp[1] * (1 + limits.spares)) // tp[0] - limits.spares
    cap_d = (limits.max_devices - tp[0] * (1 + limits.spares)) // tp[1] - limits.spares
    if cap_p < 1 or cap_d < 1:
        raise Infeasible("max_devices", f"{limits.max_devices} devices cannot hold one prefill and "
                         f"one decode instance plus spares at tp={tp[0]}/{tp[1]}")  # fmt: skip
    n = simulated_requests(region, rate * (1 + limits.headroom), one, output, slo, limits)
    search = _Search(book, region, rate * (1 + limits.headroom), mix, tp, limits, slo, n, pool)
    ample_p = min(cap_p, max(1, 2 * book_plan.prefill_bare + 1))
    # The textbook's counts at the searched rate (headroom in, spares out) start each search.
    hint_p, hint_d = book_plan.prefill - limits.spares, book_plan.decode - limits.spares
    d = smallest_near(max(1, book_plan.decode_bare // 2), hint_d, cap_d,
                      lambda n: search.run(ample_p, n).meets(slo)[1],
                      lambda ns: search.prefetch([(ample_p, n) for n in ns]), search.width)  # fmt: skip
    if d is None:
        _missed(search.run(ample_p, cap_d), slo, "decode", cap_d, tp, limits)
    assert d is not None
    decodes: int = d
    p = smallest_near(max(1, book_plan.prefill_bare // 2), hint_p, cap_p,
                      lambda n: search.run(n, decodes).meets(slo)[0],
                      lambda ns: search.prefetch([(n, decodes) for n in ns]), search.width)  # fmt: skip
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
    p, d = p + limits.spares, d + limits.spares
    final = _Search(book, region, rate, mix, tp, limits, slo, n, pool).run(p, d)
    tb_devices = book_plan.prefill * tp[0] + book_plan.decode * tp[1]
    return RegionPlan(region, rate, tp[0], tp[1], p, d, p * tp[0] + d * tp[1], final, one,
                      book_plan, tb_devices, len(search.cache) + 1)  # fmt: skip


MIN_REQUESTS = 1500  # simulated per candidate at least, when the planner chooses
MAX_REQUESTS = 200_000  # most it chooses: ~2 CPU-minutes a candidate here


def simulated_requests(region: str, rate: float, one: SingleInstance, output: float,
                       slo: PlanSlo, limits: PlanLimits) -> int:  # fmt: skip
    """Requests to simulate per candidate: their arrivals must span ten times a request's
    own latency or the TTFT SLO, whichever is longer. A shorter span is a burst that
    enough instances absorb at any rate: no queue, nor a full decode batch, has time to
    show (a 200-request plan at 1e9 req/s "met" the SLOs with 124 devices)."""
    span_s = 10 * max(one.prefill_s + output * one.decode_floor_s, slo.ttft_s)
    needed = math.ceil(rate * span_s)
    given = limits.num_requests
    if given is not None and given < needed:
        raise InvalidArgumentError(
            "num_requests", f"{given} requests at {rate:g} req/s (with headroom) arrive within "
            f"{given / rate:.3g} s, too short for queues to show (ten times a request's own "
            f"latency or the TTFT SLO: {span_s:.3g} s): give at least {needed}",
        )  # fmt: skip
    if given is None and needed > MAX_REQUESTS:
        raise InvalidArgumentError(
            "rate", f"region {region}: {rate:g} req/s (with headroom) needs {needed} simulated requests a "
            f"candidate to show queues ({span_s:.3g} s of arrivals), over the {MAX_REQUESTS} "
            "the planner simulates by itself: plan a share of the traffic (the rate over k) "
            "and multiply the counts by k, or pass --num-requests",
        )  # fmt: skip
    return given if given is not None else max(MIN_REQUESTS, needed)


def _missed(o: Outcome, slo: PlanSlo, role: str, cap: int, tp: tuple[int, int],
            limits: PlanLimits) -> None:  # fmt: skip
    q = f"p{slo.percentile:g}"
    if o.ttft_s > slo.ttft_s:
        what = (f"TTFT {q} SLO {_ms(slo.ttft_s)} cannot be met: {_ms(o.ttft_s)} "
                f"({_ms(o.ttft_s - slo.ttft_s)} over)")  # fmt: skip
    elif o.failed:
        what = f"{o.failed} requests were refused (no decode instance had room for their KV)"
    else:
        what = (f"TPOT {q} SLO {_ms(slo.tpot_s)} cannot be met: {_ms(o.tpot_s)} "
                f"({_ms(o.tpot_s - slo.tpot_s)} over)")  # fmt: skip
    raise Infeasible(
        "slo", f"{what} with {o.prefill} prefill (tp={tp[0]}) and {o.decode} decode (tp={tp[1]}) "
        f"instances, the most {limits.max_devices} devices allow ({role} at its limit of {cap})",
    )  # fmt: skip


def plan_region(book: ProfileBook, region: str, rate: float, mix: LengthMix, limits: PlanLimits,
                slo: PlanSlo, peak_bw: float, pool: Pool | None = None) -> RegionPlan:  # fmt: skip
    """The cheapest feasible layout and counts for ``rate`` requests/s of ``mix``."""
    if not rate > 0:
        raise InvalidArgumentError("rate", f"region {region}: forecast rate must be > 0")
    best: RegionPlan | None = None
    errors: list[str] = []
    for tp_p in limits.prefill_tp:
        for tp_d in limits.decode_tp:
            try:
                plan = plan_layout(
                    book, region, rate, mix, (tp_p, tp_d), limits, slo, peak_bw, pool
                )
            except Infeasible as e:
                errors.append(f"tp={tp_p}/{tp_d}: {e.message}")
                continue
            key = (plan.devices, -plan.at_forecast.goodput_rps)
            if best is None or key < (best.devices, -best.at_forecast.goodput_rps):
                if best is not None:
                    errors.append(f"tp={best.prefill_tp}/{best.decode_tp}: {best.devices} devices")
                best = plan
            else:
                errors.append(f"tp={tp_p}/{tp_d}: {plan.devices} devices")
    if best is None:
        raise Infeasible("slo", f"region {region} at {rate:g} req/s: " + "; ".join(errors))
    best.tried.extend(errors)
    return best
