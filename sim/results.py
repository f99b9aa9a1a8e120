"""What a simulated run measured, per request, and its bench-compatible summaries.

:class:`Recorder` keeps one row per request in preallocated arrays (arrival,
first token, end, tokens, region, outcome), so a run of a million requests
holds tens of megabytes, not a million objects. For runs up to
``records_limit`` requests it turns the rows into
:class:`~pdserve.bench.report.RequestRecord` and summarises them with
:func:`~pdserve.bench.report.summarize`, exactly as ``pdserve bench serve``
does; larger runs are summarised from the arrays with the same keys and the
same percentile arithmetic (per-token ITL samples are kept only when asked).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from pdserve.bench.report import RequestRecord, Slo, percentiles, summarize
from pdserve.cluster.config import ClusterConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.frontdoor.requests import check_prompt_len, fit_context

ERRORS = (
    "",
    "overloaded: no region admitted the request",
    "overloaded: no decode instance had room",
    "invalid: prompt: no room to generate within the context limit",
    "invalid: max_tokens: prompt + max_tokens exceed the context limit",
    "DEADLINE_EXCEEDED: Deadline Exceeded",  # as the gRPC load generator records it
)
TIMED_OUT = 5  # past --request-timeout (sim/timeouts.py)


def refusal(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The error code (``ERRORS``) with which the front door refuses a request of these
    lengths, as ``pdserve bench serve`` sends it (``max_tokens`` set); 0: accepted."""
    if prompt_len + max_tokens <= max_model_len:  # what both checks accept (max_tokens >= 1)
        return 0
    try:
        check_prompt_len("prompt", prompt_len, max_model_len)
        fit_context(SamplingParams(max_tokens=max_tokens), prompt_len, max_model_len, asked=True)
    except InvalidArgumentError as e:
        return 3 if e.field == "prompt" else 4
    return 0


def slo_of(config: ClusterConfig) -> Slo:
    return Slo(config.router.ttft_slo_s, config.router.tpot_slo_s)


@dataclass
class RecordedRows:
    """Some requests' rows of a :class:`Recorder` (one shard's), by workload index."""

    index: np.ndarray  # [k] int64
    region: np.ndarray
    first: np.ndarray
    end: np.ndarray
    tokens: np.ndarray
    error: np.ndarray
    itl: dict[int, array[float]] | None


class Recorder:
    """Per-request outcomes of one run, indexed by the request's workload index."""

    def __init__(
        self,
        arrival: np.ndarray,
        prompt_len: np.ndarray,
        output_len: np.ndarray,
        home: np.ndarray,
        keep_itl: bool,
    ) -> None:
        n = len(arrival)
        self.arrival, self.prompt_len, self.output_len, self.home = (
            arrival,
            prompt_len,
            output_len,
            home,
        )
        self.sent = arrival  # when each was sent: its arrival, unless a gate held it
        self.on_end: Callable[[], None] | None = None  # called as each request ends
        self.region = np.full(n, -1, dtype=np.int16)
        # First-token times and token counts are written per step: the run writes
        # them through these arrays, which share memory with the numpy views.
        self._first = array("d", [np.nan]) * n
        self._tokens = array("i", bytes(4 * n))
        self.first = np.frombuffer(self._first, dtype=np.float64) if n else np.full(0, np.nan)
        self.end = np.full(n, np.nan)
        self.tokens = np.frombuffer(self._tokens, dtype=np.int32) if n else np.zeros(0, np.int32)
        self.error = np.zeros(n, dtype=np.int8)  # index into ERRORS; 0: ok
        self.done = np.zeros(n, dtype=bool)
        # Per request its token gaps, 8 bytes each (a million-token run stays small).
        self.itl: dict[int, array[float]] | None = {} if keep_itl else None
        self._last: dict[int, float] = {}

    def tokens_at(
        self, i: int, count: int, end: float, ends: Sequence[float], gaps: Sequence[float]
    ) -> bool:
        """Request ``i`` got ``count`` tokens, the last at ``end``; True if they are its
        first. With ITL samples kept, ``ends`` are the step ends of the step (or run of
        steps) that made them (its last ``count`` hold this request's tokens) and
        ``gaps`` their successive differences."""
        tokens = self._tokens
        first = tokens[i] == 0
        tokens[i] += count
        if self.itl is None:
            if first:
                self._first[i] = end
            return first
        start = ends[-count]
        if first:
            self._first[i] = start
            samples = self.itl[i] = array("d")
        else:
            samples = self.itl[i]
            samples.append(start - self._last[i])
        if count > 1:
            samples.extend(gaps[len(gaps) - count + 1 :])
        self._last[i] = end
        return first

    def sent_at(self, i: int, at: float) -> None:
        """Request ``i`` was sent at ``at``, after its arrival (a limit on requests in
        flight held it): its latencies count from then."""
        if self.sent is self.arrival:
            self.sent = self.arrival.copy()
        self.sent[i] = at

    def finish(self, i: int, at: float) -> None:
        self.end[i] = at
        self.done[i] = True
        self._last.pop(i, None)
        if self.on_end is not None:
            self.on_end()

    def timed_out(self, i: int, at: float) -> None:
        """Request ``i`` ran past the client's timeout: failed, its tokens dropped, as the
        load generator records a request it gave up on."""
        self._tokens[i] = 0
        self._first[i] = np.nan
        self._last.pop(i, None)
        if self.itl is not None:
            self.itl.pop(i, None)
        self.fail(i, TIMED_OUT, at)

    def fail(self, i: int, code: int, at: float) -> None:
        self.error[i] = code
        self.end[i] = at
        self.done[i] = True
        if self.on_end is not None:
            self.on_end()

    # -- a shard's rows ----------------------------------------------------------------------

    def take(self) -> RecordedRows:
        """The rows of the requests that ended here (a shard's, to merge)."""
        idx = np.flatnonzero(self.done)
        itl = None if self.itl is None else {int(i): self.itl[int(i)] for i in idx if i in self.itl}
        return RecordedRows(
            idx,
            self.region[idx],
            self.first[idx],
            self.end[idx],
            self.tokens[idx],
            self.error[idx],
            itl,
        )

    def put(self, rows: RecordedRows) -> None:
        """Another recorder's rows (a shard's) as this run's."""
        i = rows.index
        self.region[i], self.first[i], self.end[i] = rows.region, rows.first, rows.end
        self.tokens[i], self.error[i], self.done[i] = rows.tokens, rows.error, True
        if self.itl is not None and rows.itl is not None:
            self.itl.update(rows.itl)

    # -- summaries -------------------------------------------------------------------------

    def records(self, select: np.ndarray | None = None) -> list[RequestRecord]:
        idx = np.flatnonzero(self.done if select is None else self.done & select)
        out = []
        for i in idx:
            ok = bool(self.error[i] == 0)
            sent = float(self.sent[i])
            ttft = float(self.first[i]) - sent if ok else None
            e2e = float(self.end[i]) - sent
            n = int(self.tokens[i])
            tpot = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
            out.append(
                RequestRecord(
                    int(i),
                    float(self.arrival[i]),
                    sent,
                    int(self.prompt_len[i]),
                    int(self.output_len[i]),
                    ok,
                    None if ok else ERRORS[self.error[i]],
                    n,
                    ttft,
                    tpot,
                    e2e,
                    list(self.itl.get(int(i), ())) if self.itl is not None else [],
                )
            )
        return out

    def summary(
        self, slo: Slo, select: np.ndarray | None = None, limit: int = 200_000
    ) -> dict[str, Any]:
        mask = self.done if select is None else self.done & select
        if int(mask.sum()) <= limit:
            return summarize(self.records(select), slo)
        return self._array_summary(mask, slo)

    def slo_met(self, slo: Slo) -> np.ndarray:
        """Per request: finished without an error and within both SLOs (None: no SLO)."""
        met = self.done & (self.error == 0)
        n = self.tokens.astype(np.float64)
        with np.errstate(invalid="ignore"):
            if slo.ttft_s is not None:
                met &= self.first - self.sent <= slo.ttft_s
            if slo.tpot_s is not None:
                tpot = np.where(n > 1, (self.end - self.first) / np.maximum(n - 1, 1), 0.0)
                met &= tpot <= slo.tpot_s
        return met

    def _array_summary(self, mask: np.ndarray, slo: Slo) -> dict[str, Any]:
        ok = mask & (self.error == 0)
        arr, n = self.sent, self.tokens.astype(np.float64)
        ttft = self.first[ok] - arr[ok]
        e2e = self.end[mask] - arr[mask]
        e2e_ok = self.end[ok] - arr[ok]
        multi = n[ok] > 1
        tpot = (e2e_ok[multi] - ttft[multi]) / (n[ok][multi] - 1)
        window = float(np.max(self.end[mask]) - np.min(arr[mask])) if mask.any() else 0.0
        meets = self.slo_met(slo)[ok]
        sched = self.arrival[mask]  # the offered rate is the arrivals', as scheduled
        span = float(sched.max() - sched.min()) if mask.sum() > 1 else 0.0
        errors = {ERRORS[c]: int((self.error[mask] == c).sum()) for c in range(1, len(ERRORS))}

        def ms(values: np.ndarray) -> dict[str, float]:
            return {
                k: round(v * 1e3, 3) for k, v in percentiles(cast(Sequence[float], values)).items()
            }

        total = int(mask.sum())
        return {
            "num_requests": total,
            "num_ok": int(ok.sum()),
            "num_failed": total - int(ok.sum()),
            "errors": {k: v for k, v in errors.items() if v},
            "offered_rate_rps": (total - 1) / span if span > 0 else None,
            "window_s": round(window, 4),
            "throughput_rps": int(ok.sum()) / window if window > 0 else 0.0,
            "output_tok_s": float(n[ok].sum()) / window if window > 0 else 0.0,
            "input_tok_s": float(self.prompt_len[ok].sum()) / window if window > 0 else 0.0,
            "ttft_ms": ms(ttft),
            "tpot_ms": ms(tpot),
            "itl_ms": {},
            "e2e_ms": ms(e2e),
            "slo": {
                "ttft_ms": None if slo.ttft_s is None else slo.ttft_s * 1e3,
                "tpot_ms": None if slo.tpot_s is None else slo.tpot_s * 1e3,
            },
            "attainment": float(meets.sum()) / total if total else 0.0,
            "goodput_rps": float(meets.sum()) / window if window > 0 else 0.0,
        }
