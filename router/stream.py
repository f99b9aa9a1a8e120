"""One request's stream at the router: tokens in order, text, finish.

Tokens reach the router from two places: the prefill instance returns the
first one, the decode instance pushes the rest, and the two can arrive in
either order. Each carries its index, so the stream places them and releases
them only in order. Text is produced here, once, by the same incremental
detokenizer the engine uses, so stop strings end the stream at exactly the
token the engine would stop at.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.core.errors import PdserveError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer
from pdserve.engine.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    max_tokens_capped: int | None = None  # the router lowered max_tokens to this (overload)


@dataclass(frozen=True)
class StreamDelta:
    """What a client receives: new tokens and text; the last one has a finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    ready_at: float = 0.0  # time.monotonic() when the router had it ready for the client


class RequestStream:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.idle_timeout_s = idle_timeout_s  # longest wait for the next delta
        self.max_tokens_capped: int | None = None
        self.prompt_token_ids = prompt_token_ids
        self.prompt_len = len(prompt_token_ids)
        self.migrations = 0
        self.instance_losses = 0  # instances that died while it was in flight on them
        self.attempts_started = 0
        self.owner: str | None = None  # the attempt whose tokens the stream takes
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_times: list[float] = []
        self.cached_prompt_tokens = 0
        self.tokens: list[int] = []
        self._pending: dict[int, int] = {}
        self._queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._finish_at: int | None = None
        self._finish_reason: str | None = None
        self._first_token = asyncio.Event()
        self.finished = False  # no more deltas will come
        self.completed = False  # ... because the request finished (not failed)

    def add(
        self,
        start: int,
        token_ids: list[int],
        finish_reason: str | None = None,
        source: str | None = None,
    ) -> None:
        """Tokens ``start, start+1, ...``; ``finish_reason`` if the last one ends the request.

        When several attempts feed the stream (a hedge), the one that delivers the
        first token owns it and the others' tokens are ignored.
        """
        if self.finished:
            return
        if source is not None:
            if self.owner is None and start == 0:
                self.owner = source
            if self.owner is not None and source != self.owner:
                return
        for i, token in enumerate(token_ids):
            self._pending.setdefault(start + i, token)
        if finish_reason is not None:
            end = start + len(token_ids)
            if self._finish_at is None or end < self._finish_at:
                self._finish_at, self._finish_reason = end, finish_reason
        self._release()

    def _release(self) -> None:
        new: list[int] = []
        while len(self.tokens) in self._pending and not self._done_by_count():
            token = self._pending.pop(len(self.tokens))
            self.tokens.append(token)
            new.append(token)
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
                self._first_token.set()
            self.token_times.append(now)
            self.last_token_at = now
            if self.detok.update([token]) is not None:  # a stop string ended it here
                self._finish_at, self._finish_reason = len(self.tokens), "stop"
                break
        done = self._done_by_count()
        if done:
            self.detok.finish(self.tokens)  # flush bytes of an incomplete last character
        if new or done:
            text = self.detok.pop_new_text(done)
            self._queue.put_nowait(
                StreamDelta(
                    new,
                    text,
                    self._finish_reason if done else None,
                    self.usage() if done else None,
                    time.monotonic(),
                )
            )
        if done:
            self.finished = self.completed = True

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason if self.completed else None

    def _done_by_count(self) -> bool:
        return self._finish_at is not None and len(self.tokens) >= self._finish_at

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self._queue.put_nowait(error)
            self._first_token.set()  # nobody waits for a first token that will not come

    async def wait_first_token(self, timeout_s: float | None) -> bool:
        """True once the first token (or a failure) is in; False after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._first_token.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def usage(self) -> Usage:
        return Usage(
            self.prompt_len, len(self.tokens), self.cached_prompt_tokens, self.max_tokens_capped
        )

    async def deltas(self):  # type: ignore[no-untyped-def]
        """Yield deltas until the finishing one; raise what ``fail`` was given."""
        while True:
            try:
                if not self._queue.empty():  # the common case needs no timer
                    item = self._queue.get_nowait()
                else:
                    item = await asyncio.wait_for(self._queue.get(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                self.fail(
                    StreamFailed(f"{self.request_id}: no token for {self.idle_timeout_s:g} s")
                )
                continue  # the failure is queued now
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class StreamFailed(PdserveError):
    """An instance ended the request without finishing it."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
