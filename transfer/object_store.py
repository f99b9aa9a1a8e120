"""Ray object store connector (across nodes).

Each message (one layer's runs of pages for one decode rank) travels as one
Ray call to that rank's actor: the msgpack header, packed once, and two byte
arrays, every run's K part one after the other and then every run's V part
(Ray moves arrays through its object store without pickling the bytes). A
message of one run whose pages are consecutive sends views of the cache; others
are gathered first. The decode rank writes the pages into its cache inside
that call; ``flush`` waits for the calls, so once it returns the bytes are in
place.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import KVReceiver, KVSender, register
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.stats import TransferStats
from pdserve.transfer.wire import (
    PageRun,
    dtype_name,
    pack_message,
    torch_dtype,
    unpack_message,
)


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
        write_message(self, self.stats, header, keys, values)


def write_message(
    receiver: KVReceiver, stats: TransferStats, header: bytes, keys: np.ndarray, values: np.ndarray
) -> None:
    """One object-store message into ``receiver``'s cache, counted in ``stats``: that
    connector's own receiver, or another's (``auto`` between nodes: a decode rank with a
    shared-memory cache takes a remote prefill's pages this way).

    ``keys``/``values``: the runs' K (V) parts back to back, as bytes.
    """
    start = time.perf_counter()
    runs, _ = unpack_message(header)
    flat_keys, flat_values = keys.reshape(-1), values.reshape(-1)
    offset = 0
    for run in runs:
        half = run.nbytes // 2
        parts = (flat_keys[offset : offset + half], flat_values[offset : offset + half])
        offset += half
        dtype = torch_dtype(run.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
            k, v = (torch.from_numpy(a).view(dtype).view(run.shape[1:]) for a in parts)
        receiver.write(run, k, v)
    stats.add(2 * offset, time.perf_counter() - start)


class ObjectStoreSender(KVSender):
    def __init__(self) -> None:
        super().__init__()
        self._pending: list[tuple[Any, int]] = []

    def send(self, peer: tuple[str, int], runs: list[PageRun]) -> None:
        actor = self.endpoints[peer].address
        keys: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for _, source in runs:
            parts = source.contiguous_parts()
            if parts is None or parts[0].device.type != "cpu":
                payload = source.gather().cpu()
                parts = [payload[0], payload[1]]
            keys.append(parts[0].view(torch.uint8).reshape(-1).numpy())
            values.append(parts[1].view(torch.uint8).reshape(-1).numpy())
        k, v = (a[0] if len(a) == 1 else np.concatenate(a) for a in (keys, values))
        ref = actor.receive_pages.remote(pack_message([h for h, _ in runs]), k, v)
        self._pending.append((ref, sum(h.nbytes for h, _ in runs)))

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
