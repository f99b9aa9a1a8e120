"""Ray object store connector (across nodes).

Each layer's pages travel as one Ray call to the decode rank's actor: the msgpack
header and the raw payload (a byte array, which Ray moves through its object
store without pickling the bytes). The decode rank writes the pages into its
cache inside that call; ``flush`` waits for the calls, so once it returns the
bytes are in place.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import KVReceiver, KVSender, PeerEndpoint, register
from pdserve.transfer.wire import PageHeader, PageSource, dtype_name, torch_dtype


class ObjectStoreReceiver(KVReceiver):
    def endpoint(self, actor: Any) -> PeerEndpoint:
        assert self.kv_cache is not None
        return PeerEndpoint(
            "object_store",
            self.instance_id,
            self.rank,
            tuple(self.kv_cache.shape),
            dtype_name(self.kv_cache.dtype),
            actor,
        )

    def receive(self, header: bytes, keys: np.ndarray, values: np.ndarray) -> None:
        """Called by the rank's actor for each message (``receive_pages``)."""
        head = PageHeader.unpack(header)
        dtype = torch_dtype(head.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
            k, v = (torch.from_numpy(a).view(dtype).view(head.shape[1:]) for a in (keys, values))
        self.write(head, k, v)


class ObjectStoreSender(KVSender):
    def __init__(self) -> None:
        super().__init__()
        self._pending: list[tuple[Any, int]] = []

    def send(self, peer: tuple[str, int], header: PageHeader, source: PageSource) -> None:
        actor = self.endpoints[peer].address
        parts = source.contiguous_parts()
        if parts is None or parts[0].device.type != "cpu":
            payload = source.gather().cpu()
            parts = [payload[0], payload[1]]
        keys, values = (p.view(torch.uint8).numpy() for p in parts)
        ref = actor.receive_pages.remote(header.pack(), keys, values)
        self._pending.append((ref, header.nbytes))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        with self.stats.timed(sum(n for _, n in pending)):
            try:
                ray.get([ref for ref, _ in pending])
            except (RayActorError, RayTaskError) as e:
                raise TransferError(f"object-store transfer failed: {e}") from e
        # One timed() call counted one message; count the rest.
        self.stats.messages += len(pending) - 1


register("object_store", ObjectStoreSender, ObjectStoreReceiver)
