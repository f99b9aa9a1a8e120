"""Serving-benchmark arithmetic and output: per-request latencies, summaries, JSON, plots.

A request's stream arrives as chunks; each chunk has an arrival time (seconds
after the request was sent) and a number of tokens. From them:

- TTFT: send to the first chunk that holds a token;
- ITL: the gap before each later chunk, divided by its token count and counted
  once per token (tokens of the first chunk have no gap of their own);
- TPOT: ``(e2e - ttft) / (n_out - 1)``, undefined for one output token;
- e2e: send to the end of the stream.

A request meets the SLOs when it succeeded, its TTFT is within the TTFT SLO and
its TPOT (when defined) within the TPOT SLO. Attainment is the share of the
measured requests that meet them (failures count against it); goodput is how
many met them per second of the measurement window, which runs from the first
send to the last completion. The arithmetic here is pure; plotting imports
matplotlib (Agg) only when called.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.compact_json import dumps
from pdserve.core.errors import InvalidArgumentError

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds; None: no objective on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidArgumentError(f"{name[:4]}_slo_ms", f"must be > 0, got {value * 1e3}")


@dataclass
class RequestRecord:
    """One measured request; times in seconds (``scheduled_s``/``sent_s`` from the run's start)."""

    index: int
    scheduled_s: float
    sent_s: float
    prompt_len: int | None
    max_tokens: int
    ok: bool
    error: str | None = None
    output_len: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens_per_chunk_estimated: bool = False

    @property
    def end_s(self) -> float:
        return self.sent_s + (self.e2e_s or 0.0)


def spread_counts(total: int, num_chunks: int) -> list[int]:
    """``total`` tokens spread as evenly as whole numbers allow over ``num_chunks``."""
    if num_chunks <= 0:
        return []
    edges = np.rint(np.linspace(0, total, num_chunks + 1)).astype(np.int64)
    return [int(c) for c in np.diff(edges)]


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token gaps, one for each token after the first: a chunk of k tokens after a
    gap g gives k samples of g/k; tokens that came in the first token's chunk (the
    router holds a decode instance's tokens until the prefill's first one is in) came
    with no wait, 0 each. The samples sum to the last chunk's time less the first's."""
    out: list[float] = []
    previous: float | None = None
    for at, k in zip(chunk_times, chunk_tokens, strict=True):
        if k <= 0:
            continue
        if previous is not None:
            out.extend([(at - previous) / k] * k)
        else:
            out.extend([0.0] * (k - 1))
        previous = at
    return out


def make_record(
    index: int,
    scheduled_s: float,
    sent_s: float,
    prompt_len: int | None,
    max_tokens: int,
    chunk_times: Sequence[float],
    chunk_tokens: Sequence[int | None],
    e2e_s: float,
    reported_output_len: int | None = None,
) -> RequestRecord:
    """A successful request from its chunks (times from its send). Chunks whose token
    count is unknown (None) share ``reported_output_len`` evenly, the first taking one."""
    counts: list[int]
    estimated = any(k is None for k in chunk_tokens)
    if estimated:
        total = reported_output_len if reported_output_len is not None else len(chunk_tokens)
        if len(chunk_tokens) > 1:
            counts = [1, *spread_counts(total - 1, len(chunk_tokens) - 1)]
        else:
            counts = [total] * len(chunk_tokens)
    else:
        counts = [int(k) for k in chunk_tokens if k is not None]
    n_out = sum(counts)
    firsts = [t for t, k in zip(chunk_times, counts, strict=True) if k > 0]
    ttft = firsts[0] if firsts else None
    tpot = (e2e_s - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else None
    return RequestRecord(
        index,
        scheduled_s,
        sent_s,
        prompt_len,
        max_tokens,
        ok=ttft is not None,
        error=None if ttft is not None else "the stream ended without a token",
        output_len=n_out,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e_s,
        itl_s=inter_token_latencies(chunk_times, counts),
        tokens_per_chunk_estimated=estimated,
    )


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    if not record.ok or record.ttft_s is None:
        return False
    if slo.ttft_s is not None and record.ttft_s > slo.ttft_s:
        return False
    return not (slo.tpot_s is not None and record.tpot_s is not None and record.tpot_s > slo.tpot_s)


def percentiles(values: Sequence[float], points: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """``{"mean", "p50", ...}`` (linear interpolation between ranks); {} for no values."""
    if len(values) == 0:
        return {}
    data = np.asarray(values, dtype=np.float64)
    out = {"mean": float(data.mean())}
    for p, v in zip(points, np.percentile(data, points), strict=True):
        out[f"p{p:g}"] = float(v)
    return out


def attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    return sum(meets_slo(r, slo) for r in records) / len(records) if records else 0.0


def measurement_window(records: Sequence[RequestRecord]) -> float:
    """First send to last completion, over the measured requests."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.sent_s for r in records)


def goodput(records: Sequence[RequestRecord], slo: Slo, window_s: float | None = None) -> float:
    window = measurement_window(records) if window_s is None else window_s
    return sum(meets_slo(r, slo) for r in records) / window if window > 0 else 0.0


def summarize(records: Sequence[RequestRecord], slo: Slo) -> dict[str, Any]:
    """Counts, throughput, latency percentiles (ms), attainment and goodput."""
    ok = [r for r in records if r.ok]
    window = measurement_window(records)
    errors = Counter(r.error for r in records if not r.ok)
    scheduled = [r.scheduled_s for r in records]
    span = max(scheduled) - min(scheduled) if len(scheduled) > 1 else 0.0

    def ms(values: Sequence[float]) -> dict[str, float]:
        return {k: round(v * 1e3, 3) for k, v in percentiles(values).items()}

    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "errors": dict(errors.most_common(5)),
        "offered_rate_rps": (len(records) - 1) / span if span > 0 else None,
        "window_s": round(window, 4),
        "throughput_rps": len(ok) / window if window > 0 else 0.0,
        "output_tok_s": sum(r.output_len for r in ok) / window if window > 0 else 0.0,
        "input_tok_s": sum(r.prompt_len or 0 for r in ok) / window if window > 0 else 0.0,
        "ttft_ms": ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": {
            "ttft_ms": None if slo.ttft_s is None else slo.ttft_s * 1e3,
            "tpot_ms": None if slo.tpot_s is None else slo.tpot_s * 1e3,
        },
        "attainment": attainment(records, slo),
        "goodput_rps": goodput(records, slo, window),
    }


def max_rate_meeting(
    rates: Sequence[float], attainments: Sequence[float], target: float = 0.9
) -> float | None:
    """The highest swept rate at which this and every lower rate reached ``target``."""
    best: float | None = None
    for rate, value in sorted(zip(rates, attainments, strict=True)):
        if value < target:
            break
        best = rate
    return best


# -- output ---------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """The machine a result came from. Loads no torch: the simulator and the load
    generator need none, and its import is seconds of a short run."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        if hasattr(os, "sysconf")
        else None,
        "gpu": _gpu_name(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),  # a dependency: always there
    }


def _gpu_name() -> str | None:
    """The first GPU's name: torch's where the process runs it already, else nvidia-smi's."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.splitlines()[0].strip()


def header(command: str) -> dict[str, Any]:
    """What every result file starts with: the command, the date, the machine."""
    return {
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
    }


def records_json(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Each record's fields (its per-token gaps shared, not copied: ``asdict`` copied
    every float of them one by one)."""
    return [dict(vars(r)) for r in records]


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """``payload`` as JSON: indented, each request record or data row on one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(payload))
    return path


def write_with_args(out: str, options: object, results: dict[str, Any]) -> Path:
    """``results`` after the command's options (a dataclass of them), as JSON at
    ``out``; says where."""
    from pdserve.core.options import flat_options

    path = write_json(Path(out), {"args": flat_options(options), **results})
    print(f"wrote {path}")
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(
    runs: dict[str, Sequence[RequestRecord]], slo: Slo, path: Path, title: str = ""
) -> Path:
    """TTFT and TPOT CDFs, one line per run, the SLOs as dashed lines."""
    plt = _pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name, limit in ((axes[0], "ttft_s", slo.ttft_s), (axes[1], "tpot_s", slo.tpot_s)):
        for label, records in runs.items():
            values = [getattr(r, name) * 1e3 for r in records if getattr(r, name) is not None]
            if values:
                ax.ecdf(values, label=label)
        if limit is not None:
            ax.axvline(limit * 1e3, color="grey", linestyle="--", label="SLO")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(f"{name[:-2].upper()} (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, title)


def _save(plt: Any, fig: Any, path: Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_goodput_vs_rate(
    series: dict[str, Sequence[tuple[float, dict[str, Any]]]], path: Path, title: str = ""
) -> Path:
    """Goodput and SLO attainment against the offered rate, one line per series;
    ``series[label]`` is a list of (rate, summary)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    top = 0.0
    for label, points in series.items():
        rates = [rate for rate, _ in points]
        top = max(top, *rates)
        left.plot(rates, [s["goodput_rps"] for _, s in points], marker="o", label=label)
        right.plot(rates, [s["attainment"] for _, s in points], marker="o", label=label)
    left.plot([0, top], [0, top], color="grey", linestyle=":", label="offered")
    left.set_ylabel("goodput (req/s within SLO)")
    right.set_ylabel("SLO attainment")
    right.axhline(0.9, color="grey", linestyle="--", label="90%")
    right.set_ylim(0, 1.05)
    for ax in (left, right):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, title)
