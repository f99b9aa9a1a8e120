"""Structured output: a JSON schema's grammar masks each step's logits (llguidance).

A row whose request has a ``json_schema`` keeps a matcher on the sampling rank,
compiled from the schema the first time the rank sees the request (or after it
was preempted). The row carries the request's generated tokens the rank has not
seen yet (``RowSampling.seen`` from ``seen_from``, as for penalties); the
matcher consumes them, then gives the tokens the grammar allows next. Once the
schema's value is complete only the model's EOS tokens are allowed. A plan run
again after an error repeats tokens the matcher has, which are skipped.

Speculative drafts are not proposed for such rows (the scheduler's choice), so
a structured row is always sampled at one position.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.core.step import RowSampling
from pdserve.core.structured import grammar
from pdserve.parallel.penalties import check_kept, unseen


class GrammarState:
    """The matchers of the structured requests a sampler is sampling."""

    def __init__(self, tokenizer_dir: str | None, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use
        self._matchers: dict[str, tuple[Any, int]] = {}  # request id -> (matcher, tokens taken)

    def __len__(self) -> int:
        return len(self._matchers)

    def forget(self, request_ids: Sequence[str]) -> None:
        if self._matchers:
            for rid in request_ids:
                self._matchers.pop(rid, None)

    def allowed(self, rows: Sequence[RowSampling], ids: Sequence[str], vocab: int) -> list[int]:
        """Feed the structured rows' matchers their new tokens; return those rows'
        indices in ``rows`` (:meth:`masks` gives what each allows next)."""
        if len(ids) != len(rows):
            raise ValueError("structured rows need their request ids")
        which = []
        for i, (rid, r) in enumerate(zip(ids, rows, strict=True)):
            if r.json_schema is not None:
                self._advance(rid, r, vocab)
                which.append(i)
        return which

    def masks(self, ids: Sequence[str], vocab: int, device: torch.device) -> torch.Tensor:
        """[n, vocab] bool: the tokens each request's grammar allows next."""
        out = np.zeros((len(ids), vocab), dtype=bool)
        for n, rid in enumerate(ids):
            matcher = self._matchers[rid][0]
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            row = np.unpackbits(bits, bitorder="little")[:vocab]
            out[n, : len(row)] = row.astype(bool)
        return torch.from_numpy(out).to(device)

    def _advance(self, rid: str, row: RowSampling, vocab: int) -> None:
        got = self._matchers.get(rid)
        if row.seen_from == 0:
            got = (self._matcher(rid, row.json_schema or "{}", vocab), 0)
        check_kept(rid, row, None if got is None else got[1])
        assert got is not None
        matcher, taken = got
        start, tokens = unseen(row, taken)
        new = [t for i, t in enumerate(tokens) if start + i >= row.num_seen_prompt]
        if new and not matcher.is_stopped():
            matcher.consume_tokens(new)
        if matcher.is_error():
            raise RuntimeError(f"request {rid}: its output left the schema: {matcher.get_error()}")
        self._matchers[rid] = (matcher, start + len(tokens))

    def _matcher(self, rid: str, schema: str, vocab: int) -> Any:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer_for(vocab), grammar(schema), log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"request {rid}: json_schema: {matcher.get_error()}")
        return matcher

    def _tokenizer_for(self, vocab: int) -> Any:
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            if self.tokenizer_dir is None:
                raise RuntimeError("structured output needs the model's tokenizer.json")
            text = (Path(self.tokenizer_dir) / "tokenizer.json").read_text()
            eos = self.eos_token_ids or None
            self._tokenizer = LLTokenizer(text, n_vocab=vocab, eos_token=eos)
        return self._tokenizer
