"""Penalties on repeated tokens, with each request's seen tokens kept where it is sampled.

A penalised row (``RowSampling.penalties``) applies transformers' repetition
penalty to every token of its prompt and output so far (positive logits divided
by it, negative ones multiplied), then OpenAI's frequency and presence penalties
to its generated tokens (``logit -= frequency * count + presence * (count > 0)``).

The sampling rank keeps, per request, how often each token was generated and
which tokens were seen at all: a row of two ``[slots, V]`` tables, so a step
costs a few tensor operations for the whole batch and the new tokens, not the
whole sequences. A row carries only what the rank has not seen: ``seen`` holds
the tokens from position ``seen_from`` of the request's penalised sequence (its
first ``num_seen_prompt`` tokens are prompt). The scheduler starts again from 0
whenever the ranks may have dropped the state (a preempted request is among a
plan's finished ids); a plan run again after an error repeats tokens the rank
has, which are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.core.step import RowSampling


class PenaltyState:
    """The seen tokens of the penalised requests a sampler is sampling, a slot each."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts = torch.zeros(0, 0, device=device)  # [slots, V]: times generated
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [slots, V]: seen
        self._slots: dict[str, tuple[int, int]] = {}  # request id -> (slot, tokens taken)
        self._free: list[int] = []
        self._distinct: dict[int, torch.Tensor] = {}  # slot -> the tokens it has seen, once each

    def __len__(self) -> int:
        return len(self._slots)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Finished or preempted requests: their slots go back."""
        if self._slots:
            for rid in request_ids:
                got = self._slots.pop(rid, None)
                if got is not None:
                    self._free.append(got[0])
                    self._distinct.pop(got[0], None)

    def advance(self, rows: Sequence[RowSampling], ids: Sequence[str], vocab: int) -> list[int]:
        """Take the penalised rows' new tokens; each one's slot (-1: not penalised)."""
        if len(ids) != len(rows):
            raise ValueError("penalised rows need their request ids")
        slots: list[int] = []
        fresh: list[int] = []  # slots that start empty this step
        at: list[int] = []
        tokens: list[int] = []
        generated: list[bool] = []
        for rid, r in zip(ids, rows, strict=True):
            if not r.penalties:
                slots.append(-1)
                continue
            slot, taken = self._slot(rid, r, vocab, fresh)
            start, new = unseen(r, taken)
            at += [slot] * len(new)
            tokens += new
            generated += [start + i >= r.num_seen_prompt for i in range(len(new))]
            self._slots[rid] = (slot, start + len(new))
            slots.append(slot)
        if fresh:
            self.counts[fresh] = 0
            self.mask[fresh] = False
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            self._distinct.update((slot, empty) for slot in fresh)
        if tokens:
            self._take(at, tokens, generated, vocab)
        return slots

    def _take(self, at: list[int], tokens: list[int], generated: list[bool], vocab: int) -> None:
        dev = self.device
        index = (torch.tensor(at, device=dev), torch.tensor(tokens, dtype=torch.long, device=dev))
        unseen = ~self.mask[index]
        _add(self.counts, self.mask, index, generated)
        if not bool(unseen.any()):
            return
        # each slot's tokens seen for the first time, once each, appended to its list
        key = (index[0] * vocab + index[1])[unseen].unique()
        slot_of, n = (key // vocab).unique_consecutive(return_counts=True)
        for slot, part in zip(slot_of.tolist(), (key % vocab).split(n.tolist()), strict=True):
            self._distinct[slot] = torch.cat([self._distinct[slot], part])

    def _slot(self, rid: str, row: RowSampling, vocab: int, fresh: list[int]) -> tuple[int, int]:
        got = self._slots.get(rid)
        if row.seen_from:
            check_kept(rid, row, None if got is None else got[1])
            assert got is not None
            return got
        if got is not None:  # sent again from the start
            fresh.append(got[0])
            return got[0], 0
        if not self._free:
            self._grow(vocab)
        slot = self._free.pop()
        fresh.append(slot)
        return slot, 0

    def _grow(self, vocab: int) -> None:
        old = self.counts.shape[0]
        size = max(8, 2 * old)
        counts = torch.zeros(size, vocab, device=self.device)
        mask = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
        if old:
            counts[:old] = self.counts
            mask[:old] = self.mask
        self.counts, self.mask = counts, mask
        self._free += range(size - 1, old - 1, -1)

    def seen(
        self, slots: list[int], drafts: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every (row, token) the slots have seen, and how often each was generated:
        three tensors of one entry per pair, rows numbered as ``slots``. ``drafts[i]``:
        generated tokens row ``i`` has beyond its slot (drafts accepted before it)."""
        dev, vocab = self.device, self.counts.shape[1]
        at = torch.tensor(slots, device=dev)
        if drafts and any(drafts):  # rare: on copies of the slots' rows
            counts, mask = self.counts.index_select(0, at), self.mask.index_select(0, at)
            rows = [n for n, d in enumerate(drafts) for _ in d]
            flat = [t for d in drafts for t in d]
            _add(counts, mask, (torch.tensor(rows, device=dev), torch.tensor(flat, device=dev)))
            row, token = mask.nonzero(as_tuple=True)
            return row, token, counts[row, token]
        parts = [self._distinct[slot] for slot in slots]
        token = torch.cat(parts)
        sizes = torch.tensor([len(part) for part in parts], device=dev)
        row = torch.repeat_interleave(torch.arange(len(slots), device=dev), sizes)
        count = self.counts.view(-1).index_select(0, at.index_select(0, row) * vocab + token)
        return row, token, count


def check_kept(rid: str, row: RowSampling, taken: int | None) -> None:
    """A row that continues a request's seen tokens needs the rank to have them all."""
    if taken is None:
        raise RuntimeError(f"request {rid}: its seen tokens were lost here")
    if row.seen_from > taken:
        raise RuntimeError(f"request {rid}: seen tokens {taken}..{row.seen_from} missing")


def unseen(row: RowSampling, taken: int) -> tuple[int, Sequence[int]]:
    """The row's tokens the rank has not taken (a plan run again repeats some) and the
    position of the first of them."""
    skip = taken - row.seen_from
    return row.seen_from + skip, row.seen[skip:]


def _add(
    counts: torch.Tensor,
    mask: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor],
    generated: list[bool] | None = None,
) -> None:
    """Mark (row, token) pairs seen; count those ``generated`` says were (default: all)."""
    mask.index_put_(index, torch.tensor(True, device=mask.device))
    if generated is not None and not all(generated):
        keep = torch.tensor(generated, device=mask.device)
        index = (index[0][keep], index[1][keep])
    counts.index_put_(index, torch.ones(len(index[0]), device=counts.device), accumulate=True)


def penalize(
    logits: torch.Tensor,
    rows: Sequence[RowSampling],
    which: list[int],
    seen: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Apply the penalties of rows ``which`` to their logits ([B, V] float, in place);
    ``seen``: their (row, token, count) entries, rows numbered as ``which``."""
    dev = logits.device
    row, token, count = seen
    presence, frequency, repetition = (
        torch.tensor([rows[i].penalties[k] for i in which], device=dev).index_select(0, row)
        for k in range(3)
    )
    flat = torch.tensor(which, device=dev).index_select(0, row) * logits.shape[1] + token
    values = logits.view(-1).index_select(0, flat)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= frequency * count + presence * (count > 0).to(values.dtype)
    logits.view(-1).index_copy_(0, flat, values)
