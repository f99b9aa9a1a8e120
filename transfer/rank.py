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
"""

from __future__ import annotations

import logging

import torch

from pdserve.core.errors import TransferError
from pdserve.core.layout import Layout
from pdserve.core.step import KVSend, StepPlan
from pdserve.transfer import connector_classes
from pdserve.transfer.connector import KVReceiver, KVSender, PeerEndpoint
from pdserve.transfer.routes import Route, plan_routes
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
    ) -> None:
        sender_cls, receiver_cls = connector_classes(connector)
        self.instance_id = instance_id
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
            if self.sender.endpoints.get((instance_id, dst)) != by_rank[dst]:
                self.sender.connect(by_rank[dst])
        self.routes[instance_id] = mine

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
        self.sender.disconnect(instance_id)

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
                self.sender.send(peer, runs)
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
                        self.sender.finish((send.peer, route.dst_rank), send.request_id)
            self.sender.flush()  # what was sent lands before its pages change
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

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
