"""Taking a prompt's prefix pages from a peer instance's cache (Mooncake-style reuse).

Either role may pull: a decode instance that then prefills the rest itself
(:mod:`pdserve.decode.peer`), or a prefill instance chosen for load that
lacks a prefix another prefill instance holds (:mod:`pdserve.prefill.server`).
The peer is a prefill instance paired with this one; it sends the leading run
of the asked blocks it still holds on its device, between two of its steps,
over the KV connector (re-sharded like any transfer)::

    start      reserve pages for the prompt here; ask the peer to export
    (peer)     copies its cached pages into them; answers how many it sent
    landed     index those pages as cached prefix blocks (the next step waits
               for the connector's arrival marks first), release the
               reservation, and go on: the request is then added as usual and
               the scheduler finds the prefix as ordinary hits

Pages: until the peer answers, the reservation holds them, so nothing else
is written there; a request cancelled meanwhile is freed only once the peer
answered (no write can land in a page after it is freed), and a peer that
hangs is killed by the health checks, which ends the call. A peer that sends
fewer pages, none, or is gone costs a recompute, never a wrong token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pdserve.core.layout import Layout
from pdserve.core.messages import PeerExport
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import KVArrival
from pdserve.engine.block_hash import block_hashes, first_parent
from pdserve.engine.engine import EngineCore
from pdserve.transfer.routes import plan_routes, routes_into

logger = logging.getLogger(__name__)

# Called on the loop thread once the peer answered: (engine, pages indexed here),
# the reservation released; or (engine, None) for a cancelled pull, whose
# reservation the caller then ends (``engine.abort_request``).
Then = Callable[[EngineCore, int | None], None]


@dataclass
class _Pull:
    export: PeerExport
    first: int  # index of the first page the peer fills
    peer_layout: Layout
    then: Then
    cancelled: bool = False


class PeerPull:
    """The pulls of one instance, on its engine loop."""

    def __init__(
        self,
        instance_id: str,
        layout: Layout,
        num_kv_heads: int,
        needs_arrival_marks: bool,
        call: Callable[[Callable[[EngineCore], None]], Any],
    ) -> None:
        self.instance_id = instance_id
        self.layout = layout
        self.num_kv_heads = num_kv_heads
        self.needs_arrival_marks = needs_arrival_marks
        self.call = call  # runs a function on the engine loop
        self.arrivals: list[KVArrival] = []  # marks the next step must wait for
        self.pending: dict[str, _Pull] = {}

    def take_arrivals(self) -> list[KVArrival]:
        """The marks the next step waits for (the server's plan hook adds them)."""
        arrivals, self.arrivals = self.arrivals, []
        return arrivals

    def start(
        self,
        engine: EngineCore,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        peer: tuple[Any, Layout],
        blocks: int,
        then: Then,
    ) -> int:
        """Reserve the prompt's pages and ask the peer for ``blocks`` leading blocks.

        Returns the number of pages asked for (0: nothing to pull, no room, or
        already cached here; nothing was started and ``then`` is not called).
        """
        bs = engine.kv.block_size
        blocks = min(blocks, (len(prompt) - 1) // bs)  # the last token is always computed
        if blocks * bs <= engine.cached_prefix_tokens(prompt, params):
            return 0
        held = engine.reserve(request_id, prompt, params)
        if held is None:
            return 0
        block_ids, cached = held
        first = cached // bs
        # Named as the engine names them: chained from the adapter's and tenant's salt.
        parent = first_parent(engine.adapters.salt(params.lora), params.cache_salt)
        hashes = block_hashes(prompt, bs, parent=parent)[first:blocks]
        export = PeerExport(request_id, self.instance_id, hashes, block_ids[first:blocks])
        self.pending[request_id] = _Pull(export, first, peer[1], then)
        peer[0].export.remote(export).future().add_done_callback(
            lambda f: self.call(lambda e: self._landed(e, request_id, f))
        )
        return len(hashes)

    def cancel(self, request_id: str) -> bool:
        """Cancel a pull in flight (its ``then`` gets None once the peer answered); False if none."""
        pull = self.pending.get(request_id)
        if pull is None:
            return False
        pull.cancelled = True
        return True

    def _landed(self, engine: EngineCore, request_id: str, result: Future[Any]) -> None:
        pull = self.pending.pop(request_id)
        try:
            sent = int(result.result())
        except Exception as e:  # the peer is gone: compute the whole prompt
            logger.warning("peer export of %s failed: %s", request_id, e)
            sent = 0
        if pull.cancelled:
            pull.then(engine, None)
            return
        if sent and self.needs_arrival_marks:
            self._await_marks(pull)
        reserved = engine.scheduler.requests[request_id]
        indexed = engine.kv.cache_landed(reserved, pull.first, pull.export.block_hashes[:sent])
        engine.abort_request(request_id)  # indexed pages stay cached, the others are freed
        logger.info(
            "%s: %d of %d peer pages landed on %s; computing from token %d",
            request_id,
            indexed,
            len(pull.export.block_hashes),
            self.instance_id,
            (pull.first + indexed) * engine.kv.block_size,
        )
        pull.then(engine, indexed)

    def _await_marks(self, pull: _Pull) -> None:
        """The next step waits until every route of the peer ended its transfer."""
        routes = plan_routes(self.num_kv_heads, pull.peer_layout, self.layout)
        expected = [routes_into(routes, r) for r in range(self.layout.world_size)]
        self.arrivals.append(KVArrival(pull.export.transfer_id, expected))
