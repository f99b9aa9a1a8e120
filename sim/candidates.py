"""The capacity planner's candidates: one region's counts simulated at one rate.

:class:`Candidates` simulates a region and layout with ``p`` prefill and ``d``
decode instances at one rate (every candidate on the same arrivals and lengths)
and memoises each :class:`Outcome`. With a :class:`Pool` of worker processes
(:func:`open_pool`) every simulation runs in a worker, and :meth:`Candidates.prefetch`
starts those a search may ask for next; without one they run in this process. A candidate is
its cluster YAML (:func:`cluster_yaml`, what ``pdserve serve`` and ``pdserve sim``
take), so a worker receives text, the profile book and the workload, and returns
an :class:`Outcome`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.report import Slo
from pdserve.cluster.config import parse_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.build import ProfileBook
from pdserve.sim.cluster import SimCluster, SimOptions
from pdserve.sim.options import calibrated_options
from pdserve.sim.workload import SimWorkload

if TYPE_CHECKING:  # the planner's types; pdserve.sim.plan imports this module
    from pdserve.sim.plan import LengthMix, PlanLimits, PlanSlo


@dataclass(frozen=True)
class Outcome:
    """One simulated candidate: its percentiles (s), failures, goodput (requests/s within
    both SLOs) and SLO attainment (the share of requests within both)."""

    prefill: int
    decode: int
    ttft_s: float
    tpot_s: float
    failed: int
    goodput_rps: float
    attainment: float = math.nan

    def meets(self, slo: PlanSlo) -> tuple[bool, bool]:
        """(TTFT met, TPOT met); a refused request (no decode instance had room for its
        KV) counts against decode."""
        return (self.ttft_s <= slo.ttft_s, self.failed == 0 and self.tpot_s <= slo.tpot_s)


def cluster_yaml(
    model: str,
    region: str,
    prefill: int,
    decode: int,
    tp_p: int,
    tp_d: int,
    limits: PlanLimits,
    slo: PlanSlo,
) -> str:
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
    """Worker processes that simulate candidates; ``workers`` of them are this user's
    share (searches running at once each take a part: :meth:`share`)."""

    executor: Executor
    workers: int

    def share(self, searches: int) -> Pool:
        """The part of the pool each of ``searches`` searches at once may keep busy."""
        return replace(self, workers=max(1, self.workers // max(1, searches)))


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

    executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield Pool(executor, jobs)
    finally:  # on an error too: what no search waits for is not started
        executor.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class LayoutCase:
    """What every candidate of one region and layout shares: the profiles, the region,
    the length mix, the tensor-parallel sizes (prefill, decode), the limits and the SLOs."""

    book: ProfileBook
    region: str
    mix: LengthMix
    tp: tuple[int, int]
    limits: PlanLimits
    slo: PlanSlo


class Candidates:
    """Simulations of one region and layout at one rate (memoised by counts).

    With a pool, :meth:`prefetch` starts the candidates a search may ask for next and
    returns at once; :meth:`run` waits for the one it is asked for. At most the pool's
    share of candidates is in flight, the one asked for first; one that the search no
    longer names is cancelled if it has not started.
    """

    def __init__(self, case: LayoutCase, rate: float, n: int, pool: Pool | None = None) -> None:
        """``n`` requests of the case's mix arrive at ``rate`` requests/s (Poisson)."""
        self.book, self.region = case.book, case.region
        self.tp, self.limits, self.slo, self.pool = case.tp, case.limits, case.slo, pool
        self.cache: dict[tuple[int, int], Outcome] = {}
        self.pending: dict[tuple[int, int], Future[Outcome]] = {}
        self.simulations = 0  # run or started, a cancelled one not counted
        arrival = wl.arrival_times("poisson", rate, n, None, seed=case.limits.seed)
        prompt, output = case.mix.draw(n, case.limits.seed + 1)
        self.work = SimWorkload(arrival, prompt, output, np.zeros(n, dtype=np.int16))

    @property
    def width(self) -> int:
        """Candidates worth simulating at once: the pool's share (1 without one)."""
        return self.pool.workers if self.pool is not None else 1

    def yaml(self, p: int, d: int) -> str:
        return cluster_yaml(
            self.book.model.name, self.region, p, d, *self.tp, self.limits, self.slo
        )

    def run(self, p: int, d: int) -> Outcome:
        c = (p, d)
        if c not in self.cache:
            job = self.pending.pop(c, None)
            if job is None and self.pool is not None:
                job = self._submit(c)
            if job is not None:
                self.cache[c] = job.result()
            else:
                self.simulations += 1
                self.cache[c] = simulate_candidate(self.yaml(p, d), self.book, self.work, self.slo)
        return self.cache[c]

    def prefetch(self, counts: Sequence[tuple[int, int]]) -> None:
        """Start the candidates ``counts`` names (the one asked for next first) on the
        pool, within its share; without a pool, nothing (:meth:`run` simulates here)."""
        if self.pool is None:
            return
        wanted = list(dict.fromkeys(counts))
        for c, job in list(self.pending.items()):
            if c not in wanted and job.cancel():
                del self.pending[c]
                self.simulations -= 1
        busy = sum(not job.done() for job in self.pending.values())
        for i, c in enumerate(wanted):
            if c in self.cache or c in self.pending:
                continue
            if i and busy >= self.width:
                break  # the first is the call the search makes now: it always starts
            self.pending[c] = self._submit(c)
            busy += 1

    def close(self) -> None:
        """Cancel the candidates started for a search that has ended."""
        for job in self.pending.values():
            if job.cancel():
                self.simulations -= 1
        self.pending.clear()

    def _submit(self, c: tuple[int, int]) -> Future[Outcome]:
        assert self.pool is not None
        self.simulations += 1
        return self.pool.executor.submit(
            simulate_candidate, self.yaml(*c), self.book, self.work, self.slo
        )


def simulate_candidate(text: str, book: ProfileBook, work: SimWorkload, slo: PlanSlo) -> Outcome:
    """One candidate's percentiles, failures and goodput (a pool worker runs it too)."""
    config = parse_config(text, "<plan>")
    # a calibrated profile's per-request cost, its noise and the shared host count here
    # as in pdserve sim: the plan promises what a served request meets
    options = SimOptions(
        fast=True, keep_itl=False, planner=False, **calibrated_options(book.profiles)
    )
    sim = SimCluster(config, book, work, options)
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
        region.prefill.count,
        region.decode.count,
        float(np.percentile(ttft, q)) if len(ttft) else math.inf,
        float(np.percentile(tpot, q)) if len(tpot) else 0.0,
        int((~ok).sum()),
        float(meets.sum()) / window if window > 0 else 0.0,
        float(meets.mean()) if len(meets) else 0.0,
    )
