"""The plan of one engine step and its result: the messages between scheduler and ranks.

The scheduler (on the instance leader) builds a :class:`StepPlan`; every rank of
the instance executes the same plan; the rank holding the logits returns a
:class:`StepResult`. Both are plain data with a msgpack form, so a plan crosses
a process boundary as one small message per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from pdserve.core.sampler import RowSampling


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a step.

    Attributes:
        request_id: the request.
        token_ids: the tokens whose KV this step computes (a prompt chunk, or the
            last sampled token), at positions ``start_pos .. start_pos+len-1``.
        start_pos: tokens of this request already in the KV cache.
        block_table: physical block ids covering positions ``0 .. start_pos+len-1``.
        sampling: set when this chunk ends the request's known tokens, so the step
            samples its next token; None for a prompt chunk with more to come.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: RowSampling | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: cached tokens plus the new ones."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """Everything every rank needs to run one forward pass of a batch."""

    step_id: int
    seqs: list[ScheduledSeq]
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def to_msgpack(self) -> bytes:
        seqs = [
            [
                s.request_id,
                s.token_ids,
                s.start_pos,
                s.block_table,
                None if s.sampling is None else _sampling_to_list(s.sampling),
            ]
            for s in self.seqs
        ]
        return bytes(msgpack.packb([self.step_id, seqs, self.finished_request_ids]))

    @classmethod
    def from_msgpack(cls, data: bytes) -> StepPlan:
        step_id, seqs, finished = msgpack.unpackb(data)
        return cls(
            step_id=step_id,
            seqs=[
                ScheduledSeq(rid, toks, start, table, None if s is None else _sampling_from_list(s))
                for rid, toks, start, table, s in seqs
            ],
            finished_request_ids=finished,
        )


def _sampling_to_list(s: RowSampling) -> list[Any]:
    return [s.temperature, s.top_k, s.top_p, s.seed, s.output_index, list(s.banned_token_ids)]


def _sampling_from_list(v: list[Any]) -> RowSampling:
    temperature, top_k, top_p, seed, output_index, banned = v
    return RowSampling(temperature, top_k, top_p, seed, output_index, tuple(banned))


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens of one step, keyed by request id (sampling rows only)."""

    step_id: int
    sampled: dict[str, int]
