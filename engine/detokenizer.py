"""Incremental detokenization and stop-string matching for one request.

Tokens arrive one at a time; :class:`tokenizers.decoders.DecodeStream` turns them
into text as soon as whole characters are known. Stop strings are searched only
in the tail that the new text could complete. When streaming, the last
``len(longest stop) - 1`` characters are held back until they cannot be the
start of a stop string, so a client never receives text that is later cut.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer

_PROMPT_CONTEXT = 8  # prompt tokens fed to the stream so the first word spaces right


class IncrementalDetokenizer:
    """Output text of one request, built token by token."""

    def __init__(
        self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._stream: DecodeStream | None = None
        if tokenizer is not None:
            self._stream = DecodeStream(
                ids=prompt_token_ids[-_PROMPT_CONTEXT:],
                skip_special_tokens=params.skip_special_tokens,
            )
        self.text = ""
        self._sent = 0  # characters of self.text already returned by pop_new_text
        self._hold = (
            0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
        )
        self.stopped_on: str | None = None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens' text; return the stop string that matched, if any.

        After a match the text ends at the stop string (or just before it, unless
        ``include_stop_str_in_output``) and further updates are ignored.
        """
        if self._stream is None or self.stopped_on is not None:
            return None
        assert self._tokenizer is not None
        before = len(self.text)
        for tid in new_token_ids:
            chunk = self._stream.step(self._tokenizer.hf, tid)
            if chunk:
                self.text += chunk
        if self._params.stop and len(self.text) > before:
            return self._match_stop(before)
        return None

    def _match_stop(self, new_from: int) -> str | None:
        longest = max(map(len, self._params.stop))
        start = max(0, new_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self._params.stop:
            at = self.text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = (
            self.text[: at + len(s)] if self._params.include_stop_str_in_output else self.text[:at]
        )
        self.stopped_on = s
        return s

    def finish(self, output_token_ids: list[int]) -> None:
        """Flush bytes the stream still holds (an incomplete character at the end)."""
        if self._tokenizer is None or self.stopped_on is not None:
            return
        full = self._tokenizer.decode(output_token_ids, self._params.skip_special_tokens)
        if full.startswith(self.text):
            self.text = full

    def pop_new_text(self, finished: bool) -> str:
        """Text not yet returned, holding back a possible stop-string prefix."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
