"""The figures the simulator is judged by: TTFT and TPOT p50 and p90 of a ``pdserve
bench serve`` summary (or a simulated one, key by key the same)."""

from __future__ import annotations

from typing import Any

FIGURES = [(metric, q) for metric in ("ttft_ms", "tpot_ms") for q in ("p50", "p90")]
KEYS = tuple(f"{metric[:4]}_{q}" for metric, q in FIGURES)  # ttft_p50, ttft_p90, ...


def figure(summary: dict[str, Any], metric: str, q: str) -> float | None:
    """``summary[metric][q]`` as a float; None where the run has none (no request ended)."""
    value = summary.get(metric, {}).get(q)
    return None if value is None else float(value)


def mean_figures(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT and TPOT p50 and p90, each the mean over ``summaries`` (runs of one point)."""
    out: dict[str, Any] = {}
    for metric, q in FIGURES:
        values = [v for v in (figure(s, metric, q) for s in summaries) if v is not None]
        out.setdefault(metric, {})[q] = sum(values) / len(values) if values else None
    return out
