"""What ``pdserve sim-validate`` prints: the side-by-side table, then how far the
live steps were from the calibrated step model at each point and what each setup's
calibration found."""

from __future__ import annotations

from typing import Any

TOLERANCE = {"p50": 0.10, "p90": 0.15}  # the bar: relative error of sim vs real


def table(rows: list[dict[str, Any]], key: str = "compare") -> str:
    keys = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
    lines = ["| point | " + " | ".join(f"{k} real / sim ms (error)" for k in keys) + " |",
             "| --- |" + " ---: |" * len(keys)]  # fmt: skip
    for row in rows:
        cells = []
        for k in keys:
            c = row[key][k]
            err = "n/a" if c["error"] is None else f"{c['error']:+.1%}"
            real = "n/a" if c["real"] is None else f"{c['real']:.1f}"
            sim = "n/a" if c["sim"] is None else f"{c['sim']:.1f}"
            cells.append(f"{real} / {sim} ({err}){'' if c['ok'] else ' *'}")
        lines.append(f"| {row['point']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibration_lines(rows: list[dict[str, Any]], calibrations: dict[str, Any]) -> list[str]:
    lines = []
    for row in rows:
        ratios = ", ".join(f"{name} {r['median_ratio']}x" for name, r in row["live_steps"].items())
        lines.append(f"{row['point']}: live steps / calibrated step model (median): {ratios}")
    for setup, c in calibrations.items():
        lines.append(
            f"{setup}: steps' compute x{c['compute_scale']}, the rest x{c['memory_scale']}, "
            f"+ {c['step_offset_ms']} ms; after idling, compute x{1 + c['cold_compute']:.2f} and "
            f"the rest x{1 + c['cold_factor']:.2f}; beside another instance's step, "
            f"x{1 + c['shared_compute']:.2f} and x{1 + c['shared_factor']:.2f} (from "
            f"{c['traced_steps']} traced steps), then +{c['step_overhead_ms']} ms a step, "
            f"+{c['seq_overhead_ms']} ms a sequence of a step, +{c['handoff_overhead_ms']} ms "
            f"a hand-off, +{c['request_overhead_ms']} ms a request (calibrated on single "
            "requests of 32 and 4 tokens, bursts of 8 and 4 req/s)"
        )
    return lines


def _pct(summary: dict[str, Any], metric: str, q: str) -> float | None:
    value = summary.get(metric, {}).get(q)
    return None if value is None else float(value)


def compare_point(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Per metric and percentile: real ms, simulated ms, relative error, within tolerance."""
    out: dict[str, Any] = {}
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p90"):
            r, s = _pct(real, metric, q), _pct(sim, metric, q)
            err = None if not r or s is None else (s - r) / r
            out[f"{metric[:4]}_{q}"] = {
                "real": r, "sim": s, "error": None if err is None else round(err, 4),
                "ok": err is not None and abs(err) <= TOLERANCE[q],
            }  # fmt: skip
    return out
