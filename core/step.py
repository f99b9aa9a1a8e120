"""The plan of one engine step and its result: the messages between scheduler and ranks.

The scheduler (on the instance leader) builds a :class:`StepPlan`; every rank of
the instance executes the same plan; the rank holding the logits returns a
:class:`StepResult`. Both are plain data with a msgpack form, so a plan crosses
a process boundary as one small message per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

# One generated token's log-probability and the likeliest tokens' ((id, logprob), ...).
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class RowSampling:
    """Sampling settings of one row; ``output_index`` is the index of the new token.

    Not frozen, like :class:`ScheduledSeq`: a plan builds one of each per row per
    step, and a frozen dataclass's ``__init__`` costs ~4x a plain one's. Nothing
    changes a plan's rows once built.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    output_index: int = 0
    banned_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int = -1  # -1: none; k >= 0: the new token's and the k likeliest tokens'
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    # (presence, frequency, repetition) when the request asks for any; () otherwise.
    penalties: tuple[float, ...] = ()
    # With penalties or a schema, the tokens they look at: the request's generated tokens,
    # preceded by its ``num_seen_prompt`` prompt tokens when repetition != 1. A row
    # carries those from index ``seen_from`` on; the sampling rank keeps the rest
    # (parallel/penalties.py).
    seen: Sequence[int] = ()
    seen_from: int = 0
    num_seen_prompt: int = 0
    # A JSON schema the output follows (parallel/grammar.py); it sees ``seen`` too.
    json_schema: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step.

    Attributes:
        request_id: the request.
        token_ids: the tokens whose KV this step computes (a prompt chunk, or the
            last sampled token), at positions ``start_pos .. start_pos+len-1``.
        start_pos: tokens of this request already in the KV cache.
        block_table: physical block ids covering positions ``0 .. start_pos+len-1``
            (the KV cache manager's own list, which nobody changes).
        sampling: set when this chunk ends the request's known tokens, so the step
            samples its next token; None for a prompt chunk with more to come.
        num_draft_tokens: the last this many of ``token_ids`` are speculative
            drafts (they follow the request's last known token). The step returns
            the target's token at each draft's position while the drafts agree
            with it, then one more (``StepResult.extra``).
        lora: the LoRA adapter every token of this chunk runs under (None: base).
        prompt_logprobs: with ``prompt_targets``, the step returns the log-probability of
            ``prompt_targets[i]`` at this chunk's token ``i`` (the next prompt token) and
            the ``prompt_logprobs`` likeliest tokens' (``StepResult.prompt_logprobs``).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: RowSampling | None = None
    num_draft_tokens: int = 0
    lora: str | None = None
    prompt_logprobs: int = -1
    prompt_targets: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: cached tokens plus the new ones."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class KVSend:
    """Pages of one request that every rank streams to a decode instance this step.

    After each layer runs, a rank sends that layer's slice of ``src_blocks``
    (this instance's pages, in order) into ``dst_blocks`` (the decode
    instance's reserved pages, same order) over the connector to ``peer``.
    ``final`` marks the step that completes the prompt: once its pages are out,
    the hand-off may be sent.
    """

    request_id: str
    peer: str
    src_blocks: list[int]
    dst_blocks: list[int]
    final: bool


@dataclass(frozen=True, slots=True)
class KVArrival:
    """Decode role: KV messages each rank must have received before ``request_id`` runs."""

    request_id: str
    expected: list[int]  # per rank of the decode instance


@dataclass(frozen=True, slots=True)
class TierLoad:
    """Copy one offloaded block back into device block ``block`` before the step runs.

    ``tier`` is "host" (from host slot ``slot``) or "disk" (the file of ``block_hash``,
    checked against its checksum; a bad or missing file is a failed load).
    """

    tier: str
    slot: int
    block_hash: bytes
    block: int


@dataclass(frozen=True, slots=True)
class TierWrite:
    """One write to a lower KV tier, run in the background while the step computes.

    kinds: "store" device ``block`` -> host ``slot``; "save" device ``block`` -> disk
    file of ``block_hash``; "demote" host ``slot`` -> disk file of ``block_hash``;
    "drop" delete the disk file of ``block_hash``.
    """

    kind: str
    block: int
    slot: int
    block_hash: bytes


@dataclass(frozen=True)
class TierOps:
    """A step's KV-tier work: loads before the forward, writes (mostly) beside it.

    Every rank runs the same ops on its own shard of each block; all are done
    when the step returns.
    """

    loads: list[TierLoad] = field(default_factory=list)
    writes: list[TierWrite] = field(default_factory=list)
    # The first ``sync_writes`` writes read device blocks this step reuses: they
    # run before the loads and the forward; the rest run beside the forward.
    sync_writes: int = 0

    def __bool__(self) -> bool:
        return bool(self.loads or self.writes)

    def to_list(self) -> list[Any]:
        return [
            [[x.tier, x.slot, x.block_hash, x.block] for x in self.loads],
            [[w.kind, w.block, w.slot, w.block_hash] for w in self.writes],
            self.sync_writes,
        ]

    @classmethod
    def from_list(cls, v: list[Any]) -> TierOps:
        loads, writes, sync = v
        return cls([TierLoad(*x) for x in loads], [TierWrite(*w) for w in writes], sync)


@dataclass(frozen=True)
class StepPlan:
    """Everything every rank needs to run one forward pass of a batch."""

    step_id: int
    seqs: list[ScheduledSeq]
    finished_request_ids: list[str] = field(default_factory=list)
    kv_sends: list[KVSend] = field(default_factory=list)
    kv_arrivals: list[KVArrival] = field(default_factory=list)
    tier_ops: TierOps = field(default_factory=TierOps)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        """Nothing for the ranks to do (no sequence and no KV-tier work)."""
        return not self.seqs and not self.tier_ops

    def with_lora(self, adapter_of: Callable[[str], str | None]) -> StepPlan:
        """This plan with each sequence's LoRA adapter (``adapter_of(request_id)``) set."""
        seqs = [replace(s, lora=adapter_of(s.request_id)) for s in self.seqs]
        return replace(self, seqs=seqs)

    def to_msgpack(self) -> bytes:
        seqs = [
            [
                s.request_id,
                s.token_ids,
                s.start_pos,
                s.block_table,
                None if s.sampling is None else _sampling_to_list(s.sampling),
                s.num_draft_tokens,
                s.lora,
                s.prompt_logprobs,
                list(s.prompt_targets),
            ]
            for s in self.seqs
        ]
        sends = [[k.request_id, k.peer, k.src_blocks, k.dst_blocks, k.final] for k in self.kv_sends]
        arrivals = [[a.request_id, a.expected] for a in self.kv_arrivals]
        return bytes(
            msgpack.packb(
                [
                    self.step_id,
                    seqs,
                    self.finished_request_ids,
                    sends,
                    arrivals,
                    self.tier_ops.to_list(),
                ]
            )
        )

    @classmethod
    def from_msgpack(cls, data: bytes) -> StepPlan:
        step_id, seqs, finished, sends, arrivals, tier_ops = msgpack.unpackb(data)
        return cls(
            step_id=step_id,
            seqs=[
                ScheduledSeq(
                    rid,
                    toks,
                    start,
                    table,
                    None if s is None else _sampling_from_list(s),
                    drafts,
                    lora,
                    k,
                    targets or (),
                )
                for rid, toks, start, table, s, drafts, lora, k, targets in seqs
            ],
            finished_request_ids=finished,
            kv_sends=[KVSend(*k) for k in sends],
            kv_arrivals=[KVArrival(*a) for a in arrivals],
            tier_ops=TierOps.from_list(tier_ops),
        )


def _sampling_to_list(s: RowSampling) -> list[Any]:
    return [
        s.temperature,
        s.top_k,
        s.top_p,
        s.seed,
        s.output_index,
        list(s.banned_token_ids),
        s.logprobs,
        [list(p) for p in s.logit_bias],
        list(s.penalties),
        list(s.seen),
        s.seen_from,
        s.num_seen_prompt,
        s.json_schema,
    ]


def _sampling_from_list(v: list[Any]) -> RowSampling:
    temperature, top_k, top_p, seed, output_index, banned, logprobs, bias, *penalised = v
    pen, seen, seen_from, prompt, schema = penalised
    return RowSampling(
        temperature,
        top_k,
        top_p,
        seed,
        output_index,
        tuple(banned),
        logprobs,
        tuple((t, b) for t, b in bias),
        tuple(pen),
        seen or (),
        seen_from,
        prompt,
        schema,
    )


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens of one step, keyed by request id (sampling rows only).

    ``sampled`` holds each row's first new token; ``extra`` the tokens after it,
    for rows that verified drafts (the accepted drafts' successors: a row with
    ``j`` accepted drafts yields ``1 + j`` tokens in all).
    ``kv_transfer_ok`` is False when some rank could not deliver the pages the
    plan's ``kv_sends`` named: those requests must not be handed off.
    ``loads_ok`` has one flag per ``tier_ops.loads`` entry of the plan: True when
    every rank copied that block back intact.
    """

    step_id: int
    sampled: dict[str, int]
    kv_transfer_ok: bool = True
    loads_ok: list[bool] = field(default_factory=list)
    extra: dict[str, list[int]] = field(default_factory=dict)
    # Rows that asked for logprobs (RowSampling.logprobs >= 0): one entry per new token.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Chunks with prompt_targets: one entry per target.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

    @classmethod
    def from_tokens(
        cls,
        step_id: int,
        tokens: dict[str, list[int]],
        kv_transfer_ok: bool = True,
        loads_ok: list[bool] | None = None,
        logprobs: dict[str, list[TokenLogprobs]] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> StepResult:
        """A result from each row's new tokens (one, or more after verified drafts)."""
        return cls(
            step_id,
            {rid: t[0] for rid, t in tokens.items()},
            kv_transfer_ok,
            loads_ok if loads_ok is not None else [],
            {rid: t[1:] for rid, t in tokens.items() if len(t) > 1},
            logprobs or {},
            prompt_logprobs or {},
        )

    def tokens(self, request_id: str) -> list[int]:
        """Every new token of one sampling row, in order."""
        return [self.sampled[request_id], *self.extra.get(request_id, ())]
