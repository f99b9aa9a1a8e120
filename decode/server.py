"""The decode role: hold pages for prompts prefilled elsewhere, then decode them.

A :class:`DecodeServer` lives on the leader of a decode instance, around the same
:class:`~pdserve.engine.engine.EngineCore` the prefill role uses. Its role is:

- ``reserve``: hold pages for a prompt under a lease (or refuse when full, so
  the router waits or goes elsewhere);
- ``commit``: the prefill's hand-off arrived; the request joins the batch
  (connectors that need arrival marks make every rank check them first);
- ``submit``: a request short or cached enough to prefill right here;
- a prompt whose prefix a peer prefill instance holds is pre-filled from that
  peer's cache, and the rest prefilled here (:mod:`pdserve.decode.peer`);
- leases expire after their TTL; a peer that dies has its holds released;
- every step, one :class:`~pdserve.core.messages.TokenBatch` per subscriber
  carries every new token of that subscriber's requests. Callers without a
  subscriber collect finished outputs with ``wait``.

Page ownership is tabled in :mod:`pdserve.transfer.handoff`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import RayActorError

from pdserve.core.config import DisaggregationConfig
from pdserve.core.errors import InstanceFailedError, OverloadedError
from pdserve.core.layout import Layout
from pdserve.core.messages import (
    DecodeRequest,
    Reservation,
    ReserveRequest,
    TokenBatch,
    TokenUpdate,
)
from pdserve.core.request import RequestOutput
from pdserve.core.step import KVArrival, StepPlan
from pdserve.decode.peer import start_peer_fill
from pdserve.engine.engine import EngineCore
from pdserve.engine.loop import EngineLoop, LoadReporter
from pdserve.engine.role import RolePolicy
from pdserve.transfer.handoff import HandOff, LeaseTable
from pdserve.transfer.peer_pull import PeerPull
from pdserve.transfer.routes import plan_routes, routes_into
from pdserve.transfer.stats import LeaseStats

logger = logging.getLogger(__name__)

LEASE_CHECK_S = 0.25
HEARTBEAT_S = 2.0


class DecodeServer:
    def __init__(
        self,
        instance_id: str,
        engine: EngineCore,
        layout: Layout,
        needs_arrival_marks: bool,
        config: DisaggregationConfig,
    ) -> None:
        self.instance_id = instance_id
        self.config = config
        self.layout = layout
        self.num_kv_heads = engine.model.num_kv_heads
        self.needs_arrival_marks = needs_arrival_marks
        self.leases = LeaseTable()
        self.stats = LeaseStats()
        self.prefills: dict[str, tuple[Any, Layout]] = {}
        self._pings: dict[str, Any] = {}
        self._arrivals: list[KVArrival] = []
        self._sinks: dict[str, Any] = {}  # request id -> subscriber actor handle
        self._transfer_s: dict[str, float] = {}  # request id -> exposed transfer seconds
        self._done: dict[str, Future[RequestOutput]] = {}
        self._done_lock = threading.Lock()
        engine.use_role(RolePolicy(plan=self._annotate))
        self.loop = EngineLoop(
            engine, self.on_outputs, self._on_fatal, name=f"pdserve-decode-{instance_id}"
        )
        self.pulls = PeerPull(
            instance_id,
            layout,
            self.num_kv_heads,
            needs_arrival_marks,
            self.loop.call,
        )
        self.reports = LoadReporter(self.loop, instance_id, "decode")
        self.loop.every(LEASE_CHECK_S, self._expire)
        self.loop.every(HEARTBEAT_S, self._heartbeat)

    # -- called from actor threads -------------------------------------------------------

    def register_prefill(self, prefill_id: str, leader: Any, layout: Layout) -> None:
        def add(_: EngineCore) -> None:
            self.prefills[prefill_id] = (leader, layout)

        self.loop.call(add).result()

    def forget_prefill(self, prefill_id: str) -> None:
        self.loop.call(lambda _: self.prefills.pop(prefill_id, None)).result()

    def reserve(self, request: ReserveRequest, prefill_id: str | None, sink: Any) -> Reservation:
        """Hold pages for a prompt; raises OverloadedError when there is no room now."""
        return self.loop.call(
            lambda engine: self._reserve(engine, request, prefill_id, sink)
        ).result()

    def commit(self, handoff: HandOff) -> bool:
        """Take over a prefilled request; False if its lease is gone (expired or aborted)."""
        return self.loop.call(lambda engine: self._commit(engine, handoff)).result()

    def cancel(self, request_id: str) -> None:
        """The prefill will not hand this request off (its first token ended it)."""
        self.loop.call(lambda engine: self._free_reservation(engine, request_id, notify=False))

    def submit(self, request: DecodeRequest, sink: Any) -> None:
        """Prefill and decode a whole request here."""

        def add(engine: EngineCore) -> None:
            engine.add_request(request.request_id, request.prompt_token_ids, request.params)
            self.subscribe(request.request_id, sink)

        self.loop.call(add).result()

    def abort(self, request_id: str) -> bool:
        return self.loop.call(lambda engine: self._abort(engine, request_id)).result()

    def wait(self, request_ids: list[str], timeout_s: float | None) -> list[RequestOutput]:
        """Finished outputs of requests submitted without a subscriber."""
        with self._done_lock:
            futures = [self._done.setdefault(rid, Future()) for rid in request_ids]
        outputs = [f.result(timeout_s) for f in futures]
        with self._done_lock:
            for rid in request_ids:
                self._done.pop(rid, None)
        return outputs

    def _on_fatal(self, error: BaseException) -> None:
        """The engine stopped (a rank died): fail every waiter instead of leaving it hanging."""
        with self._done_lock:
            waiting = [f for f in self._done.values() if not f.done()]
        for future in waiting:
            future.set_exception(InstanceFailedError(f"decode {self.instance_id} stopped: {error}"))

    # -- on the loop thread -------------------------------------------------------------------

    def subscribe(self, request_id: str, sink: Any) -> None:
        if sink is not None:
            self._sinks[request_id] = sink
        else:
            with self._done_lock:
                self._done.setdefault(request_id, Future())

    def _reserve(
        self, engine: EngineCore, request: ReserveRequest, prefill_id: str | None, sink: Any
    ) -> Reservation:
        if request.peer is not None and (res := start_peer_fill(self, engine, request, sink)):
            return res
        if self._prefill_here(engine, request):
            engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                output_offset=request.output_offset,
            )
            self.subscribe(request.request_id, sink)
            logger.info(
                "decode %s: prefills its %d prompt tokens here on %s",
                request.request_id,
                len(request.prompt_token_ids),
                self.instance_id,
            )
            return Reservation(
                request.request_id, self.instance_id, [], 0, request.ttl_s, local=True
            )
        held = engine.reserve(
            request.request_id, request.prompt_token_ids, request.params, request.output_offset
        )
        if held is None:
            self.stats.refused += 1
            raise OverloadedError(
                f"decode {self.instance_id} has no room for {len(request.prompt_token_ids)} "
                f"prompt tokens now ({engine.kv.num_free_blocks} free pages)",
                retry_after_s=0.5,
            )
        block_ids, cached = held
        self.leases.add(request.request_id, prefill_id, request.ttl_s)
        self.stats.reserved += 1
        self.subscribe(request.request_id, sink)
        logger.info(
            "decode %s: reserved %d pages on %s (%d tokens cached) for %s",
            request.request_id,
            len(block_ids),
            self.instance_id,
            cached,
            prefill_id,
        )
        return Reservation(request.request_id, self.instance_id, block_ids, cached, request.ttl_s)

    def _prefill_here(self, engine: EngineCore, request: ReserveRequest) -> bool:
        """Short prompts, and prompts mostly cached here, skip the prefill instance."""
        if request.prefill_here:
            return True
        ids, params = request.prompt_token_ids, request.params
        return self.config.prefills_locally(
            len(ids), lambda: engine.cached_prefix_tokens(ids, params)
        )

    def _commit(self, engine: EngineCore, handoff: HandOff) -> bool:
        if self.needs_arrival_marks and handoff.prefill_id not in self.prefills:
            # Its pages' arrival cannot be checked: the sender is no longer paired.
            if handoff.request_id in self.leases.leases:
                self.stats.peer_lost += 1
                self._free_reservation(engine, handoff.request_id, notify=True)
            return False
        lease = self.leases.take(handoff.request_id)
        if lease is None:
            return False
        table = engine.kv.block_table(handoff.request_id)
        assert table[: len(handoff.block_ids)] == handoff.block_ids, "hand-off names other pages"
        out = engine.activate(handoff.request_id, handoff.first_token, handoff.first_logprobs)
        if handoff.prefilled_at:
            self._transfer_s[handoff.request_id] = max(0.0, time.time() - handoff.prefilled_at)
        logger.info(
            "decode %s: hand-off from %s landed on %s (%.1f ms after its prefill)",
            handoff.request_id,
            handoff.prefill_id,
            self.instance_id,
            self._transfer_s.get(handoff.request_id, 0.0) * 1e3,
        )
        self.stats.committed += 1
        if self.needs_arrival_marks:
            _, layout = self.prefills[handoff.prefill_id]
            routes = plan_routes(self.num_kv_heads, layout, self.layout)
            expected = [routes_into(routes, r) for r in range(self.layout.world_size)]
            self._arrivals.append(KVArrival(handoff.request_id, expected))
        if out.finished:  # the first token completed a stop string
            self.on_outputs([out])
        return True

    def _annotate(self, plan: StepPlan) -> StepPlan:
        if not self._arrivals and not self.pulls.arrivals:
            return plan
        arrivals, self._arrivals = self._arrivals + self.pulls.take_arrivals(), []
        return dataclasses.replace(plan, kv_arrivals=arrivals)  # keeps the plan's tier work

    def _abort(self, engine: EngineCore, request_id: str) -> bool:
        if self.pulls.cancel(request_id):  # ends once its peer answered
            return True
        lease = self.leases.leases.get(request_id)
        if lease is not None:
            if not lease.revoking:  # one being revoked is counted already (expired, lost)
                self.stats.aborted += 1
            self._revoke(engine, request_id)
            return True
        out = engine.abort_request(request_id)
        if out is None:
            return False
        self.stats.aborted += 1
        self.on_outputs([out])
        return True

    def _expire(self, engine: EngineCore) -> None:
        for lease in self.leases.expired():
            logger.warning("lease of %s expired before its hand-off", lease.request_id)
            self.stats.expired += 1
            self._revoke(engine, lease.request_id)

    def _revoke(self, engine: EngineCore, request_id: str) -> None:
        """Free a reservation once its prefill can no longer write into it."""
        lease = self.leases.leases[request_id]
        if lease.revoking:
            return
        lease.revoking = True
        peer = self.prefills.get(lease.prefill_id) if lease.prefill_id else None
        if peer is None:
            self._free_reservation(engine, request_id, notify=True)
            return
        ref = peer[0].drop.remote(request_id)
        ref.future().add_done_callback(
            lambda _: self.loop.call(lambda e: self._free_reservation(e, request_id, notify=True))
        )

    def _free_reservation(self, engine: EngineCore, request_id: str, notify: bool) -> None:
        self.leases.leases.pop(request_id, None)
        out = engine.abort_request(request_id)
        if out is None:
            return
        if notify:
            self.on_outputs([out])
            return
        # The router already knows (from the first token); settle local waiters only.
        self._sinks.pop(request_id, None)
        with self._done_lock:
            future = self._done.get(request_id)
        if future is not None and not future.done():
            future.set_result(out)

    def _heartbeat(self, engine: EngineCore) -> None:
        """Release the holds of prefill instances that died."""
        for prefill_id, ref in list(self._pings.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self._pings[prefill_id]
            try:
                ray.get(ready[0])
            except RayActorError:
                self._peer_lost(engine, prefill_id)
        for prefill_id, (leader, _) in self.prefills.items():
            self._pings.setdefault(prefill_id, leader.ping.remote())

    def _peer_lost(self, engine: EngineCore, prefill_id: str) -> None:
        logger.warning("prefill %s is gone; releasing its reservations", prefill_id)
        self.prefills.pop(prefill_id, None)
        for lease in self.leases.of_prefill(prefill_id):
            self.stats.peer_lost += 1
            self._free_reservation(engine, lease.request_id, notify=True)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        batches: dict[Any, list[TokenUpdate]] = defaultdict(list)
        for out in outputs:
            rid = out.request_id
            transfer_s = self._transfer_s.pop(rid, None) if out.finished else None
            if out.finished:
                logger.info(
                    "decode %s: finished (%s) after %d tokens on %s",
                    rid,
                    out.outputs[0].finish_reason,
                    len(out.outputs[0].token_ids),
                    self.instance_id,
                )
            if rid in self._sinks:
                sink = self._sinks[rid] if not out.finished else self._sinks.pop(rid)
                update = _update(out)
                if out.finished:
                    update.phases.update(out.metrics.phases())
                    if transfer_s is not None:
                        update.phases["transfer"] = transfer_s
                batches[sink].append(update)
            elif out.finished:
                with self._done_lock:
                    future = self._done.get(rid)
                if future is not None and not future.done():
                    future.set_result(out)
        for sink, updates in batches.items():
            sink.deliver.remote(TokenBatch(self.instance_id, updates))


def _update(out: RequestOutput) -> TokenUpdate:
    comp = out.outputs[0]
    prompt = None  # with the first tokens of a prompt prefilled here, when asked for
    first = len(comp.token_ids) == len(out.new_token_ids)
    if out.prompt_logprobs is not None and first:
        prompt = [e for e in out.prompt_logprobs if e]  # (the first token's is None)
    here = first and out.metrics.activated_time is None  # not a hand-off: prefilled here
    return TokenUpdate(
        out.request_id,
        out.new_token_ids,
        out.new_text,
        out.finished,
        comp.finish_reason,
        len(comp.token_ids),
        new_logprobs=out.new_logprobs,
        prompt_logprobs=prompt,
        num_cached_tokens=out.metrics.num_cached_prompt_tokens if here else None,
    )
