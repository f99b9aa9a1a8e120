"""Colocated or disaggregated: each layout planned per region, and the cheaper one chosen.

:func:`choose_regions` plans every region of a forecast in each layout asked for
(:func:`~pdserve.sim.plan.plan_region`: disaggregated prefill and decode
instances, or colocated instances that prefill their own prompts) and
recommends, per region, the plan of fewest devices; at a tie, the one of the
higher SLO attainment at the forecast (then colocated: no KV hand-off). Each
:class:`LayoutChoice` keeps every layout's plan, or why it is infeasible, and
says why the others lost. A region fails only when every layout is infeasible.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.build import ProfileBook
from pdserve.sim.plan import (
    LAYOUTS,
    Infeasible,
    LengthMix,
    PlanLimits,
    PlanSlo,
    Pool,
    RegionPlan,
    plan_region,
    side_by_side,
)

__all__ = ["LayoutChoice", "choose", "choose_regions", "layouts_from"]


def layouts_from(text: str) -> tuple[str, ...]:
    """``--layout``'s value as the layouts to plan: ``both`` is every layout."""
    if text == "both":
        return LAYOUTS
    if text not in LAYOUTS:
        raise InvalidArgumentError(
            "layout", f"must be colocated, disaggregated or both, got {text!r}"
        )
    return (text,)


@dataclass(frozen=True)
class LayoutChoice:
    """One region's plans by layout (a plan, or why that layout is infeasible), the
    recommended plan, and why each other layout lost."""

    region: str
    plans: dict[str, RegionPlan | Infeasible]
    chosen: RegionPlan
    why: tuple[str, ...]


def _key(p: RegionPlan) -> tuple[int, float, bool]:
    return (p.devices, -p.at_forecast.attainment, p.layout != "colocated")


def _lost(layout: str, plan: RegionPlan | Infeasible, chosen: RegionPlan) -> str:
    """Why ``layout`` lost to the chosen plan."""
    if isinstance(plan, Infeasible):
        return f"{layout} is infeasible: {plan.message}"
    if plan.devices != chosen.devices:
        return f"{layout} needs {plan.devices} devices against {chosen.devices}"
    a, b = plan.at_forecast.attainment, chosen.at_forecast.attainment
    if a != b:
        return (
            f"{layout} needs the same {plan.devices} devices but meets both SLOs for "
            f"{a:.1%} of requests against {b:.1%}"
        )
    return f"{layout} ties on devices and attainment: colocated runs without a KV hand-off"


def choose(region: str, plans: dict[str, RegionPlan | Infeasible]) -> LayoutChoice:
    """The recommended layout of one region; Infeasible if every layout is."""
    feasible = [p for p in plans.values() if isinstance(p, RegionPlan)]
    if not feasible:
        raise Infeasible(
            "slo",
            f"region {region}: no layout meets the SLOs: "
            + "; ".join(
                f"{layout}: {e.message}" for layout, e in plans.items() if isinstance(e, Infeasible)
            ),
        )
    chosen = min(feasible, key=_key)
    why = tuple(_lost(layout, p, chosen) for layout, p in plans.items() if p is not chosen)
    return LayoutChoice(region, plans, chosen, why)


def choose_regions(
    book: ProfileBook,
    forecast: dict[str, float],
    mix: LengthMix,
    limits: PlanLimits,
    slo: PlanSlo,
    peak_bw: float,
    pool: Pool | None = None,
    layouts: tuple[str, ...] = LAYOUTS,
) -> list[LayoutChoice]:
    """Each region's peak rate planned in each of ``layouts`` (all at once, with a
    ``pool``), and the cheaper plan recommended; the first region, in the forecast's
    order, with every layout infeasible raises."""
    items = [(region, layout) for region in forecast for layout in layouts]

    def attempt(item: tuple[str, str], share: Pool | None) -> RegionPlan:
        region, layout = item
        rate = forecast[region]
        return plan_region(book, region, rate, mix, limits, slo, peak_bw, share, layout)

    results = side_by_side(attempt, items, pool, Infeasible)
    by_region: dict[str, dict[str, RegionPlan | Infeasible]] = {r: {} for r in forecast}
    for (region, layout), plan in zip(items, results, strict=True):
        by_region[region][layout] = plan
    return [choose(region, plans) for region, plans in by_region.items()]
