"""One request's tries on prefill/decode pairs: reserve, first token, migrate, hedge, close.

    launch(stream, choice)            attempt id = the router's request id (#n for later tries)
      reserve pages on decode  ─refused─> another decode of the region (retry budget;
                                          :mod:`~pdserve.router.reservation`)
      prefill into them        (unless decode prefills the prompt itself)
      first token  <- prefill          rest of the tokens <- decode (``on_tokens``)
    migrate(attempt)   an instance died, ended it early or outlived its drain timeout:
                       a new attempt on another pair, prompt = prompt + tokens
                       streamed, landing at that offset (on the version that took
                       the traffic when a rollout retires the request's own)
    hedge(attempt)     the first token is late: a second attempt; the slower one goes
    close(attempt)     forget it; abort it on its instances unless its stream completed

Ids are the router's own (see :class:`~pdserve.router.placement.CompletionInput`).
A request that fails *inside* an engine (``RequestFailedError``, finish reason
``error``) is never retried: what made it fail would follow it. A request that
was in flight on two instances that both died is quarantined the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.core.errors import (
    InstanceFailedError,
    OverloadedError,
    PdserveError,
    RequestAbortedError,
    RequestFailedError,
    TransferError,
)
from pdserve.core.messages import (
    FirstToken,
    PeerPrefix,
    PrefillRequest,
    Reservation,
    TokenBatch,
)
from pdserve.router.observe import Observer
from pdserve.router.placement import Choice, CompletionInput
from pdserve.router.reservation import Reserver, RouterParts, cause_of
from pdserve.router.state import InstanceView
from pdserve.router.stream import RequestStream, StreamFailed

logger = logging.getLogger(__name__)

# Instances a request may have been in flight on when they died before it is
# quarantined (failed with a clear error instead of moved again).
QUARANTINE_AFTER_LOSSES = 2


@dataclass
class Attempt:
    """One try at serving a request on one prefill/decode pair.

    A request migrates by starting a new attempt whose prompt is the original
    prompt plus every token streamed so far (``offset`` of them); the new
    attempt's tokens land at ``offset`` onwards in the same stream.
    """

    attempt_id: str
    stream: RequestStream
    inp: CompletionInput
    offset: int
    region: str
    prefill: InstanceView | None = None
    decode: InstanceView | None = None
    peer: PeerPrefix | None = None  # who holds more of the prompt than ``prefill``
    first_token_seen: bool = False
    closed: bool = False


class Attempts:
    """Every live attempt of one router, keyed by attempt id; runs on the router's loop."""

    def __init__(
        self,
        parts: RouterParts,
        obs: Observer,
        place_moved: Callable[[CompletionInput], Awaitable[tuple[CompletionInput, Choice]]],
    ) -> None:
        self.parts = parts
        self.obs = obs
        # Where a moving request goes: its version (the one that took its traffic once
        # a rollout retired its own) and a pair, after a wait for its region to start one.
        self.place_moved = place_moved
        self.live: dict[str, Attempt] = {}
        self.hedged = 0
        self.migrations = 0
        self.tasks: set[asyncio.Future[None]] = set()  # migrations, first tokens, releases
        self.reserver = Reserver(parts, self.spawn)

    # -- events from instances ---------------------------------------------------------------

    def on_tokens(self, batch: TokenBatch) -> None:
        for u in batch.updates:
            attempt = self.live.get(u.request_id)
            if attempt is None or attempt.closed:
                continue
            if u.finished and u.finish_reason == "error":
                attempt.stream.fail(
                    RequestFailedError(
                        f"request {attempt.stream.request_id} failed on decode "
                        f"{batch.instance_id}; it was not retried"
                    )
                )
                continue
            if u.finished and u.finish_reason == "abort":  # the instance gave up on it
                self.spawn(self.migrate(attempt, f"decode {batch.instance_id} ended it early"))
                continue
            if u.finished:
                self.obs.phases(attempt.region, u.phases)
            start = attempt.offset + u.num_output_tokens - len(u.new_token_ids)
            if u.prompt_logprobs is not None:
                attempt.stream.take_prompt_logprobs(u.prompt_logprobs)
            if u.num_cached_tokens is not None:  # the decode instance prefilled it
                attempt.stream.cached_prompt_tokens = u.num_cached_tokens
            attempt.stream.add(
                start,
                u.new_token_ids,
                u.finish_reason if u.finished else None,
                attempt.attempt_id,
                u.new_logprobs,
            )

    def instance_lost(self, instance_id: str) -> None:
        """Move every attempt the lost instance held (its tokens would never come)."""
        self.move_off(instance_id, f"{instance_id} was lost", lost=True)

    def move_off(self, instance_id: str, why: str, lost: bool = False) -> int:
        """Move every attempt ``instance_id`` holds to another pair; how many moved.

        ``lost``: it died (counts toward quarantine). Otherwise it still runs (a
        drain outlived its timeout): each attempt is aborted there as it moves, and
        what it still sends for it is ignored (the attempt is no longer live).
        """
        moved = 0
        for attempt in list(self.live.values()):
            on_prefill = attempt.prefill is not None and attempt.prefill.instance_id == instance_id
            on_decode = attempt.decode is not None and attempt.decode.instance_id == instance_id
            if on_decode or (on_prefill and not attempt.first_token_seen):
                self.spawn(self.migrate(attempt, why, lost=lost))
                moved += 1
        return moved

    # -- launching -------------------------------------------------------------------------------

    async def launch(
        self, stream: RequestStream, inp: CompletionInput, choice: Choice, offset: int
    ) -> Attempt:
        """Reserve (trying other decode instances if refused) and start the prefill."""
        # Ids are never reused: an instance may still hold an earlier attempt's pages.
        n = stream.attempts_started
        stream.attempts_started += 1
        attempt_id = stream.request_id if n == 0 else f"{stream.request_id}#{n}"
        attempt = Attempt(attempt_id, stream, inp, offset, choice.region)
        self.live[attempt_id] = attempt
        if offset:
            stream.owner = attempt_id  # a migration: only the new attempt feeds the stream
        try:
            prefill, decode, reservation = await self.reserver.reserve(attempt, choice)
        except BaseException:
            attempt.closed = True
            self.live.pop(attempt_id, None)
            raise
        attempt.decode = decode
        if attempt.closed:  # closed while the reservation was being made: free it now
            decode.inflight -= 1
            self.parts.cluster.touch(decode)
            await self._abort(attempt)
            raise RequestAbortedError(f"{stream.request_id}: the request ended")
        if stream.finished and not stream.completed:  # its client left while we reserved
            await self.close(attempt)
            raise RequestAbortedError(f"{stream.request_id}: the client went away")
        logger.info(
            "request %s: attempt %s, prefill %s, decode %s",
            stream.request_id,
            attempt_id,
            "-" if reservation.local or prefill is None else prefill.instance_id,
            decode.instance_id,
        )
        # Until the instance that prefills it says how much of the prompt it found cached.
        stream.cached_prompt_tokens = reservation.num_cached_tokens
        if not reservation.local and prefill is not None:
            self._start_prefill(attempt, prefill, reservation)
        return attempt

    def _start_prefill(
        self, attempt: Attempt, prefill: InstanceView, reservation: Reservation
    ) -> None:
        inp = attempt.inp
        attempt.prefill = prefill
        prefill.inflight += 1
        prefill.pending_prompt_tokens += len(inp.prompt_token_ids)
        self.parts.cluster.touch(prefill)
        request = PrefillRequest(
            attempt.attempt_id,
            inp.prompt_token_ids,
            inp.params,
            reservation,
            attempt.offset,
            attempt.peer,
        )
        self.spawn(self._first_token(attempt, prefill.handle.prefill.remote(request)))

    async def _first_token(self, attempt: Attempt, ref: Any) -> None:
        assert attempt.prefill is not None
        prefill, tokens = attempt.prefill, len(attempt.inp.prompt_token_ids)
        try:
            first: FirstToken = await ref
            attempt.first_token_seen = True
            self.obs.phases(attempt.region, first.phases)
            if not attempt.closed:
                reason = first.finish_reason if first.finished else None
                logprobs = None if first.logprobs is None else [first.logprobs]
                if first.prompt_logprobs is not None:
                    attempt.stream.take_prompt_logprobs(first.prompt_logprobs)
                attempt.stream.cached_prompt_tokens = first.num_cached_tokens
                attempt.stream.add(
                    attempt.offset, [first.token_id], reason, attempt.attempt_id, logprobs
                )
        except Exception as e:
            cause = cause_of(e)
            if isinstance(cause, InstanceFailedError):
                self.parts.unregister(prefill.instance_id)
                self.instance_lost(prefill.instance_id)  # moves this attempt and its siblings
            elif isinstance(cause, RequestFailedError):
                attempt.stream.fail(cause)  # never retried: it would fail again
            elif (
                isinstance(cause, TransferError) and self.parts.config.on_transfer_failure == "fail"
            ):
                attempt.stream.fail(cause)
            elif not attempt.closed and not isinstance(cause, RequestAbortedError):
                await self.migrate(attempt, f"prefill {prefill.instance_id} failed: {cause}")
        finally:
            prefill.pending_prompt_tokens -= tokens
            self.parts.cluster.touch(prefill)

    # -- moving, hedging, closing --------------------------------------------------------------

    async def migrate(self, attempt: Attempt, why: str, lost: bool = False) -> None:
        """Serve the rest of the request on another pair: its prompt plus what streamed.

        ``lost``: the attempt's instance died (counts toward quarantine).
        """
        try:
            await self._migrate(attempt, why, lost)
        except Exception as e:  # never leave a client waiting on a stream nobody feeds
            logger.exception("migrating %s failed", attempt.stream.request_id)
            attempt.stream.fail(cause_of(e))

    async def _migrate(self, attempt: Attempt, why: str, lost: bool) -> None:
        if attempt.closed:
            return
        stream = attempt.stream
        stream.instance_losses += lost
        await self.close(attempt)
        if stream.finished or any(a.stream is stream for a in self.live.values()):
            return  # done, or a hedged twin carries on
        if stream.instance_losses >= QUARANTINE_AFTER_LOSSES:
            stream.fail(
                RequestFailedError(
                    f"{stream.request_id} was in flight on {stream.instance_losses} instances "
                    "that died; it is not retried again"
                )
            )
            return
        if stream.migrations >= self.parts.config.max_migrations:
            stream.fail(StreamFailed(f"{stream.request_id}: {why}; no attempt left"))
            return
        stream.migrations += 1
        self.migrations += 1
        self.obs.migrated(attempt.region, "decode" if attempt.first_token_seen else "prefill")
        logger.warning(
            "migrating %s (%s) after %d tokens", stream.request_id, why, len(stream.tokens)
        )
        await self._relaunch(stream, attempt.inp)

    async def _relaunch(self, stream: RequestStream, original: CompletionInput) -> None:
        done = len(stream.tokens)
        params = dataclasses.replace(
            stream.params,
            max_tokens=stream.params.max_tokens - done,
            min_tokens=max(0, stream.params.min_tokens - done),
        )
        inp = dataclasses.replace(
            original, prompt_token_ids=stream.prompt_token_ids + stream.tokens, params=params
        )
        deadline = time.monotonic() + self.parts.config.migration_wait_s
        while not stream.finished:  # a client that left ends the retries
            try:
                moved, choice = await self.place_moved(inp)
                await self.launch(stream, moved, choice, done)
                return
            except (OverloadedError, InstanceFailedError) as e:
                if time.monotonic() >= deadline:
                    stream.fail(e)
                    return
                await asyncio.sleep(0.5)  # no pair free yet: the controller is replacing one
            except Exception as e:
                stream.fail(cause_of(e))
                return

    async def hedge(self, first: Attempt, hashes: dict[int, list[bytes]]) -> None:
        """Start a second attempt if the first token is late; keep whichever answers first."""
        assert self.parts.config.hedge_after_s is not None
        stream = first.stream
        if (
            await stream.wait_first_token(self.parts.config.hedge_after_s)
            or not self.parts.retries.try_spend()
        ):
            return
        try:
            choice = self.parts.chooser.place(first.inp, first.region, hashes)
            second = await self.launch(stream, first.inp, choice, 0)
        except PdserveError as e:  # no second pair now: the first attempt carries on
            logger.info("hedge of %s not started: %s", stream.request_id, e)
            return
        self.hedged += 1
        await stream.wait_first_token(None)
        # Both feed the same stream from index 0 (it keeps the first copy of each
        # token); the attempt that has not produced a token yet goes.
        loser = second if first.first_token_seen or not second.first_token_seen else first
        await self.close(loser)

    async def close(self, attempt: Attempt) -> None:
        """Forget one attempt; abort it on its instances unless its stream completed."""
        if attempt.closed:
            return
        attempt.closed = True
        self.live.pop(attempt.attempt_id, None)
        for view in (attempt.prefill, attempt.decode):
            if view is not None:
                view.inflight -= 1
                self.parts.cluster.touch(view)
        if not attempt.stream.completed:
            await self._abort(attempt)

    async def _abort(self, attempt: Attempt) -> None:
        """Free the attempt's pages and work on its instances."""
        if attempt.decode is None:
            return
        calls = [attempt.decode.handle.abort.remote(attempt.attempt_id)]
        if attempt.prefill is not None:
            calls.append(attempt.prefill.handle.drop.remote(attempt.attempt_id))
        try:
            await asyncio.gather(*calls)
        except Exception:
            logger.info(
                "abort of %s did not reach every instance", attempt.attempt_id, exc_info=True
            )

    async def close_all(self, stream: RequestStream) -> None:
        for attempt in [a for a in self.live.values() if a.stream is stream]:
            await self.close(attempt)

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self.tasks.discard)
