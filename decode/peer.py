"""Decode instances pre-filled from a peer's cache (Mooncake-style prefix reuse).

The router names, in a :class:`~pdserve.core.messages.ReserveRequest`, a prefill
instance that holds a longer prefix of the prompt on its device than the one
it chose for load (:class:`~pdserve.core.messages.PeerPrefix`). When that
prefix (with what is cached here) covers the share of the prompt that makes a
decode instance prefill a prompt itself (``local_prefill_cached_fraction``),
the decode instance takes it:

    reserve    pages for the prompt, under a lease naming the peer
    export     the peer sends its cached pages into them, between two of its
               steps, over the KV connector (re-sharded like any transfer)
    landed     the pages that arrived are indexed here as cached prefix blocks,
               the reservation is released, and the request is prefilled here:
               the scheduler finds the prefix as ordinary hits and computes
               only the rest

If the peer sends fewer pages, none, or is gone, the request is prefilled here
from wherever the landed prefix ends: slower, never wrong. Page ownership
follows the lease rules of :mod:`pdserve.transfer.handoff`: an abort or an
expiry before the pages landed asks the peer to drop the request first.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pdserve.core.messages import PeerExport, Reservation, ReserveRequest
from pdserve.core.step import KVArrival
from pdserve.engine.block_hash import block_hashes
from pdserve.engine.engine import EngineCore
from pdserve.transfer.routes import plan_routes, routes_into

if TYPE_CHECKING:
    from pdserve.decode.server import DecodeServer

logger = logging.getLogger(__name__)


class PeerFill:
    """The decode server's requests whose prefix pages come from a peer prefill instance."""

    def __init__(self, server: DecodeServer) -> None:
        self.server = server
        # request id -> the request, its first page the peer fills, what was asked
        self.pending: dict[str, tuple[ReserveRequest, int, PeerExport]] = {}

    def start(self, engine: EngineCore, request: ReserveRequest, sink: Any) -> Reservation | None:
        """Reserve the prompt's pages and ask the peer for its prefix; None: not worth it."""
        server, peer = self.server, request.peer
        if peer is None or peer.prefill_id not in server.prefills:
            return None
        prompt, bs = request.prompt_token_ids, engine.kv.block_size
        reusable = (len(prompt) - 1) // bs  # the last token is always computed
        blocks = min(peer.num_blocks, reusable)
        own = engine.cached_prefix_tokens(prompt) // bs
        fraction = server.config.local_prefill_cached_fraction
        if blocks <= own or blocks * bs < fraction * len(prompt):
            return None
        held = engine.reserve(request.request_id, prompt, request.params, request.output_offset)
        if held is None:
            return None  # full: the ordinary path refuses with a retry hint
        block_ids, cached = held
        first = cached // bs
        hashes = block_hashes(prompt, bs)[first:blocks]
        server.leases.add(request.request_id, peer.prefill_id, request.ttl_s)
        server.stats.reserved += 1
        server._subscribe(request.request_id, sink)
        export = PeerExport(request.request_id, server.instance_id, hashes, block_ids[first:blocks])
        self.pending[request.request_id] = (request, first, export)
        leader, _ = server.prefills[peer.prefill_id]
        ref = leader.export.remote(export)
        ref.future().add_done_callback(
            lambda f, rid=request.request_id: server.loop.call(lambda e: self.landed(e, rid, f))
        )
        logger.info(
            "decode %s: %d prefix pages from %s's cache (%d cached here), the rest prefilled on %s",
            request.request_id,
            len(hashes),
            peer.prefill_id,
            first,
            server.instance_id,
        )
        return Reservation(request.request_id, server.instance_id, [], cached, request.ttl_s, True)

    def landed(self, engine: EngineCore, request_id: str, result: Future[Any]) -> None:
        """The peer answered: index what arrived, then prefill the rest here."""
        entry = self.pending.pop(request_id, None)
        server = self.server
        if entry is None or server.leases.take(request_id) is None:
            return  # aborted or expired meanwhile: its lease path freed the pages
        request, first, export = entry
        try:
            sent = int(result.result())
        except Exception as e:  # the peer is gone: compute the whole prompt here
            logger.warning("peer export of %s failed: %s", request_id, e)
            sent = 0
        if sent and server.needs_arrival_marks and not self._await_marks(export, request):
            sent = 0  # the peer was unpaired meanwhile: its pages' arrival cannot be checked
        reserved = engine.scheduler.requests[request_id]
        indexed = engine.kv.cache_landed(reserved, first, export.block_hashes[:sent])
        engine.abort_request(request_id)  # indexed pages stay cached, the others are freed
        engine.add_request(
            request_id,
            request.prompt_token_ids,
            request.params,
            output_offset=request.output_offset,
        )
        server.stats.peer_filled += 1 if indexed else 0
        logger.info(
            "decode %s: %d of %d peer pages landed; prefilling from token %d",
            request_id,
            indexed,
            len(export.block_hashes),
            (first + indexed) * engine.kv.block_size,
        )

    def _await_marks(self, export: PeerExport, request: ReserveRequest) -> bool:
        """Make the next step wait until every route of the peer ended its transfer."""
        assert request.peer is not None
        server = self.server
        peer = server.prefills.get(request.peer.prefill_id)
        if peer is None:
            return False
        routes = plan_routes(server.num_kv_heads, peer[1], server.layout)
        expected = [routes_into(routes, r) for r in range(server.layout.world_size)]
        server._arrivals.append(KVArrival(export.transfer_id, expected))
        return True
