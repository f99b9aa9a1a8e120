"""The global router: one request's way through the cluster.

    stream(request)
      region  <- home unless its estimated TTFT + the latency to another region
                 is worse there (spill-over); regions at their admission limit skip
      placement <- the policy's prefill and decode instance in that region
      reserve pages on decode (refused: another decode, within the retry budget)
      prefill into the reservation (unless decode prefills it itself)
      tokens: first from prefill, the rest pushed by decode (``on_tokens``)
      end: counters released; a stream that did not finish is aborted on both

The router runs on one asyncio event loop (inside its Ray actor, next to the
front doors). It talks to instances only through actor handles and the
messages of :mod:`pdserve.core.messages`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict, deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.core.errors import (
    InstanceFailedError,
    InvalidArgumentError,
    OverloadedError,
    PdserveError,
    RequestAbortedError,
)
from pdserve.core.messages import (
    FirstToken,
    LoadReport,
    PrefillRequest,
    Reservation,
    ReserveRequest,
    TokenBatch,
)
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer
from pdserve.router.admission import Admission, RetryBudget
from pdserve.router.config import RouterConfig
from pdserve.router.observe import Observer
from pdserve.router.policies import Placement, RoutingRequest, make_policy
from pdserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.router.state import ClusterView, InstanceView
from pdserve.router.stream import RequestStream, StreamDelta, StreamFailed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceInfo:
    """What the router needs to know of an instance to send it requests."""

    instance_id: str
    role: str
    region: str
    handle: Any
    block_size: int
    max_model_len: int
    paired: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompletionInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    region: str | None = None


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
    first_token_seen: bool = False
    closed: bool = False


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None, sink: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.sink = sink  # this router's actor handle: decode instances push tokens to it
        self.cluster = ClusterView()
        self.prefixes = PrefixIndex()
        self.policy = make_policy(config.policy)
        self.admission = Admission(
            config.max_inflight_per_region, config.ttft_slo_s, config.adaptive_admission
        )
        self.retries = RetryBudget(config.retry_budget_ratio)
        self.region_inflight: dict[str, int] = defaultdict(int)
        self._attempts: dict[str, Attempt] = {}
        self._active: set[str] = set()  # request ids in flight
        self.finished: dict[str, int] = defaultdict(int)
        self.placed: dict[str, int] = defaultdict(int)  # requests placed per region
        self.hedged = 0
        self.migrations = 0
        # Recent latencies the router adds: placement decisions, and the time from
        # a delta being ready to the front door having written it (seconds).
        self.decision_s: deque[float] = deque(maxlen=4096)
        self.door_delay_s: deque[float] = deque(maxlen=4096)
        self._tasks: set[asyncio.Future[None]] = set()
        self.obs = Observer()

    # -- cluster membership and reports ------------------------------------------------------

    def register(self, info: InstanceInfo) -> None:
        view = InstanceView(
            info.instance_id,
            info.role,
            info.region,
            info.handle,
            info.block_size,
            info.max_model_len,
            set(info.paired),
        )
        self.cluster.add(view)

    def unregister(self, instance_id: str) -> None:
        view = self.cluster.instances.get(instance_id)
        if view is not None:
            self.obs.forget(view.region, view.role, instance_id)
        self.cluster.remove(instance_id)
        self.prefixes.forget(instance_id)

    def set_draining(self, instance_id: str, draining: bool) -> None:
        if instance_id in self.cluster.instances:
            self.cluster.set_available(instance_id, draining)

    def instance_lost(self, instance_id: str) -> None:
        """An instance died: forget it, and move every request it held elsewhere."""
        self.unregister(instance_id)
        for attempt in list(self._attempts.values()):
            on_prefill = attempt.prefill is not None and attempt.prefill.instance_id == instance_id
            on_decode = attempt.decode is not None and attempt.decode.instance_id == instance_id
            if on_decode or (on_prefill and not attempt.first_token_seen):
                self._spawn(self._migrate(attempt, f"{instance_id} was lost"))

    def on_report(self, report: LoadReport) -> None:
        view = self.cluster.instances.get(report.instance_id)
        if view is None:
            return
        view.report = report
        self.obs.load(view.region, report)
        if view.role == "prefill":
            self.prefixes.apply(report.instance_id, report.kv_added, report.kv_removed)
        self.cluster.touch(view)

    @property
    def max_model_len(self) -> int:
        lens = [v.max_model_len for v in self.cluster.instances.values() if v.role == "decode"]
        return min(lens) if lens else 0

    # -- tokens in ----------------------------------------------------------------------------

    def on_tokens(self, batch: TokenBatch) -> None:
        for u in batch.updates:
            attempt = self._attempts.get(u.request_id)
            if attempt is None or attempt.closed:
                continue
            if u.finished and u.finish_reason == "abort":  # the instance gave up on it
                self._spawn(self._migrate(attempt, f"decode {batch.instance_id} ended it early"))
                continue
            if u.finished:
                self.obs.phases(attempt.region, u.phases)
            start = attempt.offset + u.num_output_tokens - len(u.new_token_ids)
            attempt.stream.add(
                start, u.new_token_ids, u.finish_reason if u.finished else None, attempt.attempt_id
            )

    def reject(self, error: BaseException, region: str | None = None) -> None:
        """A request refused before it started (bad input, auth, overload)."""
        status = _status(error)
        self.obs.rejected(status)
        self.obs.finished(region or self.config.home_region, status, None)

    def delivered(self, delta: StreamDelta) -> None:
        """A front door wrote ``delta`` to its client."""
        self.door_delay_s.append(time.monotonic() - delta.ready_at)

    # -- one request ---------------------------------------------------------------------------

    async def stream(self, inp: CompletionInput) -> AsyncGenerator[StreamDelta, None]:
        """The request's deltas, the last with its finish reason; aborts it if not consumed."""
        try:
            if inp.request_id in self._active:
                raise InvalidArgumentError("request_id", f"{inp.request_id!r} is already in flight")
            region, placement, hashes = self._choose_region(inp)
        except PdserveError as e:
            self.reject(e, inp.region or self.config.home_region)
            raise
        logger.info(
            "request %s: region %s, %d prompt tokens",
            inp.request_id,
            region,
            len(inp.prompt_token_ids),
        )
        stream = RequestStream(inp.request_id, inp.prompt_token_ids, inp.params, self.tokenizer)
        self._active.add(inp.request_id)
        self.region_inflight[region] += 1
        self.placed[region] += 1
        self.retries.on_request()
        try:
            home = inp.region or self.config.home_region
            if region != home:
                await asyncio.sleep(self.config.latency(home, region))  # emulated distance
            first = await self._launch(stream, inp, region, placement, hashes, 0)
            if self.config.hedge_after_s is not None:
                await self._hedge(first, hashes)
            async for delta in stream.deltas():
                if (
                    delta.token_ids
                    and stream.first_token_at is not None
                    and len(stream.tokens) == len(delta.token_ids)
                ):
                    self.admission.observe(region, stream.first_token_at - stream.arrival)
                yield delta
            self.finished["ok"] += 1
            self.obs.finished(region, stream.finish_reason or "stop", stream)
        except BaseException as e:
            self.finished[_status(e)] += 1
            self.obs.finished(region, _status(e), None)
            logger.info("request %s ended: %s", inp.request_id, _status(e))
            raise
        finally:
            self.region_inflight[region] -= 1
            self._active.discard(inp.request_id)
            for attempt in [a for a in self._attempts.values() if a.stream is stream]:
                await self._close(attempt)

    def _choose_region(self, inp: CompletionInput) -> tuple[str, Placement, dict[int, list[bytes]]]:
        """The region to serve in, and the policy's placement there (scored once)."""
        start = time.perf_counter()
        try:
            return self._choose_region_now(inp)
        finally:
            self.decision_s.append(time.perf_counter() - start)

    def _choose_region_now(
        self, inp: CompletionInput
    ) -> tuple[str, Placement, dict[int, list[bytes]]]:
        home = inp.region or self.config.home_region
        regions = [r.name for r in self.config.regions]
        if home not in regions:
            raise InvalidArgumentError("region", f"unknown region {home!r}; known: {regions}")
        hashes: dict[int, list[bytes]] = {}
        best: tuple[float, str, Placement] | None = None
        for region in regions:
            decodes = self.cluster.table("decode", region)
            if not len(decodes) or not self.admission.admit(region, self.region_inflight[region]):
                continue
            placement = self._score(inp, region, hashes)
            cost = placement.est_ttft_s + 2 * self.config.latency(home, region)
            if region == home:
                cost -= 1e-9  # ties stay home
            if best is None or cost < best[0]:
                best = (cost, region, placement)
        if best is None:
            raise OverloadedError(
                f"no region can take the request now (home {home!r} is at its limit)",
                retry_after_s=1.0,
            )
        return best[1], best[2], hashes

    def _score(
        self, inp: CompletionInput, region: str, hashes: dict[int, list[bytes]]
    ) -> Placement:
        prefills = self.cluster.table("prefill", region)
        decodes = self.cluster.table("decode", region)
        if not len(decodes):
            raise OverloadedError(
                f"region {region!r} has no decode instance available", retry_after_s=1.0
            )
        bs = decodes.block_tokens
        if bs not in hashes:
            hashes[bs] = prompt_block_hashes(inp.prompt_token_ids, bs)
        cached = np.zeros(len(prefills))
        for instance, blocks in self.prefixes.cached_prefixes(hashes[bs]).items():
            row = prefills.index.get(instance)
            if row is not None:
                cached[row] = blocks
        req = RoutingRequest(len(inp.prompt_token_ids), inp.params.max_tokens, cached, bs)
        return self.policy.place(req, prefills, decodes)

    # -- attempts ----------------------------------------------------------------------------------

    async def _launch(
        self,
        stream: RequestStream,
        inp: CompletionInput,
        region: str,
        placement: Placement,
        hashes: dict[int, list[bytes]],
        offset: int,
    ) -> Attempt:
        """Reserve (trying other decode instances if refused) and start the prefill."""
        # Ids are never reused: an instance may still hold an earlier attempt's pages.
        n = stream.attempts_started
        stream.attempts_started += 1
        attempt_id = inp.request_id if n == 0 else f"{inp.request_id}#{n}"
        attempt = Attempt(attempt_id, stream, inp, offset, region)
        self._attempts[attempt_id] = attempt
        if offset:
            stream.owner = attempt_id  # a migration: only the new attempt feeds the stream
        refused: set[str] = set()
        while True:
            prefill = (
                self.cluster.table("prefill", region).views[placement.prefill]
                if placement.prefill is not None
                else None
            )
            decode = self.cluster.table("decode", region).views[placement.decode]
            if decode.instance_id in refused:
                raise OverloadedError(
                    f"every decode instance of {region!r} is full", retry_after_s=0.5
                )
            # Counted from the choice on, so arrivals placed before this reservation
            # returns see it (and spread).
            decode.inflight += 1
            self.cluster.touch(decode)
            try:
                reservation = await self._reserve(attempt, prefill, decode)
                break
            except BaseException as e:
                decode.inflight -= 1
                self.cluster.touch(decode)
                if not isinstance(e, OverloadedError | InstanceFailedError):
                    raise
                if isinstance(e, InstanceFailedError):
                    self.unregister(decode.instance_id)  # dead: the controller replaces it
                refused.add(decode.instance_id)
                if not self.retries.try_spend():
                    raise
                placement = self._score(inp, region, hashes)
        logger.info(
            "request %s: attempt %s, prefill %s, decode %s",
            inp.request_id,
            attempt_id,
            "-" if reservation.local or prefill is None else prefill.instance_id,
            decode.instance_id,
        )
        attempt.decode = decode
        stream.cached_prompt_tokens = reservation.num_cached_tokens
        if not reservation.local and prefill is not None:
            attempt.prefill = prefill
            prefill.inflight += 1
            prefill.pending_prompt_tokens += len(inp.prompt_token_ids)
            self.cluster.touch(prefill)
            request = PrefillRequest(
                attempt_id, inp.prompt_token_ids, inp.params, reservation, offset
            )
            self._spawn(self._first_token(attempt, prefill.handle.prefill.remote(request)))
        return attempt

    async def _reserve(
        self, attempt: Attempt, prefill: InstanceView | None, decode: InstanceView
    ) -> Reservation:
        inp = attempt.inp
        request = ReserveRequest(
            attempt.attempt_id,
            inp.prompt_token_ids,
            inp.params,
            self.config.reservation_ttl_s,
            attempt.offset,
        )
        prefill_id = prefill.instance_id if prefill is not None else None
        try:
            reservation: Reservation = await decode.handle.reserve.remote(
                request, prefill_id, self.sink
            )
            return reservation
        except Exception as e:
            raise _cause(e) from None

    async def _first_token(self, attempt: Attempt, ref: Any) -> None:
        assert attempt.prefill is not None
        prefill, tokens = attempt.prefill, len(attempt.inp.prompt_token_ids)
        try:
            first: FirstToken = await ref
            attempt.first_token_seen = True
            self.obs.phases(attempt.region, first.phases)
            if not attempt.closed:
                reason = first.finish_reason if first.finished else None
                attempt.stream.add(attempt.offset, [first.token_id], reason, attempt.attempt_id)
        except Exception as e:
            cause = _cause(e)
            if isinstance(cause, InstanceFailedError):
                self.instance_lost(prefill.instance_id)  # moves this attempt, and its siblings
            elif not attempt.closed and not isinstance(cause, RequestAbortedError):
                await self._migrate(attempt, f"prefill {prefill.instance_id} failed: {cause}")
        finally:
            prefill.pending_prompt_tokens -= tokens
            self.cluster.touch(prefill)

    async def _migrate(self, attempt: Attempt, why: str) -> None:
        """Serve the rest of the request on another pair: its prompt plus what streamed."""
        try:
            await self._migrate_now(attempt, why)
        except Exception as e:  # never leave a client waiting on a stream nobody feeds
            logger.exception("migrating %s failed", attempt.stream.request_id)
            attempt.stream.fail(_cause(e))

    async def _migrate_now(self, attempt: Attempt, why: str) -> None:
        if attempt.closed:
            return
        stream = attempt.stream
        await self._close(attempt)
        if stream.finished:
            return
        if any(a.stream is stream for a in self._attempts.values()):
            return  # a hedged twin carries on
        if stream.migrations >= self.config.max_migrations:
            stream.fail(StreamFailed(f"{stream.request_id}: {why}; no attempt left"))
            return
        stream.migrations += 1
        self.migrations += 1
        self.obs.migrated(attempt.region, "decode" if attempt.first_token_seen else "prefill")
        logger.warning(
            "migrating %s (%s) after %d tokens", stream.request_id, why, len(stream.tokens)
        )
        done = len(stream.tokens)
        original = stream.params
        params = dataclasses.replace(
            original,
            max_tokens=original.max_tokens - done,
            min_tokens=max(0, original.min_tokens - done),
        )
        inp = CompletionInput(
            stream.request_id, stream.prompt_token_ids + stream.tokens, params, attempt.inp.region
        )
        deadline = time.monotonic() + self.config.migration_wait_s
        while True:
            try:
                region, placement, hashes = self._choose_region(inp)
                await self._launch(stream, inp, region, placement, hashes, done)
                return
            except (OverloadedError, InstanceFailedError) as e:
                if time.monotonic() >= deadline or stream.finished:
                    stream.fail(e)
                    return
                await asyncio.sleep(0.5)  # no pair free yet: the controller is replacing one
            except Exception as e:
                stream.fail(_cause(e))
                return

    async def _hedge(self, first: Attempt, hashes: dict[int, list[bytes]]) -> None:
        """Start a second attempt if the first token is late; keep whichever answers first."""
        assert self.config.hedge_after_s is not None
        stream = first.stream
        if await stream.wait_first_token(self.config.hedge_after_s) or not self.retries.try_spend():
            return
        self.hedged += 1
        second = await self._launch(
            stream, first.inp, first.region, self._score(first.inp, first.region, hashes), hashes, 0
        )
        await stream.wait_first_token(None)
        # Both feed the same stream from index 0 (it keeps the first copy of each
        # token); the attempt that has not produced a token yet goes.
        loser = second if first.first_token_seen or not second.first_token_seen else first
        await self._close(loser)

    async def _close(self, attempt: Attempt) -> None:
        """Forget one attempt; abort it on its instances unless its stream completed."""
        if attempt.closed:
            return
        attempt.closed = True
        self._attempts.pop(attempt.attempt_id, None)
        for view in (attempt.prefill, attempt.decode):
            if view is not None:
                view.inflight -= 1
                self.cluster.touch(view)
        if attempt.stream.completed or attempt.decode is None:
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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)


def _cause(e: BaseException) -> BaseException:
    if isinstance(e, PdserveError):
        return e
    cause = getattr(e, "cause", None)
    if isinstance(cause, PdserveError):
        return cause
    if type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
        return InstanceFailedError(str(e))
    return e


def _status(e: BaseException) -> str:
    if isinstance(e, asyncio.CancelledError | GeneratorExit | RequestAbortedError):
        return "cancelled"
    if isinstance(e, PdserveError):
        return e.grpc_code.lower()
    return "error"
