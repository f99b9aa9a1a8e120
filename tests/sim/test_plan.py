"""The capacity planner's search: the fewest counts meeting the SLOs, in few simulations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.analytic import DEVICES, model_shape
from pdserve.sim.build import ProfileBook
from pdserve.sim.candidates import Candidates, LayoutCase
from pdserve.sim.cluster import SimCluster
from pdserve.sim.flags import Assumptions
from pdserve.sim.plan import (
    LengthMix,
    PlanLimits,
    PlanSlo,
    open_pool,
    plan_layout,
    plan_regions,
)
from pdserve.sim.search import smallest_near


def _counted(answer: int | None):  # type: ignore[no-untyped-def]
    """A monotone ``fits`` (True from ``answer`` on; never with None) and its calls."""
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return answer is not None and n >= answer

    return fits, calls


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 2), (1, 64), (5, 400), (19, 397)])
def test_smallest_near_finds_the_threshold_from_any_hint(lo: int, hi: int) -> None:
    for answer in sorted({lo, min(lo + 1, hi), (lo + hi) // 2, max(hi - 1, lo), hi}):
        for hint in sorted({lo - 3, lo, answer - 7, answer, answer + 1, answer + 9, hi, hi + 5}):
            fits, calls = _counted(answer)
            assert smallest_near(lo, hint, hi, fits) == answer, (lo, hint, hi, answer)
            assert len(calls) == len(set(calls)), "a count was simulated twice"
            assert all(lo <= n <= hi for n in calls)
            # galloping from the hint: logarithmic in the hint's error, not in the range
            gap = abs(answer - min(max(hint, lo), hi))
            assert len(calls) <= 2 * math.ceil(math.log2(gap + 1)) + 2, (hint, answer, calls)


def test_smallest_near_says_none_when_even_the_limit_misses() -> None:
    fits, calls = _counted(None)
    assert smallest_near(1, 10, 50, fits) is None
    assert calls[-1] == 50 and len(calls) <= 2 * math.ceil(math.log2(41)) + 2


@pytest.mark.parametrize("width", [2, 3, 7])
def test_a_lookahead_names_the_next_calls_and_changes_none(width: int) -> None:
    for answer, hint in ((47, 51), (47, 20), (19, 19), (None, 30)):
        fits, alone = _counted(answer)
        expected = smallest_near(1, hint, 100, fits)
        fits, calls = _counted(answer)
        ahead: list[list[int]] = []
        got = smallest_near(1, hint, 100, fits, ahead.append, width)
        assert (got, calls) == (expected, alone)  # the same calls, in order, and answer
        assert len(ahead) == len(calls)
        for before, call in zip(ahead, calls, strict=True):
            assert before[0] == call and 1 <= len(before) <= width
        # what a pool runs at once covers the calls a width of 3 or more makes two at a time
        if width >= 3:
            assert all(nxt in before for before, nxt in zip(ahead[:-1], calls[1:], strict=True))


def test_a_good_hint_costs_few_calls_where_a_bisection_of_the_range_costs_more() -> None:
    fits, calls = _counted(47)
    assert smallest_near(19, 51, 397, fits) == 47
    assert calls == [51, 50, 48, 44, 46, 47]  # a bisection of [19, 397] takes 10


def test_the_plan_is_the_fewest_counts_an_exhaustive_search_finds() -> None:
    # The planner's rule (fewest decode meeting TPOT with prefill ample, then fewest
    # prefill meeting TTFT, then bump) applied by trying every count from 1 up, on the
    # planner's own memoised simulations: the galloping search must land on the same.
    shape = model_shape("llama-7b")
    book = ProfileBook(shape, [], "h100", Assumptions())
    mix = LengthMix(np.full(64, 1000), np.full(64, 64))
    slo, rate = PlanSlo(ttft_s=0.1, tpot_s=0.012), 150.0
    limits = PlanLimits(max_devices=40, num_requests=1000)
    case = LayoutCase(book, "east", mix, (1, 1), limits, slo)
    plan = plan_layout(case, rate, DEVICES["h100"].mem_bw)
    search = Candidates(case, rate * 1.3, 1000)
    cap = limits.max_devices - 2 - limits.spares  # one instance of the other role, two spares
    ample = min(cap, 2 * plan.textbook.prefill_bare + 1)
    d = next(n for n in range(1, cap + 1) if search.run(ample, n).meets(slo)[1])
    p = next(n for n in range(1, cap + 1) if search.run(n, d).meets(slo)[0])
    while not all(search.run(p, d).meets(slo)):
        p, d = (p, d + 1) if search.run(p, d).meets(slo)[0] else (p + 1, d)
    assert (plan.prefill, plan.decode) == (p + limits.spares, d + limits.spares)
    assert p >= 4 and d >= 3, "too easy a case to tell the searches apart"
    assert plan.simulations < len(search.cache)  # the final run at the forecast included


def test_regions_and_layouts_searched_at_once_plan_what_one_process_plans(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    book = ProfileBook(model_shape("llama-7b"), [], "h100", Assumptions())
    mix = LengthMix(np.full(64, 1000), np.full(64, 64))
    slo = PlanSlo(ttft_s=0.1, tpot_s=0.012)
    limits = PlanLimits(max_devices=40, decode_tp=(1, 2), num_requests=600)
    forecast, bw = {"east": 60.0, "west": 15.0}, DEVICES["h100"].mem_bw
    alone = plan_regions(book, forecast, mix, limits, slo, bw)

    def here(*_: object) -> None:
        raise AssertionError("a candidate was simulated in this process, not in a worker")

    monkeypatch.setattr(SimCluster, "run", here)  # spawned workers import their own
    with open_pool(2) as pool:
        together = plan_regions(book, forecast, mix, limits, slo, bw, pool)
    for a, b in zip(alone, together, strict=True):
        assert (a.region, a.prefill_tp, a.decode_tp, a.prefill, a.decode, a.at_forecast) == (
            b.region,
            b.prefill_tp,
            b.decode_tp,
            b.prefill,
            b.decode,
            b.at_forecast,
        )
        assert a.tried == b.tried and len(a.tried) == 1  # the other decode layout, priced
    # with every region infeasible, the first in the forecast's order raises, as alone
    with open_pool(2) as pool, pytest.raises(InvalidArgumentError, match="region west"):
        plan_regions(
            book,
            {"west": 15.0, "east": 60.0},
            mix,
            limits,
            PlanSlo(ttft_s=0.1, tpot_s=0.004),
            bw,
            pool,
        )
