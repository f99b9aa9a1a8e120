"""The global router: one request's way through the cluster.

    stream(request)
      id      <- the router's own (the client's id is only echoed by the front door)
      region, placement <- RegionChooser (:mod:`pdserve.router.placement`); a
                 region with no instance to serve it (scaled to zero): the request
                 waits in the ColdStartQueue while the controller starts one
      attempt <- Attempts.launch: reserve on decode, prefill into it
                 (:mod:`pdserve.router.attempts`: also migration, hedging, closing)
      tokens: first from prefill, the rest pushed by decode (``on_tokens``)
      end: counters released; a stream that did not finish is aborted on both

The router runs on one asyncio event loop (inside its Ray actor, next to the
front doors). It talks to instances only through actor handles and the
messages of :mod:`pdserve.core.messages`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pdserve.core.errors import InvalidArgumentError, PdserveError, RequestAbortedError
from pdserve.core.messages import LoadReport, TokenBatch
from pdserve.core.tokenizer import Tokenizer
from pdserve.router.admission import Admission, ColdStartQueue, RetryBudget
from pdserve.router.attempts import Attempts
from pdserve.router.config import RouterConfig
from pdserve.router.lora_admin import LoraAdmin
from pdserve.router.models import ModelCatalog, Served, ServedVersion, VersionOutcomes
from pdserve.router.observe import Observer
from pdserve.router.placement import Choice, CompletionInput, RegionChooser, RegionUnservedError
from pdserve.router.policies import make_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.reservation import RouterParts
from pdserve.router.state import ClusterView, InstanceView
from pdserve.router.stream import RequestStream, StreamDelta

logger = logging.getLogger(__name__)

__all__ = ["CompletionInput", "InstanceInfo", "Router"]


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
    model: str = ""  # the deployment key of the model version it serves (router.models)
    adapters: tuple[tuple[str, str], ...] = ()  # (name, fingerprint) of each LoRA adapter held


class Router:
    def __init__(
        self, config: RouterConfig, tokenizer: Tokenizer | None, sink: Any, vocab_size: int = 0
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer  # the cluster's own model's (catalog: every version's)
        self.catalog = ModelCatalog()
        own = (config.model_name, config.model_version, "", tokenizer, vocab_size)
        self.catalog.add(ServedVersion(*own, config.lora_adapters))
        self.outcomes = VersionOutcomes()
        self.cluster = ClusterView()
        self.prefixes = PrefixIndex()
        self.admission = Admission(
            config.max_inflight_per_region,
            config.ttft_slo_s,
            config.adaptive_admission,
            config.low_priority_share,
        )
        self.retries = RetryBudget(config.retry_budget_ratio)
        self.cold = ColdStartQueue(config.cold_start_queue, config.cold_start_timeout_s)
        self.last_max_model_len = 0  # the context limit while no decode instance is up
        self.region_inflight: dict[str, int] = defaultdict(int)
        self.chooser = RegionChooser(
            config,
            self.cluster,
            self.prefixes,
            make_policy(config.policy),
            self.admission,
            self.region_inflight,
        )
        self.obs = Observer([r.name for r in config.regions])
        parts = RouterParts(config, self.cluster, self.chooser, self.retries, sink, self.unregister)
        self.attempts = Attempts(parts, self.obs, self._place_moved)
        self.lora = LoraAdmin(self.cluster, self.catalog, metrics=self.obs.metrics)
        self.finished: dict[str, int] = defaultdict(int)
        self.placed: dict[str, int] = defaultdict(int)  # requests placed per region
        # The time from a delta being ready to the front door having written it (seconds).
        self.door_delay_s: deque[float] = deque(maxlen=4096)

    @property
    def hedged(self) -> int:
        return self.attempts.hedged

    @property
    def migrations(self) -> int:
        return self.attempts.migrations

    @property
    def decision_s(self) -> deque[float]:
        return self.chooser.decision_s

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
            info.model,
        )
        self.cluster.add(view)
        for name, fingerprint in info.adapters:
            self.cluster.set_adapter(info.instance_id, name, fingerprint)
        self.lora.instance_added(view)  # loads the model's runtime adapters in the background
        if info.role == "decode" and not info.model:
            self.last_max_model_len = info.max_model_len
        self.cold.opened(info.region)

    def unregister(self, instance_id: str) -> None:
        view = self.cluster.instances.get(instance_id)
        if view is not None:
            self.obs.forget(view.region, view.role, instance_id)
        self.cluster.remove(instance_id)
        self.prefixes.forget(instance_id)

    def set_draining(self, instance_id: str, draining: bool) -> None:
        if instance_id in self.cluster.instances:
            self.cluster.set_available(instance_id, draining)
            if not draining:
                self.cold.opened(self.cluster.instances[instance_id].region)

    def instance_lost(self, instance_id: str) -> None:
        """An instance died: forget it, and move every request it held elsewhere."""
        self.unregister(instance_id)
        self.attempts.instance_lost(instance_id)

    def drain_timed_out(self, instance_id: str) -> int:
        """A draining instance outlived its drain timeout: move every request it still
        holds elsewhere, as a lost instance's (it still runs; each is aborted there as
        it moves). How many moved."""
        return self.attempts.move_off(instance_id, f"{instance_id} outlived its drain timeout")

    async def _place_moved(self, inp: CompletionInput) -> tuple[CompletionInput, Choice]:
        """Where a moving request goes: its own version, or, once a rollout retired
        that, the version that took its traffic (:meth:`ModelCatalog.heir`); a region
        left with no instance (scaled to zero) starts one while it waits, as a new
        request does (:meth:`_choose`)."""
        heir = self.catalog.heir(inp.model)
        if heir is not None:
            logger.info("request %s moves from %r to %s", inp.request_id, inp.model, heir.label)
            inp = dataclasses.replace(inp, model=heir.key)
        return inp, await self._choose(inp)

    def on_report(self, report: LoadReport) -> None:
        view = self.cluster.instances.get(report.instance_id)
        if view is None:
            return
        view.report = report
        self.obs.load(view.region, report)
        if view.role == "prefill":
            self.prefixes.apply(
                report.instance_id,
                report.kv_added,
                report.kv_removed,
                report.kv_lower,
                report.kv_device,
            )
        self.cluster.touch(view)

    @property
    def max_model_len(self) -> int:
        return self.max_model_len_of("")

    def max_model_len_of(self, model: str) -> int:
        """The context limit of the model version with deployment key ``model``."""
        lens = [
            v.max_model_len
            for v in self.cluster.instances.values()
            if v.role == "decode" and v.model == model
        ]
        return min(lens) if lens else self.last_max_model_len

    def ready(self) -> dict[str, int]:
        """Available instances per role (the readiness check wants both roles)."""
        counts = {"prefill": 0, "decode": 0}
        for view in self.cluster.instances.values():
            if view.available:
                counts[view.role] = counts.get(view.role, 0) + 1
        return counts

    def tables(self) -> dict[str, int]:
        """Sizes of everything the router keeps per request; all 0 at rest."""
        views = self.cluster.instances.values()
        return {
            "attempts": len(self.attempts.live),
            "tasks": len(self.attempts.tasks),
            "region_inflight": sum(self.region_inflight.values()),
            "instance_inflight": sum(v.inflight for v in views),
            "pending_prompt_tokens": sum(v.pending_prompt_tokens for v in views),
        }

    # -- tokens in ----------------------------------------------------------------------------

    def on_tokens(self, batch: TokenBatch) -> None:
        self.attempts.on_tokens(batch)

    def reject(self, error: BaseException, region: str | None = None) -> None:
        """A request refused before it started (bad input, auth, overload)."""
        status = _status(error)
        self.obs.rejected(status)
        self.obs.finished(region or self.config.home_region, status, None)

    def delivered(self, delta: StreamDelta) -> None:
        """A front door wrote ``delta`` to its client (one delay per delta the stream
        made, when several left as one)."""
        now = time.monotonic()
        for ready_at in delta.parts_ready_at or (delta.ready_at,):
            self.door_delay_s.append(now - ready_at)

    # -- one request ---------------------------------------------------------------------------

    async def stream(self, inp: CompletionInput) -> AsyncGenerator[StreamDelta, None]:
        """The request's deltas, the last with its finish reason; aborts it if not consumed."""
        self._check_region(inp)
        self.obs.arrived(
            inp.region or self.config.home_region, len(inp.prompt_token_ids), inp.model
        )
        inp, capped = self._degrade(inp)
        try:
            choice = await self._choose(inp)
        except PdserveError as e:
            self.reject(e, inp.region or self.config.home_region)
            raise
        # The router's own id: the client's (validated printable) plus a random part,
        # so a grep for the client's id still finds every line, and no client can
        # name another's request or attempt.
        rid = f"{inp.request_id}.{uuid.uuid4().hex[:16]}"
        logger.info(
            "request %s: region %s, %d prompt tokens",
            rid,
            choice.region,
            len(inp.prompt_token_ids),
        )
        stream = RequestStream(
            rid,
            inp.prompt_token_ids,
            inp.params,
            self._tokenizer(inp.model),
            self.config.stream_idle_timeout_s,
        )
        stream.max_tokens_capped = capped
        async with contextlib.aclosing(self._serve(stream, inp, choice)) as deltas:
            async for delta in deltas:
                yield delta

    async def _choose(self, inp: CompletionInput) -> Choice:
        """The chooser's choice; while the home region lacks a role (scaled to zero),
        the request waits in the cold-start queue for the controller to start one."""
        deadline: float | None = None
        while True:
            try:
                return self.chooser.choose(inp)
            except RegionUnservedError as e:
                if not self.cold.enabled or e.model:  # only the cluster's own model scales to 0
                    raise
                if deadline is None:
                    deadline = time.monotonic() + self.config.cold_start_timeout_s
                await self.cold.wait(e.region, e.roles, deadline)

    def _check_region(self, inp: CompletionInput) -> None:
        """Refuse a request naming a region the cluster lacks before any table sees its
        name: the router's and the controller's tables are indexed by validated names
        only (20,000 requests naming made-up regions once left 20,000 entries)."""
        regions = [r.name for r in self.config.regions]
        if inp.region and inp.region not in regions:
            error = InvalidArgumentError("region", f"unknown region; known: {regions}")
            self.reject(error)
            raise error

    def _degrade(self, inp: CompletionInput) -> tuple[CompletionInput, int | None]:
        """Under overload, a request of negative priority gets a smaller ``max_tokens``.

        From ``low_priority_degrade_at`` of the low-priority cap of its home
        region on, its ``max_tokens`` is capped at ``low_priority_max_tokens``
        (reported in its usage), before admission refuses it at the cap itself.
        """
        cfg = self.config
        if inp.params.priority >= 0 or inp.params.max_tokens <= cfg.low_priority_max_tokens:
            return inp, None
        home = inp.region or cfg.home_region
        limit = self.admission.limit(home, inp.params.priority)
        if self.region_inflight.get(home, 0) < cfg.low_priority_degrade_at * limit:
            return inp, None
        self.obs.degraded(home)
        params = dataclasses.replace(inp.params, max_tokens=cfg.low_priority_max_tokens)
        return dataclasses.replace(inp, params=params), cfg.low_priority_max_tokens

    async def _serve(
        self, stream: RequestStream, inp: CompletionInput, choice: Choice
    ) -> AsyncGenerator[StreamDelta, None]:
        region = choice.region
        self.region_inflight[region] += 1
        self.placed[region] += 1
        self.retries.on_request()
        try:
            home = inp.region or self.config.home_region
            if region != home:
                await asyncio.sleep(self.config.latency(home, region))  # emulated distance
            first = await self.attempts.launch(stream, inp, choice, 0)
            if self.config.hedge_after_s is not None:
                await self.attempts.hedge(first, choice.hashes)
            async for delta in stream.deltas():
                if (
                    delta.token_ids
                    and stream.first_token_at is not None
                    and len(stream.tokens) == len(delta.token_ids)
                ):
                    self.admission.observe(region, stream.first_token_at - stream.arrival)
                yield delta
            # The streams that the same token batch woke write their deltas before this
            # finished request's bookkeeping runs (a front door's write may not yield).
            await asyncio.sleep(0)
            self.finished["ok"] += 1
            self.obs.finished(region, stream.finish_reason or "stop", stream)
            self._outcome(inp, stream, True, region)
        except BaseException as e:
            self.finished[_status(e)] += 1
            self._outcome(inp, stream, _status(e) == "cancelled", region)
            self.obs.finished(region, _status(e), None)
            logger.info("request %s ended: %s", stream.request_id, _status(e))
            raise
        finally:
            self.region_inflight[region] -= 1
            stream.fail(RequestAbortedError(f"{stream.request_id} ended"))  # no-op if finished
            await self.attempts.close_all(stream)

    def resolve(self, model: object) -> Served:
        """The version a request naming ``model`` is served by (picked by the traffic
        shares of a rollout), and the LoRA adapter it names (None: the base model)."""
        name, lora = self.catalog.resolve(model)
        return self.catalog.pick(name), lora

    def _tokenizer(self, model: str) -> Tokenizer | None:
        version = self.catalog.by_key(model) if model else None
        return version.tokenizer if version is not None else self.tokenizer

    def _outcome(self, inp: CompletionInput, stream: RequestStream, ok: bool, region: str) -> None:
        """Count a finished request for its version (a client's cancel is no failure)."""
        ttft = tpot = None
        if stream.first_token_at is not None:
            ttft = stream.first_token_at - stream.arrival
            times = stream.token_times
            if len(times) > 1:
                tpot = (times[-1] - times[0]) / (len(times) - 1)
        self.outcomes.record(inp.model, ok, ttft, tpot)
        if ok and stream.finish_reason is not None:
            self.obs.model_finished(region, inp.model, ttft, tpot, len(stream.token_times))
        if inp.served_as:  # name@version, as the front door resolved it
            name, _, version = inp.served_as.rpartition("@")
            outcome = "ok" if ok else "failed"
            self.obs.metrics["pdserve_model_requests_total"].labels(name, version, outcome).inc()


def _status(e: BaseException) -> str:
    if isinstance(e, asyncio.CancelledError | GeneratorExit | RequestAbortedError):
        return "cancelled"
    if isinstance(e, PdserveError):
        return e.grpc_code.lower()
    return "error"
