"""The decode role's calls on an instance's leader rank, as Ray actor methods.

An instance is one Ray actor per rank (:class:`~pdserve.cluster.worker.InstanceWorker`);
its leader serves the calls of the role it has now. This surface is the decode
role's: routers reserve pages for a request, commit its hand-off from a prefill
instance (or submit a whole request), cancel and abort, and wait for requests
to end; prefill instances pair with it. Each call goes to the leader's
:class:`~pdserve.decode.server.DecodeServer`; a call for a role the instance
does not have fails naming it.
"""

from __future__ import annotations

from typing import Any

from pdserve.core.layout import Layout
from pdserve.core.messages import DecodeRequest, Reservation, ReserveRequest
from pdserve.core.request import RequestOutput
from pdserve.decode.server import DecodeServer
from pdserve.transfer.handoff import HandOff


class DecodeSurface:
    server: Any  # the leader's server of the role the instance has now (None before it starts)

    def decode_server(self) -> DecodeServer:
        assert isinstance(self.server, DecodeServer), "not the leader of a decode instance"
        return self.server

    def register_prefill(self, prefill_id: str, leader: Any, layout: Layout) -> None:
        """A prefill instance that sends this one prompts' KV pages."""
        self.decode_server().register_prefill(prefill_id, leader, layout)

    def reserve(self, request: ReserveRequest, prefill_id: str | None, sink: Any) -> Reservation:
        """Hold pages for a prompt's KV (OverloadedError when there is no room now);
        ``sink`` gets the request's tokens."""
        return self.decode_server().reserve(request, prefill_id, sink)

    def commit(self, handoff: HandOff) -> bool:
        """Take over a prefilled request; False if its lease is gone (expired or aborted)."""
        return self.decode_server().commit(handoff)

    def cancel(self, request_id: str) -> None:
        """The prefill will not hand this request off (its first token ended it)."""
        self.decode_server().cancel(request_id)

    def submit(self, request: DecodeRequest, sink: Any) -> None:
        """Prefill and decode a whole request here."""
        self.decode_server().submit(request, sink)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; whether it was here."""
        return self.decode_server().abort(request_id)

    def wait(self, request_ids: list[str], timeout_s: float | None = None) -> list[RequestOutput]:
        """Finished outputs of requests submitted without a subscriber."""
        return self.decode_server().wait(request_ids, timeout_s)
