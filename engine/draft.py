"""Speculative decoding with a draft model: what it has read, and the seam to where it runs.

The draft model (``speculative_method: draft``) is a smaller model of the same
vocabulary. It runs beside the target on the instance's leader rank
(:class:`DraftProposer`, implemented by ``parallel/draft_runner.py``) with a
paged KV cache of its own that has as many blocks of as many tokens as the
target's, and it reads and writes through the **target's** block tables: token
position ``p`` of a request lives in the same slot of both caches, so the draft
needs no blocks, tables or eviction of its own.

One step, for the rows the scheduler lets draft::

    schedule: reserve slots for [last token] + k drafts ──> fill: one DraftRow per
    request, its unread tokens up to its last token ──> DraftProposer.propose:
    one pass over every row's unread tokens, then k - 1 passes of one guess each
    ──> the drafts go into the step's plan ──> the target verifies them

Per request the engine keeps ``seen``: how many leading positions the draft
cache holds valid KV for. A row's tokens are positions ``seen .. n - 1`` (``n``
the request's tokens): the prompt the first time, afterwards the tokens the last
verify added. Once proposed, ``seen = n``. The guesses' own KV (positions
``n .. n + k - 2``) is written into the request's reserved slots but never
trusted: whatever the verify keeps is read again next time, so rejecting drafts
costs the draft cache nothing (no rollback), as it costs the target's nothing.

``seen`` starts from 0 for a new request, even over prefix-cache hits, KV that
came from a prefill instance or blocks loaded back from a KV tier: those bring
the target's KV only. A preempted request (its blocks went back to the pool)
starts from 0 again. What the draft cache holds never changes the output, only
how many drafts are accepted: the target decides every token.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.core.request import Request

PENDING = -1  # a draft slot the scheduler reserved; the draft model fills it in


@dataclass(frozen=True, slots=True)
class DraftRow:
    """One request's input to the draft model for one step.

    token_ids: the tokens at positions ``start_pos .. start_pos + len - 1``, the
        last of them the request's newest token.
    block_table: the target's block ids of the request, covering every position
        up to ``start_pos + len + num_drafts - 2`` (the last guess fed back).
    num_drafts: how many tokens to propose after ``token_ids`` (>= 1).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_drafts: int


class DraftProposer(abc.ABC):
    """The draft model of one instance, on the rank that owns the engine.

    Contract: ``propose`` is called from the engine's thread, at most once per
    step, before the step's plan runs, with at most one row per request. It
    writes the draft's KV of each row's tokens and of its own guesses into the
    slots the row's block table names, and nowhere else. It returns each row's
    ``num_drafts`` tokens, picked greedily (a deterministic draft, so the
    target's verify keeps the target's distribution).
    """

    @property
    @abc.abstractmethod
    def max_positions(self) -> int:
        """Positions the draft model reads (its RoPE table); no draft goes past them."""

    @abc.abstractmethod
    def propose(self, rows: list[DraftRow]) -> list[list[int]]: ...


class ModelDrafter:
    """The engine's side of a draft model: per request, how much of it the draft has read."""

    def __init__(self, proposer: DraftProposer) -> None:
        self.proposer = proposer
        self._seen: dict[str, tuple[int, int]] = {}  # request id -> (preemptions, seen)

    def limit(self, request: Request) -> int:
        """Most drafts the request may get: its last guess stays within the draft's positions."""
        return self.proposer.max_positions - request.num_tokens + 1

    def fill(
        self,
        drafts: dict[str, list[int]],
        requests: list[Request],
        block_table: Callable[[str], list[int]],
    ) -> dict[str, list[int]]:
        """``drafts`` (request id -> ``PENDING`` slots) with the draft model's tokens."""
        rows = []
        for request in requests:
            count = len(drafts.get(request.request_id, ()))
            if not count:
                continue
            rid = request.request_id
            preemptions, seen = self._seen.get(rid, (request.num_preemptions, 0))
            if preemptions != request.num_preemptions:
                seen = 0  # its blocks went back to the pool: read it all again
            start = min(seen, request.num_tokens - 1)
            tokens = request.token_ids[start:]
            rows.append(DraftRow(rid, tokens, start, block_table(rid), count))
            self._seen[rid] = (request.num_preemptions, request.num_tokens)
        if not rows:
            return drafts
        proposed = self.proposer.propose(rows)
        return {**drafts, **{row.request_id: p for row, p in zip(rows, proposed, strict=True)}}

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
