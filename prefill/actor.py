"""The prefill role's calls on an instance's leader rank, as Ray actor methods.

An instance is one Ray actor per rank (:class:`~pdserve.cluster.worker.InstanceWorker`);
its leader serves the calls of the role it has now. This surface is the prefill
role's: routers send prompts (``prefill``) and drop them, decode instances pair
with it, and prefill peers of its region pull prefixes from it (``export``).
Each call goes to the leader's :class:`~pdserve.prefill.server.PrefillServer`;
a call for a role the instance does not have fails naming it.
"""

from __future__ import annotations

from typing import Any

import ray

from pdserve.core.layout import Layout
from pdserve.core.messages import FirstToken, PeerExport, PrefillRequest
from pdserve.parallel.calls import CONTROL
from pdserve.prefill.server import PrefillServer


class PrefillSurface:
    server: Any  # the leader's server of the role the instance has now (None before it starts)

    def prefill_server(self) -> PrefillServer:
        assert isinstance(self.server, PrefillServer), "not the leader of a prefill instance"
        return self.server

    def register_decode(self, decode_id: str, leader: Any) -> None:
        """A decode instance this one sends prompts' KV pages to."""
        self.prefill_server().register_decode(decode_id, leader)

    def register_peer(self, prefill_id: str, leader: Any, layout: Layout) -> None:
        """A prefill instance of the region this one pulls prefixes from and serves them to."""
        self.prefill_server().register_peer(prefill_id, leader, layout)

    def prefill(self, request: PrefillRequest) -> FirstToken:
        """Run the prompt, streaming its KV pages to the decode instance; its first token."""
        return self.prefill_server().prefill(request).result()

    @ray.method(concurrency_group=CONTROL)
    def drop(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its pages, once no write of it is in
        flight; whether it was here."""
        return self.prefill_server().drop(request_id)

    @ray.method(concurrency_group=CONTROL)
    def export(self, request: PeerExport) -> int:
        """Send the asking instance the leading run of the blocks it names that this one
        holds; how many."""
        return self.prefill_server().export(request)
