"""A rank's part in KV transfers, hooked into its forward pass.

:class:`RankTransfer` implements the step hooks of
:class:`~pdserve.parallel.pipeline.StageExecutor`:

- ``on_layer`` (prefill side): right after a layer ran, send this rank's slice
  of that layer's pages for every request of the micro-batch that streams to a
  decode instance, over the routes computed when the instances paired: one
  message per decode rank, listing one run per request;
- ``export`` (prefill side): send cached pages a peer asked for, every local
  layer at once, with no forward;
- ``after_step`` (prefill side): end the routes of requests whose prompt is
  complete, then wait until everything sent this step has landed;
- ``before_step`` (decode side): wait until each request that joins the batch
  has all its pages (only connectors that need arrival marks make this wait).

An afd expert rank (``parallel/afd.py``) holds no KV cache: no route starts or
ends there (``routes.py``) and its executor runs none of these hooks.

With ``across_nodes`` (the ``auto`` connector), a decode rank on another Ray node
than this rank's is sent to over that connector instead (the object store: a
same-node connector such as shm cannot reach it), and any rank takes that
connector's messages into its cache whatever its own connector is.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from pdserve.core.errors import TransferError
from pdserve.core.layout import Layout
from pdserve.core.step import KVSend, StepPlan
from pdserve.transfer import connector_classes
from pdserve.transfer.connector import KVReceiver, KVSender
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.routes import Route, plan_routes
from pdserve.transfer.stats import TransferStats
from pdserve.transfer.wire import PageHeader, PageRun, PageSource, dtype_name

logger = logging.getLogger(__name__)


class RankTransfer:
    """Sender and/or receiver of one rank, and its routes to each paired decode instance."""

    def __init__(
        self,
        instance_id: str,
        rank: int,
        layout: Layout,
        num_kv_heads: int,
        connector: str,
        arrival_timeout_s: float = 60.0,
        across_nodes: str | None = None,
        node_id: str = "",
    ) -> None:
        sender_cls, receiver_cls = connector_classes(connector)
        self.instance_id = instance_id
        self.node_id = node_id  # the Ray node this rank runs on
        self.across_nodes = across_nodes
        self.remote: KVSender | None = None  # the across-nodes sender, once a peer needs it
        self.remote_received: TransferStats | None = None  # its messages into this rank
        self.rank = rank
        self.layout = layout
        self.num_kv_heads = num_kv_heads
        self.first_layer = layout.stage_layers[layout.coords(rank).stage][0]
        self.sender: KVSender = sender_cls()
        self.receiver: KVReceiver = receiver_cls(instance_id, rank)
        self.routes: dict[str, list[Route]] = {}  # decode instance id -> routes from this rank
        self.kv_cache: torch.Tensor | None = None
        self.arrival_timeout_s = arrival_timeout_s
        # (step id, requests whose pages landed in it): a re-run of that step skips them.
        self._landed: tuple[int, set[str]] = (-1, set())
        self._send_error: Exception | None = None  # a send of this step (id above) failed

    # -- pairing ---------------------------------------------------------------

    def pair(self, decode_layout: Layout, endpoints: list[PeerEndpoint]) -> None:
        """Connect to the decode ranks this rank sends to; the routes replace any before.

        Called once per pairing, and again when the decode instance regrouped
        (elastic EP: fewer ranks, renumbered); a rank whose endpoint is
        unchanged keeps its connection.
        """
        instance_id = endpoints[0].instance_id
        mine = [
            r
            for r in plan_routes(self.num_kv_heads, self.layout, decode_layout)
            if r.src_rank == self.rank
        ]
        by_rank = {e.rank: e for e in endpoints}
        for dst in sorted({r.dst_rank for r in mine}):
            sender, endpoint = self._way_to(by_rank[dst])
            if sender.endpoints.get((instance_id, dst)) != endpoint:
                for other in self.senders():  # a rank that moved between nodes
                    other.endpoints.pop((instance_id, dst), None)
                sender.connect(endpoint)
        self.routes[instance_id] = mine

    def _way_to(self, endpoint: PeerEndpoint) -> tuple[KVSender, PeerEndpoint]:
        """The sender that reaches the rank of ``endpoint``, and the endpoint it connects to."""
        remote = endpoint.node_id and self.node_id and endpoint.node_id != self.node_id
        if not (remote and self.across_nodes and endpoint.connector != self.across_nodes):
            return self.sender, endpoint
        if endpoint.actor is None:
            raise TransferError(
                f"decode rank {endpoint.instance_id}/{endpoint.rank} is on another node and "
                f"publishes no actor for the {self.across_nodes} connector"
            )
        if self.remote is None:
            self.remote = connector_classes(self.across_nodes)[0]()
        moved = dataclasses.replace(endpoint, connector=self.across_nodes, address=endpoint.actor)
        return self.remote, moved

    def senders(self) -> list[KVSender]:
        return [self.sender] if self.remote is None else [self.sender, self.remote]

    def _sender_of(self, peer: tuple[str, int]) -> KVSender:
        if self.remote is not None and peer in self.remote.endpoints:
            return self.remote
        return self.sender

    def endpoint(self, actor: Any, node_id: str) -> PeerEndpoint:
        """This rank's endpoint for senders: its connector's, with its node and actor."""
        return dataclasses.replace(self.receiver.endpoint(actor), node_id=node_id, actor=actor)

    def receive_message(self, header: bytes, keys: np.ndarray, values: np.ndarray) -> None:
        """An object-store message: this rank's connector, or ``auto``'s across nodes."""
        from pdserve.transfer.object_store import ObjectStoreReceiver, write_message

        if isinstance(self.receiver, ObjectStoreReceiver):
            self.receiver.receive(header, keys, values)
            return
        if self.across_nodes is None:
            raise TransferError(
                f"rank {self.rank} takes pages over {self.receiver.name}, not the object store"
            )
        if self.remote_received is None:
            self.remote_received = TransferStats(self.across_nodes)
        write_message(self.receiver, self.remote_received, header, keys, values)

    def renumber(self, rank: int, layout: Layout) -> None:
        """This rank's number and instance layout after its instance regrouped (elastic EP).

        Only layouts whose ranks each hold every layer and head regroup, so
        the cache, its layers and its heads stay as they are; the receiver
        publishes the new number in its endpoint.
        """
        self.rank = self.receiver.rank = rank
        self.layout = layout

    def unpair(self, instance_id: str) -> None:
        self.routes.pop(instance_id, None)
        for sender in self.senders():
            sender.disconnect(instance_id)

    # -- prefill side hooks -------------------------------------------------------

    def on_layer(self, local_layer: int, micro: StepPlan) -> None:
        if not micro.kv_sends:
            return
        in_batch = {s.request_id for s in micro.seqs}
        self._send_layer(local_layer, [s for s in micro.kv_sends if s.request_id in in_batch])

    def export(self, plan: StepPlan) -> None:
        """Send every local layer of already-cached pages (a peer's prefix; no forward)."""
        assert self.kv_cache is not None
        for local_layer in range(self.kv_cache.shape[0]):
            self._send_layer(local_layer, plan.kv_sends)

    def _send_layer(self, local_layer: int, sends: list[KVSend]) -> None:
        """One message per decode rank: every request's run of this layer to that rank."""
        assert self.kv_cache is not None
        layer = self.first_layer + local_layer
        cache = self.kv_cache[local_layer]  # [2, blocks, bs, H_local, D]
        dtype = dtype_name(cache.dtype)
        messages: dict[tuple[str, int], list[PageRun]] = {}
        for send in sends:
            if not send.src_blocks:
                continue
            for route in self.routes.get(send.peer, ()):
                if not route.layers[0] <= layer < route.layers[1]:
                    continue
                sh0, sh1 = route.src_heads()
                dh0, dh1 = route.dst_heads()
                header = PageHeader(
                    send.request_id,
                    layer - route.dst_first_layer,
                    send.dst_blocks,
                    dtype,
                    [2, len(send.src_blocks), cache.shape[2], sh1 - sh0, cache.shape[4]],
                    dh0,
                    dh1,
                )
                run = (header, PageSource(cache, send.src_blocks, sh0, sh1))
                messages.setdefault((send.peer, route.dst_rank), []).append(run)
        for peer, runs in messages.items():
            try:
                self._sender_of(peer).send(peer, runs)
            except (TransferError, RuntimeError) as e:  # e.g. that decode rank died
                self._send_error = self._send_error or e  # the step runs on; after_step fails

    def after_step(self, plan: StepPlan) -> bool:
        if not plan.kv_sends:
            return True
        error, self._send_error = self._send_error, None
        try:
            for send in plan.kv_sends if error is None else ():
                if send.final:
                    for route in self.routes.get(send.peer, ()):
                        peer = (send.peer, route.dst_rank)
                        self._sender_of(peer).finish(peer, send.request_id)
            for sender in self.senders():
                sender.flush()  # what was sent lands before its pages change
            if error is not None:
                raise error
        except (TransferError, RuntimeError) as e:
            logger.warning("rank %d: KV transfer of step %d failed: %s", self.rank, plan.step_id, e)
            return False
        return True

    # -- decode side hook -----------------------------------------------------------

    def before_step(self, plan: StepPlan) -> None:
        """Wait for the pages of requests joining the batch; a step run again on the
        survivors of an elastic instance waits only for those not seen landing yet."""
        if plan.step_id != self._landed[0]:  # a new step (not one run again)
            self._landed = (plan.step_id, set())
            self._send_error = None
        for request_id in plan.finished_request_ids:  # ended before its pages were awaited
            self.receiver.forget(request_id)
        for arrival in plan.kv_arrivals:
            if arrival.request_id in self._landed[1]:
                continue
            expected = arrival.expected[self.rank]
            if not self.receiver.wait_landed(arrival.request_id, expected, self.arrival_timeout_s):
                raise TransferError(
                    f"rank {self.rank}: pages of {arrival.request_id} did not arrive "
                    f"within {self.arrival_timeout_s:.0f} s"
                )
            self.receiver.forget(arrival.request_id)
            self._landed[1].add(arrival.request_id)

    def stats(self) -> list[tuple[str, TransferStats]]:
        """(direction, counters) of each connector this rank used: its own, both ways,
        then the across-nodes one's where a peer needed it."""
        out = [("sent", self.sender.stats), ("received", self.receiver.stats)]
        if self.remote is not None:
            out.append(("sent", self.remote.stats))
        if self.remote_received is not None:
            out.append(("received", self.remote_received))
        return out

    def close(self) -> None:
        for sender in self.senders():
            sender.close()
        self.receiver.close()
