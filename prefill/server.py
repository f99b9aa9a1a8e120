"""The prefill role: run prompts, return the first token at once, stream the KV.

A :class:`PrefillServer` lives on the leader of a prefill instance, around the
same :class:`~pdserve.engine.engine.EngineCore` a decode instance uses. What
makes it the prefill role is small:

- each request runs with ``max_tokens=1`` and keeps its pages when it finishes
  (``hold_kv``), until the decode instance acknowledges the hand-off;
- before each step, ``_annotate`` adds to the plan the pages of every request
  that streams to a decode instance (every rank then sends its slice of each
  layer as soon as the layer ran);
- when a request's first token is out, its future resolves (the router answers
  the client: TTFT does not wait for the transfer) and the
  :class:`~pdserve.transfer.handoff.HandOff` goes to the decode instance;
- ``export``: a paired instance asks for cached pages of a prefix this
  instance holds on its device; they are sent between two steps, with no
  forward. A request naming a ``peer`` pulls its prefix from another prefill
  instance that way before it runs (:mod:`pdserve.transfer.peer_pull`).

Page ownership is tabled in :mod:`pdserve.transfer.handoff`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.errors import (
    InstanceFailedError,
    InvalidArgumentError,
    RequestAbortedError,
    RequestFailedError,
    TransferError,
)
from pdserve.core.layout import Layout
from pdserve.core.messages import FirstToken, PeerExport, PrefillRequest
from pdserve.core.request import RequestOutput
from pdserve.core.step import KVSend, StepPlan
from pdserve.engine.engine import EngineCore
from pdserve.engine.loop import EngineLoop, LoadReporter
from pdserve.engine.role import RolePolicy
from pdserve.transfer.handoff import HandOff
from pdserve.transfer.peer_pull import PeerPull
from pdserve.transfer.stats import LeaseStats

logger = logging.getLogger(__name__)


@dataclass
class _Transfer:
    """A request this instance prefills, and where its pages go."""

    request: PrefillRequest
    first_token: Future[FirstToken] = field(default_factory=Future)
    next_page: int = 0  # first page not yet sent for good


class PrefillServer:
    def __init__(
        self,
        instance_id: str,
        engine: EngineCore,
        layout: Layout,
        needs_arrival_marks: bool = False,
    ) -> None:
        self.instance_id = instance_id
        self.layout = layout
        self.block_size = engine.kv.block_size
        self.stats = LeaseStats()
        self.decodes: dict[str, Any] = {}  # decode instance id -> its leader's actor handle
        # Prefill instances of the region this one pulls prefixes from and serves them to.
        self.peers: dict[str, tuple[Any, Layout]] = {}
        self._transfers: dict[str, _Transfer] = {}
        # Recently dropped request ids: an export that arrives after its drop
        # must not write into pages the decode instance freed.
        self._dropped: OrderedDict[str, None] = OrderedDict()
        engine.use_role(RolePolicy(plan=self._annotate, on_transfer_failure=self._transfer_failed))
        self.loop = EngineLoop(
            engine, self._on_outputs, self._on_fatal, name=f"pdserve-prefill-{instance_id}"
        )
        self.reports = LoadReporter(self.loop, instance_id, "prefill")
        self.pulls = PeerPull(
            instance_id,
            layout,
            engine.model.num_kv_heads,
            needs_arrival_marks,
            self.loop.call,
        )

    # -- called from actor threads ---------------------------------------------------

    def register_decode(self, decode_id: str, leader: Any) -> None:
        self.loop.call(lambda _: self.decodes.__setitem__(decode_id, leader)).result()

    def forget_decode(self, decode_id: str) -> None:
        self.loop.call(lambda _: self.decodes.pop(decode_id, None)).result()

    def register_peer(self, prefill_id: str, leader: Any, layout: Layout) -> None:
        self.loop.call(lambda _: self.peers.__setitem__(prefill_id, (leader, layout))).result()

    def forget_peer(self, prefill_id: str) -> None:
        self.loop.call(lambda _: self.peers.pop(prefill_id, None)).result()

    def prefill(self, request: PrefillRequest) -> Future[FirstToken]:
        """Queue a prompt; the future resolves with its first token."""
        return self.loop.call(lambda engine: self._start(engine, request)).result()

    def export(self, request: PeerExport) -> int:
        """Send the decode instance the leading run of these blocks held here; how many."""
        return self.loop.call(lambda engine: self._export(engine, request)).result()

    def drop(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its pages; returns once no write is in flight.

        Runs between steps, so when it returns no page of the request is being
        written on the decode instance any more.
        """
        return self.loop.call(lambda engine: self._drop(engine, request_id)).result()

    # -- on the loop thread ---------------------------------------------------------------

    def _start(self, engine: EngineCore, request: PrefillRequest) -> Future[FirstToken]:
        if request.request_id in self._dropped:  # the drop overtook the call (another group)
            self.stats.aborted += 1
            raise RequestAbortedError(f"{request.request_id} was dropped before it started")
        res = request.reservation
        if res is not None:
            if res.decode_id not in self.decodes:
                raise InvalidArgumentError(
                    "reservation.decode_id",
                    f"prefill {self.instance_id} is not paired with decode {res.decode_id}",
                )
            need = -(-len(request.prompt_token_ids) // self.block_size)
            if res.local or len(res.block_ids) < need:
                raise InvalidArgumentError(
                    "reservation.block_ids",
                    f"{len(res.block_ids)} pages for a {len(request.prompt_token_ids)}-token prompt "
                    f"(needs {need}){'; the decode instance prefills this one itself' if res.local else ''}",
                )
        transfer = _Transfer(request)
        self._transfers[request.request_id] = transfer
        if not self._pull(engine, request):
            self._admit(engine, request)
        logger.info(
            "prefill %s: %d prompt tokens on %s, KV to %s",
            request.request_id,
            len(request.prompt_token_ids),
            self.instance_id,
            res.decode_id if res is not None else "-",
        )
        return transfer.first_token

    def _admit(self, engine: EngineCore, request: PrefillRequest) -> None:
        p = request.params
        first_only = dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        engine.add_request(
            request.request_id,
            request.prompt_token_ids,
            first_only,
            hold_kv=request.reservation is not None,
            output_offset=request.output_offset,
        )

    def _pull(self, engine: EngineCore, request: PrefillRequest) -> bool:
        """Take the prompt's prefix from the peer that holds it; False: nothing to take."""
        peer = self.peers.get(request.peer.prefill_id) if request.peer is not None else None
        if peer is None or request.peer is None:
            return False
        asked = self.pulls.start(
            engine,
            request.request_id,
            request.prompt_token_ids,
            request.params,
            peer,
            request.peer.num_blocks,
            lambda e, indexed: self._pulled(e, request, indexed),
        )
        return asked > 0

    def _pulled(self, engine: EngineCore, request: PrefillRequest, indexed: int | None) -> None:
        if indexed is None:  # dropped meanwhile: its transfer already ended
            engine.abort_request(request.request_id)
            return
        self.stats.peer_filled += 1 if indexed else 0
        self._admit(engine, request)

    def _annotate(self, plan: StepPlan) -> StepPlan:
        if self.pulls.arrivals:  # pages pulled from a peer: wait for their arrival marks
            plan = dataclasses.replace(plan, kv_arrivals=self.pulls.take_arrivals())
        sends = []
        bs = self.block_size
        for seq in plan.seqs:
            transfer = self._transfers.get(seq.request_id)
            if transfer is None or transfer.request.reservation is None:
                continue
            res = transfer.request.reservation
            if seq.start_pos == 0:
                transfer.next_page = 0  # a fresh start (or a recompute after preemption)
            first = max(transfer.next_page, res.num_cached_tokens // bs)
            pages = range(first, (seq.seq_len - 1) // bs + 1)
            final = seq.seq_len == len(transfer.request.prompt_token_ids)
            sends.append(
                KVSend(
                    seq.request_id,
                    res.decode_id,
                    [seq.block_table[i] for i in pages],
                    [res.block_ids[i] for i in pages],
                    final,
                )
            )
            # The page holding the last token may fill up later: resend it then.
            transfer.next_page = seq.seq_len // bs
        return dataclasses.replace(plan, kv_sends=sends) if sends else plan

    def _transfer_failed(self, plan: StepPlan) -> None:
        """Some pages of these requests never landed: never hand them off."""
        engine = self.loop.engine
        for send in plan.kv_sends:
            transfer = self._transfers.pop(send.request_id, None)
            engine.abort_request(send.request_id)
            engine.release(send.request_id)
            self.stats.aborted += 1
            if transfer is not None and not transfer.first_token.done():
                transfer.first_token.set_exception(  # the instance is fine: only this request moves
                    TransferError(f"KV transfer of {send.request_id} to {send.peer} failed")
                )
            decode = self.decodes.get(send.peer)
            if decode is not None:
                decode.abort.remote(send.request_id)  # its stream ends with an abort

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            transfer = self._transfers.get(out.request_id)
            if transfer is None or not out.finished:
                continue
            if out.outputs[0].finish_reason == "error":
                self._request_failed(transfer)
            else:
                self._first_token_done(transfer, out)

    def _request_failed(self, transfer: _Transfer) -> None:
        """Its step raised: the engine freed its pages; free the reservation, tell the router."""
        request = transfer.request
        self._transfers.pop(request.request_id, None)
        self.stats.aborted += 1
        res = request.reservation
        if res is not None and res.decode_id in self.decodes:
            self.decodes[res.decode_id].cancel.remote(request.request_id)
        transfer.first_token.set_exception(
            RequestFailedError(
                f"request failed while prefilling on {self.instance_id}; it was not retried"
            )
        )

    def _first_token_done(self, transfer: _Transfer, out: RequestOutput) -> None:
        request = transfer.request
        first = _first_token(request, out)
        token, ends, logprobs = first.token_id, first.finished, first.logprobs
        transfer.first_token.set_result(first)
        res = request.reservation
        if res is None:
            self._transfers.pop(request.request_id)
            return
        decode = self.decodes.get(res.decode_id)
        if decode is None:  # unpaired meanwhile (removed or lost): nobody to hand off to
            logger.warning(
                "prefill %s: decode %s is gone; its KV is not handed off",
                request.request_id,
                res.decode_id,
            )
            self.stats.peer_lost += 1
            self._finish_transfer(request.request_id)
            return
        if ends:  # nothing to decode: the reserved pages can go
            self._finish_transfer(request.request_id)
            decode.cancel.remote(request.request_id)
            return
        handoff = HandOff(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            token,
            request.output_offset + 1,
            res.block_ids,
            self.instance_id,
            self.layout,
            time.time(),
            logprobs,
        )
        decode.commit.remote(handoff).future().add_done_callback(
            lambda f, rid=request.request_id: self._acknowledged(rid, f)
        )

    def _on_fatal(self, error: BaseException) -> None:
        """The engine stopped (a rank died): nobody waits for a first token forever."""
        for transfer in self._transfers.values():
            if not transfer.first_token.done():
                transfer.first_token.set_exception(
                    InstanceFailedError(f"prefill {self.instance_id} stopped: {error}")
                )

    def _acknowledged(self, request_id: str, result: Future[Any]) -> None:
        """The decode instance answered the hand-off (on a Ray callback thread)."""
        try:
            accepted = bool(result.result())
        except Exception as e:  # the decode instance is gone
            logger.warning("hand-off of %s failed: %s", request_id, e)
            self.stats.peer_lost += 1
            accepted = False
        if accepted:
            self.stats.committed += 1
        else:
            self.stats.refused += 1
        self.loop.call(lambda _: self._finish_transfer(request_id))

    def _finish_transfer(self, request_id: str) -> None:
        self._transfers.pop(request_id, None)
        self.loop.engine.release(request_id)

    def _export(self, engine: EngineCore, request: PeerExport) -> int:
        paired = request.dest_id in self.decodes or request.dest_id in self.peers
        if not paired or request.request_id in self._dropped:
            return 0
        blocks = engine.kv.device_blocks(request.block_hashes[: len(request.block_ids)])
        if not blocks:
            return 0
        send = KVSend(
            request.transfer_id,
            request.dest_id,
            [b.block_id for b in blocks],
            request.block_ids[: len(blocks)],
            final=True,
        )
        ok = engine.export_pages([send])
        if ok:
            self.stats.exported += 1
        logger.info(
            "prefill %s: %s %d cached pages to %s",
            request.request_id,
            "exported" if ok else "failed to export",
            len(blocks),
            request.dest_id,
        )
        return len(blocks) if ok else 0

    def _drop(self, engine: EngineCore, request_id: str) -> bool:
        self._dropped[request_id] = None
        while len(self._dropped) > 4096:
            self._dropped.popitem(last=False)
        transfer = self._transfers.pop(request_id, None)
        pulling = self.pulls.cancel(request_id)  # its pages are freed once the peer answers
        aborted = not pulling and engine.abort_request(request_id) is not None
        released = engine.release(request_id)
        if transfer is not None and not transfer.first_token.done():
            transfer.first_token.set_exception(RequestAbortedError(f"{request_id} was dropped"))
        if aborted or released or pulling:
            self.stats.aborted += 1
        return aborted or released or pulling


def _first_token(request: PrefillRequest, out: RequestOutput) -> FirstToken:
    """The router's message for the prefill's sampled token (logged with its timings)."""
    completion = out.outputs[0]
    token = completion.token_ids[0]
    ends = completion.finish_reason == "stop" or request.params.max_tokens == 1
    reason = completion.finish_reason if completion.finish_reason == "stop" else "length"
    phases = {k: v for k, v in out.metrics.phases().items() if k.startswith("prefill")}
    logger.info(
        "prefill %s: first token %d after %.1f ms queued + %.1f ms prefill",
        request.request_id,
        token,
        phases.get("prefill_queue", 0.0) * 1e3,
        phases.get("prefill", 0.0) * 1e3,
    )
    logprobs = completion.logprobs[0] if completion.logprobs else None
    prompt = None if out.prompt_logprobs is None else [e for e in out.prompt_logprobs if e]
    return FirstToken(
        request.request_id,
        token,
        ends,
        reason if ends else None,
        phases,
        logprobs,
        prompt,
        out.metrics.num_cached_prompt_tokens,
    )
