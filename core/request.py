"""A request as the engine sees it, and what the engine hands back.

A request carries counters, not phase flags: ``num_computed_tokens`` says how
many of its tokens already have KV in the cache. A prompt chunk, a prefix-cache
hit, and KV that arrived from another instance all just advance that counter;
the request needs a sampled token whenever the counter reaches ``num_tokens``.

Lifecycle::

    WAITING --schedule--> RUNNING --stop/length--> FINISHED_*
       ^                   ^   |
       +----- PREEMPTED <--|---+  (blocks freed; recomputed from token 0 later)
    RESERVED --activate----+      (decode side: the prompt's KV arrived)
    any state --abort--> FINISHED_ABORTED
    RUNNING --its step raised--> FINISHED_ERROR   (blocks freed; never retried)

A prefill instance may finish a request but keep its blocks ("held") until the
decode instance has acknowledged the KV; ``Scheduler.release`` frees them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    RESERVED = "reserved"  # blocks held for KV arriving from a prefill instance
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request's step failed; the others went on

    def __init__(self, value: str) -> None:
        # An attribute of each member, not a property: every step reads it for every row.
        self.finished: bool = value in ("stop", "length", "abort", "error")


class Request:
    """One sequence being generated. Mutated only by the scheduler that owns it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_prompt_tokens = len(prompt_token_ids)
        # prompt followed by generated tokens; KV exists for the first num_computed_tokens.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Chained hashes of this request's full blocks, filled by the KV cache manager.
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_tier_loads = 0  # times its prefix was copied back from a lower KV tier
        self.num_cached_prompt_tokens = 0
        self.first_token_time: float | None = None
        # First step that computed anything for it; decode role: when its KV landed.
        self.first_scheduled_time: float | None = None
        self.activated_time: float | None = None
        # Prefill role: on finishing, keep the blocks until released.
        self.hold_kv_on_finish = False
        # Tokens this request generated elsewhere before it moved here (they end
        # its prompt): seeded sampling continues at this index.
        self.output_offset = 0
        # Penalties: tokens of it the sampling rank has been sent (parallel/penalties.py),
        # and whether that rank needs them at all (penalties or a schema look at them).
        self.penalty_seen_sent = 0
        self.tracks_seen = (
            bool(sampling_params.penalties) or sampling_params.json_schema is not None
        )
        # Each output token's logprobs, when its params ask for them (else empty).
        self.logprobs: list[TokenLogprobs] = []
        # Each prompt token's but the first (prompt_logprobs; else empty).
        self.prompt_logprobs: list[TokenLogprobs] = []

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """``now``: the caller's clock reading (the engine's, or a simulator's)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic() if now is None else now
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


@dataclass
class CompletionOutput:
    """The generated part of one request: cumulative, not a delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per token: its logprob and the likeliest tokens' (SamplingParams.logprobs); else None.
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    """Wall-clock marks of one request (``time.monotonic`` seconds)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    activated_time: float | None = None  # decode role: the hand-off arrived

    def phases(self) -> dict[str, float]:
        """Seconds in each phase this engine saw (names of pdserve.core.metrics.PHASES)."""
        out: dict[str, float] = {}
        start, first = self.first_scheduled_time, self.first_token_time
        if self.activated_time is not None:  # a hand-off: decode only
            if start is not None:
                out["decode_queue"] = max(0.0, start - self.activated_time)
                if self.finished_time is not None:
                    out["decode"] = self.finished_time - start
            return out
        if start is not None:
            out["prefill_queue"] = start - self.arrival_time
            if first is not None:
                out["prefill"] = first - start
                if self.finished_time is not None:
                    out["decode"] = self.finished_time - first
        return out

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step.

    ``outputs[0].token_ids`` and ``text`` are everything generated so far;
    ``new_token_ids`` and ``new_text`` are what this step added (for streaming).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs] | None = None
    # With prompt_logprobs: an entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
