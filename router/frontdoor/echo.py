"""Completions' ``echo``: each choice starts with its prompt.

The prompt's text (the request's string, or its token ids decoded) opens the
choice's text; with ``logprobs: k`` its tokens open the choice's logprobs too,
each with its log-probability given the tokens before it and the k likeliest
tokens' (the first prompt token has none: ``null``, as OpenAI's). The instance
that prefills the request computes them (``SamplingParams.prompt_logprobs``) and
they come with the request's first delta.
"""

from __future__ import annotations

from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.step import TokenLogprobs
from pdserve.core.tokenizer import Tokenizer
from pdserve.router.stream import StreamDelta


def echoed(body: dict[str, Any], chat: bool) -> bool:
    """Whether a completion asks for its prompt back (chat has no ``echo``)."""
    value = body.get("echo")
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError("echo", "must be a boolean")
    return bool(value) and not chat


class Echo:
    """The prompt delta each of a request's choices starts with."""

    def __init__(self, prompt: Any, ids: list[int], tokenizer: Tokenizer | None) -> None:
        self.ids = ids
        if isinstance(prompt, str):
            self.text = prompt
        elif tokenizer is not None:
            self.text = tokenizer.decode(ids, skip_special_tokens=False)
        else:
            self.text = ""
        self._started: set[int] = set()

    def first(self, index: int, delta: StreamDelta) -> StreamDelta | None:
        """Choice ``index``'s prompt delta, before its first delta; None after."""
        if index in self._started:
            return None
        self._started.add(index)
        got = delta.prompt_logprobs
        entries: list[TokenLogprobs | None] = [None]
        entries += got if got is not None else [None] * (len(self.ids) - 1)
        return StreamDelta(self.ids, self.text, logprobs=entries)
