"""Turn the last-position logits of a batch into one token per sequence.

A row's ``logit_bias`` is added to its logits first, then its penalties applied
(``parallel/penalties.py``), the tokens its JSON schema does not allow next
masked (``parallel/grammar.py``; both keep per-request state on this rank) and
its banned tokens (EOS before ``min_tokens``) masked. Greedy rows take the
argmax. Other rows are scaled by temperature, cut by top-k and top-p, and
sampled by the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which picks
token ``i`` with probability ``p_i`` and never picks a token whose probability
was cut to zero.

A row with a seed draws its noise from a generator seeded by ``(seed, index of
the token being sampled)``, so its output depends on nothing but its own seed
and tokens: not on what it is batched with, not on preemption or migration.

Speculative rows (:meth:`Sampler.verify`) sample the target's token at the last
token and at every draft (output indices ``i, i+1, ...``, so a seeded row uses
the noise it would get without drafts), and keep the drafts up to the first
that differs from the target's token there, plus the target's token at that
position. For a deterministic (n-gram) draft this is the rejection sampling of
Leviathan et al. and Chen et al.: draft ``d`` is accepted with probability
``p(d)``, and on rejection the token comes from ``p`` with ``d`` removed and
renormalised. So every row keeps the target distribution, greedy rows give
exactly the tokens of one-token steps, and seeded rows the same tokens for the
same seed.

:meth:`Sampler.logprobs` gives the rows that ask for them each new token's
log-probability under the model's own distribution (the raw logits, before
logit_bias, bans, temperature and top-k/p) and the likeliest tokens'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import accumulate

import torch

from pdserve.core.step import RowSampling, TokenLogprobs
from pdserve.parallel.grammar import GrammarState
from pdserve.parallel.penalties import PenaltyState, penalize

_MASK = float("-inf")
# Penalised rows: their indices, and each (row, token, times generated) they have seen.
Penalised = tuple[list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# Structured rows: their indices, and the tokens their grammars allow ([n, V] bool).
Allowed = tuple[list[int], torch.Tensor]
_GOLDEN = 0x9E3779B97F4A7C15


def _row_seed(seed: int, output_index: int) -> int:
    return (seed * _GOLDEN + output_index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class Sampler:
    """Holds the generator used by rows without a seed, the penalised requests' seen
    tokens and the structured requests' matchers (:meth:`forget` them when their
    requests finish)."""

    def __init__(
        self,
        seed: int = 0,
        device: torch.device | str = "cpu",
        tokenizer_dir: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """``tokenizer_dir``: the model's folder (its tokenizer.json), for schemas."""
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self.penalties = PenaltyState(self.device)
        self.grammars = GrammarState(tokenizer_dir, eos_token_ids)

    def forget(self, request_ids: Sequence[str]) -> None:
        self.penalties.forget(request_ids)
        self.grammars.forget(request_ids)

    def __call__(
        self, logits: torch.Tensor, rows: list[RowSampling], ids: Sequence[str] = ()
    ) -> list[int]:
        """``ids``: the rows' request ids (needed when a row has penalties or a schema)."""
        penalised = self._penalised(logits, rows, ids)
        return self._sample(logits, rows, penalised, self._allowed(logits, rows, ids))

    def _allowed(
        self,
        logits: torch.Tensor,
        rows: list[RowSampling],
        ids: Sequence[str],
        drafts: list[list[int]] | None = None,
    ) -> Allowed | None:
        """The structured rows' indices (in :meth:`verify`'s expansion with ``drafts``:
        they have none) and the tokens their grammars allow next."""
        if all(r.json_schema is None for r in rows):
            return None
        vocab = logits.shape[1]
        which = self.grammars.allowed(rows, ids, vocab)
        masks = self.grammars.masks([ids[i] for i in which], vocab, logits.device)
        if drafts is not None:
            starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))
            which = [starts[i] for i in which]
        return which, masks

    def _penalised(
        self,
        logits: torch.Tensor,
        rows: list[RowSampling],
        ids: Sequence[str],
        drafts: list[list[int]] | None = None,
    ) -> Penalised | None:
        """The penalised rows' indices, counts and masks; with ``drafts``, of the rows
        :meth:`verify` expands them to (at a draft, the drafts before it count)."""
        if not any(r.penalties for r in rows):
            return None
        slots = self.penalties.advance(rows, ids, logits.shape[1])
        which: list[int] = []  # indices of the (expanded) rows
        taken: list[int] = []  # their slots
        before: list[list[int]] = []  # their drafts before them
        row = 0
        for slot, d in zip(slots, drafts or [[]] * len(rows), strict=True):
            for i in range(len(d) + 1):
                if slot >= 0:
                    which.append(row)
                    taken.append(slot)
                    before.append(d[:i])
                row += 1
        return which, self.penalties.seen(taken, before)

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[RowSampling],
        penalised: Penalised | None,
        allowed: Allowed | None = None,
    ) -> list[int]:
        # logits: [B, V] for the B rows, any float dtype.
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()
        adjusted = penalised is not None or allowed is not None
        if adjusted or any(r.banned_token_ids or r.logit_bias for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.logit_bias:
                    ids, bias = zip(*r.logit_bias, strict=True)
                    logits[i, list(ids)] += torch.tensor(bias, device=logits.device)
            if penalised is not None:
                penalize(logits, rows, *penalised)
            if allowed is not None:
                at = torch.tensor(allowed[0], device=logits.device)
                kept = logits.index_select(0, at).masked_fill(~allowed[1], _MASK)
                logits.index_copy_(0, at, kept)
            for i, r in enumerate(rows):
                if r.banned_token_ids:
                    logits[i, list(r.banned_token_ids)] = _MASK
        if all(r.greedy for r in rows):
            return logits.argmax(dim=-1).tolist()
        greedy_tokens = logits.argmax(dim=-1)
        probs = self._filtered_probs(logits, rows)
        noise = self._noise(probs, rows)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([r.greedy for r in rows], device=logits.device)
        return torch.where(is_greedy, greedy_tokens, sampled).tolist()

    def verify(
        self,
        logits: torch.Tensor,
        rows: list[RowSampling],
        drafts: list[list[int]],
        ids: Sequence[str] = (),
    ) -> list[list[int]]:
        """Each row's new tokens: the accepted drafts' targets and one more.

        logits: [sum(1 + len(d) for d in drafts), V], row by row, a row's
        positions in order (its last known token, then each draft). ``ids``: the
        rows' request ids (needed when a row has penalties).
        """
        if not any(drafts):
            return [[t] for t in self(logits, rows, ids)]
        expanded = [
            replace(r, output_index=r.output_index + i) if i else r
            for r, d in zip(rows, drafts, strict=True)
            for i in range(len(d) + 1)
        ]
        penalised = self._penalised(logits, rows, ids, drafts)
        targets = self._sample(
            logits, expanded, penalised, self._allowed(logits, rows, ids, drafts)
        )
        out: list[list[int]] = []
        start = 0
        for d in drafts:
            row = targets[start : start + len(d) + 1]
            accepted = 0
            while accepted < len(d) and d[accepted] == row[accepted]:
                accepted += 1
            out.append(row[: accepted + 1])
            start += len(d) + 1
        return out

    def logprobs(
        self,
        logits: torch.Tensor,
        rows: list[RowSampling],
        drafts: list[list[int]],
        tokens: list[list[int]],
    ) -> dict[int, list[TokenLogprobs]]:
        """Row index -> an entry per new token (``tokens``, as :meth:`verify` returned
        them), for the rows with ``logprobs >= 0``; logits as :meth:`verify` took them."""
        if not any(r.logprobs >= 0 for r in rows):  # the common case, once per step
            return {}
        positions: list[int] = []
        ids: list[int] = []
        owners: list[int] = []
        start = 0
        for i, (r, d, new) in enumerate(zip(rows, drafts, tokens, strict=True)):
            if r.logprobs >= 0:
                positions += range(start, start + len(new))
                ids += new
                owners += [i] * len(new)
            start += len(d) + 1
        if not positions:
            return {}
        at = torch.tensor(positions, device=logits.device)
        wants = [rows[i].logprobs for i in owners]
        entries = _entries(logits.index_select(0, at), ids, wants)
        out: dict[int, list[TokenLogprobs]] = {}
        for i, entry in zip(owners, entries, strict=True):
            out.setdefault(i, []).append(entry)
        return out

    def _filtered_probs(self, logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
        temps = torch.tensor(
            [r.temperature if not r.greedy else 1.0 for r in rows], device=logits.device
        )
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[1]
        top_ks = [r.top_k if 0 < r.top_k < vocab else vocab for r in rows]
        top_ps = [r.top_p for r in rows]
        if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
            return logits.softmax(dim=-1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, _MASK)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the
        # first token is never dropped.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(before >= p, _MASK)
        filtered = torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)
        return filtered.softmax(dim=-1)

    def _noise(self, probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.seed is None]
        if unseeded:
            block = torch.empty(
                (len(unseeded), probs.shape[1]), device=probs.device, dtype=probs.dtype
            )
            block.exponential_(generator=self._generator)
            noise[unseeded] = block
        for i, r in enumerate(rows):
            if r.seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(_row_seed(r.seed, r.output_index))
                noise[i].exponential_(generator=gen)
        # Exp(1) can round to 0; a floor keeps p / q finite and zero for cut tokens.
        return noise.clamp_(min=1e-30)


PROMPT_ROWS_AT_ONCE = 256  # bounds the [rows, V] float32 logits of a long chunk


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    chunks: list[tuple[str, int, Sequence[int], int]],
) -> dict[str, list[TokenLogprobs]]:
    """Each chunk's prompt logprobs (``PreparedBatch.prompt_rows``): at its token ``i``,
    the raw log-probability of its target ``i`` and its ``k`` likeliest tokens'."""
    index = [first + i for _, first, targets, _ in chunks for i in range(len(targets))]
    targets = [t for _, _, ts, _ in chunks for t in ts]
    wants = [k for _, _, ts, k in chunks for _ in ts]
    entries: list[TokenLogprobs] = []
    for lo in range(0, len(index), PROMPT_ROWS_AT_ONCE):
        hi = lo + PROMPT_ROWS_AT_ONCE
        at = torch.tensor(index[lo:hi], device=hidden.device)
        entries += _entries(
            compute_logits(hidden.index_select(0, at)), targets[lo:hi], wants[lo:hi]
        )
    out: dict[str, list[TokenLogprobs]] = {}
    start = 0
    for rid, _, ts, _ in chunks:
        out[rid] = entries[start : start + len(ts)]
        start += len(ts)
    return out


def _entries(logits: torch.Tensor, ids: Sequence[int], wants: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of ``logits``: the raw log-probability of ``ids[n]`` and the ``wants[n]``
    likeliest tokens' (id, log-probability)."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(ids, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(wants)
    top = lp.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if top is not None else [[]] * len(chosen)
    top_lps = top.values.tolist() if top is not None else [[]] * len(chosen)
    return [
        (value, list(zip(i[:n], v[:n], strict=True)))
        for value, i, v, n in zip(chosen, top_ids, top_lps, wants, strict=True)
    ]
