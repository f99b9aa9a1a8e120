"""What a traffic-shift replay reports, simulated or live: per policy, SLO attainment
(all, and after the switch), when the first prefill instance was asked for and when
one was serving after the switch, device-seconds (:func:`figures`); the comparison
table; P:D over time, one panel per policy (:func:`plot_policies`); and the workload
as a trace CSV that ``pdserve bench serve --trace`` replays (:func:`write_trace`).
"""

from __future__ import annotations

import csv
import itertools
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.sim.workload import SimWorkload


def write_trace(work: SimWorkload, path: Path) -> Path:
    """The workload as a ``TIMESTAMP, ContextTokens, GeneratedTokens`` CSV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    base = np.datetime64("2026-01-01T00:00:00", "us")
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for t, p, o in zip(work.arrival_s, work.prompt_len, work.output_len, strict=True):
            stamp = base + np.timedelta64(round(float(t) * 1e6), "us")
            out.writerow([str(stamp).replace("T", " "), int(p), int(o)])
    return path


def _count(row: dict[str, Any], role: str) -> int:
    return sum(v for k, v in row.items() if k.endswith(f".{role}"))


def figures(
    met: np.ndarray,
    arrival: np.ndarray,
    counts: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
    switch_s: float,
) -> dict[str, Any]:
    """One policy's figures: SLO attainment, reaction to the switch, device-seconds.
    ``met`` and ``arrival``: per request; ``counts``: serving instances over time
    (``t_s`` and ``{region}.{role}`` keys); ``decisions``: ``t_s`` and ``action``."""
    after = arrival >= switch_s
    before = [r for r in counts if r["t_s"] <= switch_s]
    base_p = _count(before[-1], "prefill") if before else 0
    served = next(
        (r["t_s"] for r in counts if r["t_s"] > switch_s and _count(r, "prefill") > base_p), None
    )
    asked = next(
        (d["t_s"] for d in decisions if d["t_s"] > switch_s and d["action"] == "add_prefill"), None
    )
    device_s = sum(
        (b["t_s"] - a["t_s"]) * (_count(a, "prefill") + _count(a, "decode"))
        for a, b in itertools.pairwise(counts)
    )
    return {
        "requests": len(met),
        "slo_met": round(float(met.mean()), 4) if len(met) else 0.0,
        "slo_missed": int((~met).sum()),
        "slo_met_after_switch": round(float(met[after].mean()), 4) if after.any() else None,
        "slo_missed_after_switch": int((~met[after]).sum()),
        "first_add_prefill_after_switch_s": None if asked is None else round(asked - switch_s, 1),
        "more_prefill_serving_after_s": None if served is None else round(served - switch_s, 1),
        "device_s": round(device_s, 1),
        "decisions": len(decisions),
        "end_counts": {k: v for k, v in counts[-1].items() if "." in k} if counts else {},
    }


def plot_policies(
    counts: dict[str, list[dict[str, Any]]],
    starts: list[float],
    traces: list[str],
    path: Path,
    clock: str = "virtual time",
    beside: dict[str, list[dict[str, Any]]] | None = None,
) -> Path:
    """Prefill and decode instances over time (``counts``: each policy's rows), one
    panel per policy; ``beside``: each policy's simulated rows, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(counts), 1, figsize=(8, 2.6 * len(counts)), sharex=True)
    axes = np.atleast_1d(axes)
    for ax, (policy, rows) in zip(axes, counts.items(), strict=True):
        times = [r["t_s"] for r in rows]
        for role, color in (("prefill", "C0"), ("decode", "C1")):
            ax.step(times, [_count(r, role) for r in rows], where="post", label=role, color=color)
            sim = (beside or {}).get(policy, [])
            if sim:
                ax.step(
                    [r["t_s"] for r in sim],
                    [_count(r, role) for r in sim],
                    where="post",
                    color=color,
                    ls="--",
                    alpha=0.7,
                    label=f"{role}, simulated",
                )
        for start, name in zip(starts, traces, strict=True):
            ax.axvline(start, color="grey", lw=0.8, ls="--")
            ax.text(start, ax.get_ylim()[1], f" {name}", va="top", fontsize=8, color="grey")
        ax.set_ylabel("instances")
        ax.set_title(f"{policy} planner", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="center right")
    axes[-1].set_xlabel(f"{clock} (s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def startup_seen(counts: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> float | None:
    """The median seconds from an add decision to its role's count rising (``counts``
    and ``decisions`` as :func:`figures` takes them); None without such a pair."""
    delays = []
    for d in decisions:
        role = d["action"].removeprefix("add_")
        before = [r for r in counts if r["t_s"] <= d["t_s"]]
        if role == d["action"] or not before:
            continue
        base = _count(before[-1], role)
        up = next(
            (r["t_s"] for r in counts if r["t_s"] > d["t_s"] and _count(r, role) > base), None
        )
        if up is not None:
            delays.append(up - d["t_s"])
    return float(np.median(delays)) if delays else None


def latency_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """TTFT and TPOT p50/p90 (ms) and the failed requests of a run's summary."""
    out = {f"{k}_{q}": summary[f"{k}_ms"][q] for k in ("ttft", "tpot") for q in ("p50", "p90")}
    return {**out, "failed": summary["num_failed"]}


def beside_table(results: dict[str, dict[str, Any]]) -> str:
    """Each policy's live figures beside its simulation's (``results[policy]`` and its
    ``simulated`` entry): SLO attainment, latency percentiles, failed requests."""
    cols = [
        "slo_met",
        "slo_met_after_switch",
        "ttft_p50",
        "ttft_p90",
        "tpot_p50",
        "tpot_p90",
        "failed",
    ]
    lines = ["| policy | run | " + " | ".join(cols) + " |", "| --- | --- |" + " ---: |" * len(cols)]
    for policy, live in results.items():
        for label, r in (("live", live), ("simulated", live["simulated"])):
            values = {**r, **latency_figures(r["summary"])}
            lines.append(
                f"| {policy} | {label} | " + " | ".join(str(values[c]) for c in cols) + " |"
            )
    return "\n".join(lines)


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    cols = [
        ("slo_met", "SLO met"),
        ("slo_met_after_switch", "met after switch"),
        ("slo_missed_after_switch", "missed after switch"),
        ("first_add_prefill_after_switch_s", "add_prefill after (s)"),
        ("more_prefill_serving_after_s", "more prefill serving after (s)"),
        ("device_s", "device-s"),
        ("decisions", "decisions"),
    ]
    lines = [
        "| policy | " + " | ".join(c for _, c in cols) + " |",
        "| --- |" + " --- |" * len(cols),
    ]
    for policy, r in results.items():
        lines.append(f"| {policy} | " + " | ".join(str(r[k]) for k, _ in cols) + " |")
    return "\n".join(lines)
