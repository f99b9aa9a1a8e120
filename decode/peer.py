"""Decode instances pre-filled from a peer's cache.

The router names, in a :class:`~pdserve.core.messages.ReserveRequest`, a prefill
instance that holds a longer prefix of the prompt on its device than the one
it chose for load (:class:`~pdserve.core.messages.PeerPrefix`). When that
prefix covers the share of the prompt that makes a decode instance prefill a
prompt itself (``local_prefill_cached_fraction``), the decode instance pulls it
(:mod:`pdserve.transfer.peer_pull`) and prefills only the rest here; the
router then starts no prefill. An abort meanwhile cancels the pull: the
request ends once the peer answered.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.core.messages import Reservation, ReserveRequest
from pdserve.engine.engine import EngineCore

if TYPE_CHECKING:
    from pdserve.core.config import DisaggregationConfig
    from pdserve.core.layout import Layout
    from pdserve.core.request import RequestOutput
    from pdserve.transfer.peer_pull import PeerPull
    from pdserve.transfer.stats import LeaseStats


class PeerFillHost(Protocol):
    """What a peer fill reads and calls of its decode server: its name and rule for
    prefilling here, the paired prefill instances, its pulls and counters, and how
    a request's outputs reach their subscriber."""

    @property
    def instance_id(self) -> str: ...
    @property
    def config(self) -> DisaggregationConfig: ...
    @property
    def prefills(self) -> dict[str, tuple[Any, Layout]]: ...
    @property
    def pulls(self) -> PeerPull: ...
    @property
    def stats(self) -> LeaseStats: ...
    def subscribe(self, request_id: str, sink: Any) -> None: ...
    def on_outputs(self, outputs: list[RequestOutput]) -> None: ...


logger = logging.getLogger(__name__)


def start_peer_fill(
    server: PeerFillHost, engine: EngineCore, request: ReserveRequest, sink: Any
) -> Reservation | None:
    """Reserve the prompt's pages and ask the peer for its prefix; None: not worth it."""
    peer = request.peer
    if peer is None or peer.prefill_id not in server.prefills:
        return None
    prompt, bs = request.prompt_token_ids, engine.kv.block_size
    blocks = min(peer.num_blocks, (len(prompt) - 1) // bs)
    if blocks * bs < server.config.local_prefill_cached_fraction * len(prompt):
        return None
    cached = engine.cached_prefix_tokens(prompt, request.params)
    asked = server.pulls.start(
        engine,
        request.request_id,
        prompt,
        request.params,
        server.prefills[peer.prefill_id],
        blocks,
        lambda e, indexed: _landed(server, e, request, indexed),
    )
    if not asked:
        return None
    server.subscribe(request.request_id, sink)
    logger.info(
        "decode %s: %d prefix pages from %s's cache, the rest prefilled on %s",
        request.request_id,
        asked,
        peer.prefill_id,
        server.instance_id,
    )
    return Reservation(request.request_id, server.instance_id, [], cached, request.ttl_s, True)


def _landed(
    server: PeerFillHost, engine: EngineCore, request: ReserveRequest, indexed: int | None
) -> None:
    """The peer answered: prefill the rest here, or end a request aborted meanwhile."""
    if indexed is None:
        out = engine.abort_request(request.request_id)
        if out is not None:
            server.stats.aborted += 1
            server.on_outputs([out])
        return
    engine.add_request(
        request.request_id,
        request.prompt_token_ids,
        request.params,
        output_offset=request.output_offset,
    )
    server.stats.peer_filled += 1 if indexed else 0
