"""Logprobs in OpenAI's shapes: what a request asks for, and the objects its choices carry.

Completions ask with ``logprobs: k`` (0 to 20) and get, per choice, parallel lists
``tokens``, ``token_logprobs``, ``top_logprobs`` (a ``{token: logprob}`` dict of the
k likeliest) and ``text_offset``. Chat asks with ``logprobs: true`` and
``top_logprobs: k`` and gets ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}]}``. A token's text is its own decoding (special tokens
included), so a token that is part of a character shows a replacement character
there; its ``bytes`` are that text's UTF-8 bytes. The values are the model's raw
distribution (before logit_bias, temperature and top-k/p), as :mod:`pdserve.parallel.sampler`
computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.sampling_params import MAX_LOGPROBS
from pdserve.core.step import TokenLogprobs
from pdserve.core.tokenizer import Tokenizer

TokenText = Callable[[int], str]


def asked_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """``SamplingParams.logprobs`` for the request: alternatives per token, or None."""
    if not chat:
        value = body.get("logprobs")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidArgumentError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        return value  # SamplingParams checks the range
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidArgumentError("logprobs", "must be a boolean")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise InvalidArgumentError("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if top and not wanted:
            raise InvalidArgumentError("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def token_text(tokenizer: Tokenizer | None) -> TokenText:
    """Each token id's own text (``<id>`` without a tokenizer)."""
    if tokenizer is None:
        return lambda token: f"<{token}>"
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    text_of: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """The ``logprobs`` object of a completion choice (or of one streamed chunk, whose
    first token starts at character ``offset`` of the choice's text)."""
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[0] for e in entries],
        "top_logprobs": [
            None if e is None else {text_of(t): lp for t, lp in e[1]} for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], text_of: TokenText
) -> dict[str, Any]:
    """The ``logprobs`` object of a chat choice (or of one streamed chunk)."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        item = _chat_token(text_of(token), None if entry is None else entry[0])
        item["top_logprobs"] = (
            [] if entry is None else [_chat_token(text_of(t), lp) for t, lp in entry[1]]
        )
        content.append(item)
    return {"content": content, "refusal": None}


def _chat_token(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class ChoiceLogprobs:
    """The logprobs objects of a request's ``n`` choices, from their deltas' tokens."""

    def __init__(self, chat: bool, text_of: TokenText, n: int) -> None:
        self.chat = chat
        self.text_of = text_of
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.entries: list[list[TokenLogprobs | None]] = [[] for _ in range(n)]
        self.chars = [0] * n  # characters of each choice's tokens so far (text_offset)

    def chunk(
        self, index: int, token_ids: list[int], entries: Sequence[TokenLogprobs | None]
    ) -> dict[str, Any]:
        """The object of one streamed delta of choice ``index``."""
        if self.chat:
            return chat_logprobs(token_ids, entries, self.text_of)
        out = completion_logprobs(token_ids, entries, self.text_of, self.chars[index])
        self.chars[index] += sum(len(t) for t in out["tokens"])
        return out

    def add(
        self, index: int, token_ids: list[int], entries: Sequence[TokenLogprobs | None]
    ) -> None:
        """Keep a delta's tokens for :meth:`whole`."""
        self.tokens[index] += token_ids
        self.entries[index] += entries

    def whole(self, index: int) -> dict[str, Any]:
        """The object of choice ``index`` of a response that does not stream."""
        tokens, entries = self.tokens[index], self.entries[index]
        if self.chat:
            return chat_logprobs(tokens, entries, self.text_of)
        return completion_logprobs(tokens, entries, self.text_of)
