"""One request's stream at the router: tokens in order, text, finish.

Tokens reach the router from two places: the prefill instance returns the
first one, the decode instance pushes the rest, and the two can arrive in
either order. Each carries its index, so the stream places them and releases
them only in order. Text is produced here, once, by the same incremental
detokenizer the engine uses, so stop strings end the stream at exactly the
token the engine would stop at.

Per engine step a stream does a fixed amount of work however many tokens the
step brought: the tokens in order become one delta (text detokenized in one
call unless stop strings need a check after each token), put on the stream's
own list, and its consumer is woken once. Deltas that pile up while the
consumer is busy (a slow client, a front door behind) leave as one. The idle
timeout is one timer per stream, re-armed only when it fires, not a timer per
delta.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from pdserve.core.errors import PdserveError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import TokenLogprobs
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
    # A delta made of several the consumer had not taken yet: when each was ready.
    parts_ready_at: tuple[float, ...] = ()
    # One per token when the request asked for them (None: an instance sent none for it).
    logprobs: list[TokenLogprobs | None] | None = None
    # On the first delta, when the request asked for prompt logprobs: each prompt
    # token's but the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


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
        self._pending_logprobs: dict[int, TokenLogprobs] = {}
        self._prompt_logprobs: list[TokenLogprobs] | None = None
        self._ready: deque[StreamDelta | BaseException] = deque()  # for the consumer
        self._waiter: asyncio.Future[None] | None = None  # the consumer, while it waits
        self._wait_since = 0.0  # when the consumer last started waiting
        self._idle_timer: asyncio.TimerHandle | None = None
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
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """Tokens ``start, start+1, ...``; ``finish_reason`` if the last one ends the request;
        ``logprobs``, one per token, where the request asked for them.

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
        for i, entry in enumerate(logprobs or ()):
            self._pending_logprobs.setdefault(start + i, entry)
        if finish_reason is not None:
            end = start + len(token_ids)
            if self._finish_at is None or end < self._finish_at:
                self._finish_at, self._finish_reason = end, finish_reason
        self._release()

    def take_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        """The prompt's logprobs, from the instance that prefilled it (the first kept)."""
        if self._prompt_logprobs is None and not self.tokens:
            self._prompt_logprobs = entries

    def _release(self) -> None:
        """Move the tokens now in order (up to the finish) to one delta for the consumer."""
        n = len(self.tokens)
        end = n
        while end in self._pending:
            end += 1
        if self._finish_at is not None:
            end = max(n, min(end, self._finish_at))
        new = [self._pending.pop(i) for i in range(n, end)]
        logprobs: list[TokenLogprobs | None] | None = None
        if self.params.logprobs is not None:
            logprobs = [self._pending_logprobs.pop(i, None) for i in range(n, end)]
        if new:
            self._take(new)
            if logprobs is not None:
                del logprobs[len(new) :]  # cut with the tokens at a stop string
        done = self._done_by_count()
        if not new and not done:
            return
        if done:
            self.detok.finish(self.tokens)  # flush bytes of an incomplete last character
        now = time.monotonic()
        self._put(
            StreamDelta(
                new,
                self.detok.pop_new_text(done),
                self._finish_reason if done else None,
                self.usage() if done else None,
                now,
                logprobs=logprobs,
                prompt_logprobs=self._prompt_logprobs if n == 0 else None,
            )
        )
        if done:
            self.finished = self.completed = True
            self._stop_timer()

    def _take(self, new: list[int]) -> None:
        """Append ``new`` (cut after a token that completes a stop string) and its text."""
        if self.params.stop:  # a stop string may end the request inside the batch
            for i, token in enumerate(new):
                if self.detok.update([token]) is not None:
                    del new[i + 1 :]
                    self._finish_at, self._finish_reason = len(self.tokens) + i + 1, "stop"
                    break
        else:
            self.detok.update(new)
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self._first_token.set()
        self.tokens.extend(new)
        self.token_times.extend([now] * len(new))
        self.last_token_at = now

    def _put(self, item: StreamDelta | BaseException) -> None:
        self._ready.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason if self.completed else None

    def _done_by_count(self) -> bool:
        return self._finish_at is not None and len(self.tokens) >= self._finish_at

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self._put(error)
            self._first_token.set()  # nobody waits for a first token that will not come
            self._stop_timer()

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
            while not self._ready:
                await self._wait()
            item = self._ready.popleft()
            if isinstance(item, BaseException):
                raise item
            while self._ready and item.finish_reason is None:
                later = self._ready[0]
                if isinstance(later, BaseException):
                    break
                self._ready.popleft()
                item = _merged(item, later)
            yield item
            if item.finish_reason is not None:
                return

    async def _wait(self) -> None:
        """Until ``_put`` wakes the consumer (or the idle timeout fails the stream)."""
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._wait_since = loop.time()
        if self.idle_timeout_s is not None and self._idle_timer is None:
            self._idle_timer = loop.call_at(self._wait_since + self.idle_timeout_s, self._idle)
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _idle(self) -> None:
        """The idle timer: fail the stream if its consumer has waited too long, else re-arm."""
        self._idle_timer = None
        if self._waiter is None or self.idle_timeout_s is None:
            return  # not waiting now: the next wait arms the timer again
        loop = asyncio.get_running_loop()
        deadline = self._wait_since + self.idle_timeout_s
        if loop.time() >= deadline:
            self.fail(StreamFailed(f"{self.request_id}: no token for {self.idle_timeout_s:g} s"))
        else:
            self._idle_timer = loop.call_at(deadline, self._idle)

    def _stop_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


def _merged(first: StreamDelta, then: StreamDelta) -> StreamDelta:
    """Two deltas the consumer had not taken yet, as one (ready since the first was)."""
    return StreamDelta(
        first.token_ids + then.token_ids,
        first.text + then.text,
        then.finish_reason,
        then.usage,
        first.ready_at,
        (first.parts_ready_at or (first.ready_at,)) + (then.ready_at,),
        None if first.logprobs is None else first.logprobs + (then.logprobs or []),
        first.prompt_logprobs,
    )


class StreamFailed(PdserveError):
    """An instance ended the request without finishing it."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
