"""What a serving benchmark sends, and when: arrival schedules, length mixes, traces.

Everything here is a pure function of its arguments (and a seed), so a
workload can be rebuilt exactly and tested on known inputs:

- :func:`arrival_times`: Poisson, fixed-interval or bursty arrivals at a mean rate;
- :func:`read_trace` / :func:`scale_trace`: a production trace (CSV with
  ``TIMESTAMP, ContextTokens, GeneratedTokens``) as arrival offsets and
  lengths, scaled in time and length for small models;
- :func:`sample_lengths` and :func:`synthetic_prompt`: length mixes and token
  ids for synthetic prompts;
- :func:`read_jsonl`: prompts from a file of ``{"prompt", "max_tokens"}`` lines.

A :class:`RequestSpec` is one request of the workload; the load generator
sends it at ``arrival_s`` after the measured run starts.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TextIO

import numpy as np

from pdserve.core.errors import InvalidArgumentError

ARRIVALS = ("poisson", "fixed", "burst")
SHIPPED_TRACES = {
    "azure-code": "azure-llm-inference-2023/code.csv",
    "azure-conv": "azure-llm-inference-2023/conv.csv",
}
FIRST_TOKEN_ID = 3  # ids 0..2 may be special (pad, bos, eos) in the built-in tokenizer
DEFAULT_NUM_REQUESTS = 100  # measured requests when neither a count nor a duration is given


@dataclass(frozen=True)
class RequestSpec:
    """One request: sent ``arrival_s`` after the start; a prompt as ids or as text."""

    index: int
    arrival_s: float
    max_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None


@dataclass(frozen=True)
class WorkloadFlags:
    """The workload flags of ``pdserve bench serve`` (``add_workload_flags`` of
    :mod:`pdserve.bench.serve`), which the simulator's commands share."""

    arrival: str = "poisson"  # how requests arrive at a rate: one of ARRIVALS
    burst_size: int = 8  # requests per burst (arrival "burst")
    trace: str | None = None  # a CSV trace, or a shipped one's name, replayed
    time_scale: float = 1.0  # trace arrival offsets are multiplied by this
    length_scale: float = 1.0  # trace lengths are multiplied by this
    prompts: str | None = None  # a JSONL file of prompts
    prompt_len: int = 512  # mean prompt length (tokens)
    prompt_len_std: float = 0.0  # normal spread of prompt lengths
    prompt_len_range: list[int] | None = None  # uniform prompt lengths in [LO, HI]
    output_len: int = 32  # mean output length (tokens)
    output_len_std: float = 0.0  # normal spread of output lengths
    output_len_range: list[int] | None = None  # uniform output lengths in [LO, HI]
    max_prompt_len: int | None = None  # clamp prompt lengths
    max_output_len: int | None = None  # clamp output lengths
    vocab_size: int = 256  # synthetic prompt ids are in [3, this)
    num_requests: int | None = None  # measured requests per rate (None: DEFAULT_NUM_REQUESTS)
    duration: float | None = None  # send for this many seconds per rate
    warmup: int = 2  # requests sent first and not measured
    seed: int = 0  # seeds arrivals and lengths
    prompt_seed: int | None = None  # seeds synthetic token ids (None: drawn once per run)
    temperature: float = 0.0  # sampling temperature of every request


@dataclass(frozen=True)
class Trace:
    """Arrival offsets (seconds from the first request) and lengths, one entry a request."""

    arrival_s: np.ndarray  # [N] float64, non-decreasing, arrival_s[0] == 0
    prompt_len: np.ndarray  # [N] int64
    output_len: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return len(self.arrival_s)


def arrival_times(
    kind: str,
    rate: float,
    num_requests: int | None = None,
    duration_s: float | None = None,
    burst_size: int = 8,
    seed: int = 0,
) -> np.ndarray:
    """Send offsets (seconds, from 0) of ``num_requests`` requests, or of every request
    that arrives before ``duration_s``, at a mean of ``rate`` requests per second.

    ``poisson``: exponential gaps; ``fixed``: one every ``1/rate`` s exactly;
    ``burst``: groups of ``burst_size`` sent at once, a group every ``burst_size/rate`` s.
    A rate of ``inf`` sends everything at 0.
    """
    if kind not in ARRIVALS:
        raise InvalidArgumentError("arrival", f"must be one of {ARRIVALS}, got {kind!r}")
    if not rate > 0:
        raise InvalidArgumentError("rate", f"must be > 0, got {rate}")
    if (num_requests is None) == (duration_s is None):
        raise InvalidArgumentError("num_requests", "give exactly one of num_requests and duration")
    check_limits(num_requests, duration_s)
    if math.isinf(rate) and duration_s is not None:
        raise InvalidArgumentError(
            "duration", "an infinite rate sends everything at once: use num_requests"
        )
    if burst_size < 1:
        raise InvalidArgumentError("burst_size", "must be >= 1")
    n = num_requests if num_requests is not None else _count_upper_bound(rate, duration_s)
    times: np.ndarray
    if math.isinf(rate):
        times = np.zeros(n)
    elif kind == "fixed":
        times = np.arange(n) / rate
    elif kind == "burst":
        times = (np.arange(n) // burst_size) * (burst_size / rate)
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
        times = np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if n else np.zeros(0)
    if duration_s is not None:
        times = times[times < duration_s]
    return times.astype(np.float64)


def _count_upper_bound(rate: float, duration_s: float | None) -> int:
    assert duration_s is not None
    mean = rate * duration_s  # Poisson count: mean + 10 sigma + slack is never exceeded in practice
    return int(mean + 10 * math.sqrt(mean) + 16)


def sample_lengths(
    n: int,
    mean: int,
    std: float = 0.0,
    value_range: Sequence[int] | None = None,
    low: int = 1,
    high: int | None = None,
    seed: int = 0,
    name: str = "length",
) -> np.ndarray:
    """``n`` lengths: uniform over ``value_range`` (inclusive) when given, else
    normal(``mean``, ``std``) rounded; clipped to ``[low, high]``. ``name``: the
    flag a bad value is reported under (``prompt_len``, ``output_len``)."""
    rng = np.random.default_rng(seed)
    if high is not None and high < max(low, 1):
        raise InvalidArgumentError(f"max_{name}", f"must be >= {max(low, 1)}, got {high}")
    if value_range is not None:
        lo, hi = value_range
        if not 1 <= lo <= hi:
            raise InvalidArgumentError(f"{name}_range", f"needs 1 <= low <= high, got {lo}..{hi}")
        values = rng.integers(lo, hi + 1, size=n)
    elif not mean >= 1:
        raise InvalidArgumentError(name, f"must be >= 1, got {mean}")
    elif not std >= 0:
        raise InvalidArgumentError(f"{name}_std", f"must be >= 0, got {std}")
    elif std > 0:
        values = np.rint(rng.normal(mean, std, size=n)).astype(np.int64)
    else:
        values = np.full(n, mean, dtype=np.int64)
    return np.clip(values, low, high if high is not None else np.iinfo(np.int64).max)


def flag_lengths(args: WorkloadFlags, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` prompt and output lengths as the workload flags ask (``add_workload_flags`` of
    :mod:`pdserve.bench.serve`): prompts drawn with ``seed``, outputs with ``seed + 1``."""
    prompt = sample_lengths(
        n,
        args.prompt_len,
        args.prompt_len_std,
        args.prompt_len_range,
        1,
        args.max_prompt_len,
        seed,
        "prompt_len",
    )
    output = sample_lengths(
        n,
        args.output_len,
        args.output_len_std,
        args.output_len_range,
        1,
        args.max_output_len,
        seed + 1,
        "output_len",
    )
    return prompt, output


def synthetic_prompt(length: int, vocab_size: int, rng: np.random.Generator) -> tuple[int, ...]:
    """Random token ids in ``[3, vocab_size)``: no two prompts share a cached prefix."""
    if vocab_size <= FIRST_TOKEN_ID:
        raise InvalidArgumentError("vocab_size", f"must be > {FIRST_TOKEN_ID}")
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, size=length))


def trace_path(name: str) -> Path:
    """A shipped trace by name (``azure-code``, ``azure-conv``), or a CSV file path."""
    if name in SHIPPED_TRACES:
        return Path(str(resources.files("pdserve.bench") / "data" / SHIPPED_TRACES[name]))
    path = Path(name).expanduser()
    if not path.is_file():
        raise InvalidArgumentError(
            "trace", f"no such file: {name} (shipped traces: {sorted(SHIPPED_TRACES)})"
        )
    return path


@contextlib.contextmanager
def text_file(path: str | Path, field: str) -> Iterator[TextIO]:
    """``path`` read as UTF-8 text; a missing file, or one that is not text (found
    while it is read), is refused naming ``field``."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            yield f
    except FileNotFoundError:
        raise InvalidArgumentError(field, f"no such file: {path}") from None
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(field, f"{path}: not UTF-8 text ({e.reason})") from None


def read_trace(path: str | Path) -> Trace:
    """Parse a ``TIMESTAMP, ContextTokens, GeneratedTokens`` CSV, sorted by arrival."""
    stamps: list[str] = []
    prompt: list[int] = []
    output: list[int] = []
    with text_file(path, "trace") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        want = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        if any(name not in header for name in want):
            raise InvalidArgumentError(
                "trace", f"{path}: needs columns {', '.join(want)}; found {header}"
            )
        cols = [header.index(name) for name in want]
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                stamps.append(row[cols[0]].strip().replace(" ", "T"))
                prompt.append(int(row[cols[1]]))
                output.append(int(row[cols[2]]))
            except (IndexError, ValueError) as e:
                raise InvalidArgumentError("trace", f"{path}:{line}: {e}") from None
            if prompt[-1] < 0 or output[-1] < 0:  # 0 is kept: a length scales to at least 1
                name = want[1] if prompt[-1] < 0 else want[2]
                raise InvalidArgumentError("trace", f"{path}:{line}: {name} is negative")
    if not stamps:
        raise InvalidArgumentError("trace", f"{path}: no requests")
    try:
        ns = np.array(stamps, dtype="datetime64[ns]").astype(np.int64)
    except ValueError as e:
        raise InvalidArgumentError("trace", f"{path}: bad TIMESTAMP: {e}") from None
    order = np.argsort(ns, kind="stable")
    ns = ns[order]
    return Trace(
        arrival_s=(ns - ns[0]) / 1e9,
        prompt_len=np.asarray(prompt, dtype=np.int64)[order],
        output_len=np.asarray(output, dtype=np.int64)[order],
    )


def scale_trace(
    trace: Trace,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
    rate: float | None = None,
) -> Trace:
    """Stretch arrival offsets by ``time_scale`` (0.5: twice as fast), or, when ``rate``
    is given, to that mean rate; multiply lengths by ``length_scale`` (at least 1
    token) and clamp them."""
    for name, scale in (("time_scale", time_scale), ("length_scale", length_scale)):
        if not scale > 0:
            raise InvalidArgumentError(name, f"must be > 0, got {scale}")
    for name, cap in (("max_prompt_len", max_prompt_len), ("max_output_len", max_output_len)):
        if cap is not None and cap < 1:
            raise InvalidArgumentError(name, f"must be >= 1, got {cap}")
    arrival = trace.arrival_s
    if rate is not None:
        span = float(arrival[-1]) if len(arrival) > 1 else 0.0
        # n requests over the span: mean gap span/(n-1); at `rate` it is 1/rate
        time_scale = (len(arrival) - 1) / (rate * span) if span > 0 else 1.0
    prompt = np.maximum(1, np.rint(trace.prompt_len * length_scale)).astype(np.int64)
    output = np.maximum(1, np.rint(trace.output_len * length_scale)).astype(np.int64)
    if max_prompt_len is not None:
        prompt = np.minimum(prompt, max_prompt_len)
    if max_output_len is not None:
        output = np.minimum(output, max_output_len)
    return Trace(arrival * time_scale, prompt, output)


def check_limits(num_requests: int | None, duration_s: float | None) -> None:
    """A request count is at least 1 and a duration over 0 (when given)."""
    if num_requests is not None and num_requests < 1:
        raise InvalidArgumentError("num_requests", f"must be >= 1, got {num_requests}")
    if duration_s is not None and not duration_s > 0:
        raise InvalidArgumentError("duration", f"must be > 0, got {duration_s}")


def limit_trace(trace: Trace, num_requests: int | None, duration_s: float | None) -> Trace:
    """The first ``num_requests`` requests, or those arriving before ``duration_s``."""
    check_limits(num_requests, duration_s)
    keep = len(trace)
    if num_requests is not None:
        keep = min(keep, num_requests)
    if duration_s is not None:
        keep = min(keep, int(np.searchsorted(trace.arrival_s, duration_s, side="left")))
    return Trace(trace.arrival_s[:keep], trace.prompt_len[:keep], trace.output_len[:keep])


def flag_schedule(args: WorkloadFlags, rate: float | None) -> Trace:
    """Arrival offsets and lengths of the measured requests the workload flags ask for at
    ``rate``: the ``--trace`` (its first requests, scaled, cut at ``--duration``), or
    ``--arrival`` times with lengths drawn from the length flags (``rate`` required)."""
    num, duration = args.num_requests, args.duration
    if num is None and duration is None:
        num = DEFAULT_NUM_REQUESTS
    if args.trace:
        trace = limit_trace(read_trace(trace_path(args.trace)), num, None)
        trace = scale_trace(
            trace,
            args.time_scale,
            args.length_scale,
            args.max_prompt_len,
            args.max_output_len,
            rate,
        )
        return limit_trace(trace, None, duration)
    if rate is None:
        raise InvalidArgumentError("rate", "is required without --trace")
    arrival = arrival_times(args.arrival, rate, num, duration, args.burst_size, args.seed)
    prompt_len, output_len = flag_lengths(args, len(arrival), args.seed)
    return Trace(arrival, prompt_len, output_len)


def read_jsonl(path: str | Path, default_max_tokens: int) -> list[tuple[str | list[int], int]]:
    """(prompt, max_tokens) per line of ``{"prompt": text or ids, "max_tokens": n}``."""
    out: list[tuple[str | list[int], int]] = []
    with text_file(path, "prompts") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["prompt"]
            except (ValueError, KeyError, TypeError):
                raise InvalidArgumentError(
                    "prompts", f"{path}:{line_no}: needs a JSON object with a 'prompt'"
                ) from None
            if not isinstance(prompt, (str, list)) or not prompt:
                raise InvalidArgumentError(
                    "prompts", f"{path}:{line_no}: 'prompt' must be text or a list of token ids"
                )
            out.append((prompt, int(item.get("max_tokens", default_max_tokens))))
    if not out:
        raise InvalidArgumentError("prompts", f"{path}: no prompts")
    return out


def build_requests(
    arrivals: np.ndarray,
    prompt_lens: np.ndarray | None,
    output_lens: np.ndarray,
    vocab_size: int,
    seed: int | tuple[int, ...] = 0,
    prompts: list[tuple[str | list[int], int]] | None = None,
) -> list[RequestSpec]:
    """Requests from arrival offsets and either synthetic lengths (token ids drawn
    from ``seed``) or file prompts (cycled when there are more arrivals than prompts)."""
    rng = np.random.default_rng(seed)
    specs: list[RequestSpec] = []
    for i, at in enumerate(arrivals):
        if prompts is not None:
            prompt, max_tokens = prompts[i % len(prompts)]
            ids = tuple(prompt) if isinstance(prompt, list) else None
            text = prompt if isinstance(prompt, str) else None
            specs.append(RequestSpec(i, float(at), max_tokens, ids, text))
        else:
            assert prompt_lens is not None
            ids = synthetic_prompt(int(prompt_lens[i]), vocab_size, rng)
            specs.append(RequestSpec(i, float(at), int(output_lens[i]), ids))
    return specs
