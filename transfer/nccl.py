"""``nccl`` connector: pages device to device over a ``torch.distributed`` pair group.

Every (prefill rank, decode rank) pair gets a two-process group of its own, made as
the ``p2p`` connector makes its pairs (the decode rank listens on a TCP store; a
sender names a fresh pair id, asks the decode rank's actor to accept it, and both
build the group under that prefix). The group is NCCL when the decode rank's KV
cache is on a GPU, so pages go from one GPU's cache to another's with no stop in
host memory, and gloo when the cache is in host memory, which is how ``make test``
runs this same code on a machine without GPUs.

NCCL matches a receive to a send by their order alone (it has no tags) and by size,
so a message is sends in a fixed order, each received into a buffer of exactly its
size, every one of them on the cache's device::

    frame   8 bytes: header length (0 closes the pair), number of runs
    header  the msgpack header of :mod:`~pdserve.transfer.wire` (runs, marks)
    parts   each run's K part, then its V part: [pages, bs, heads, D] each

A run whose destination pages are consecutive with all their heads is received
straight into the cache; any other lands in a buffer of the run's shape and is
written into its pages. A receiver thread per pair does this in order, counts
the end-of-transfer marks (``needs_arrival_marks``), and ends at the close frame
or when the pair fails. The sender keeps every tensor of a step's sends until
``flush`` has waited for them; a peer that is gone or stuck fails the flush with
a :class:`~pdserve.core.errors.TransferError` within the group's timeout, and the
request is recomputed or moved as the router's failure policy says.

The NCCL path has run on no GPU yet; the gloo path is tested
(``tests/transfer/test_nccl.py``, and a disaggregated pair in
``tests/e2e/test_disaggregated.py``).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import KVReceiver, KVSender, PeerEndpoint, register
from pdserve.transfer.wire import (
    PageHeader,
    PageRun,
    PageSource,
    dtype_name,
    pack_message,
    torch_dtype,
    unpack_message,
)

logger = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=60)  # the pair group's: how long a send or receive may wait
_FRAME = struct.Struct("<II")  # header length (0: close), number of runs


def _node_ip() -> str:
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a view (a receive into a copy would be lost)."""
    assert t.is_contiguous(), "a send or receive buffer must be contiguous"
    return t.view(torch.uint8).reshape(-1)


def backend_for(device: torch.device) -> str:
    """The pair group's backend for a KV cache on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def pair_group(store: Any, rank: int, backend: str) -> Any:
    """One side (rank 0: the decode rank, 1: the prefill rank) of a two-rank group."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


def _frame(length: int, runs: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(_FRAME.pack(length, runs)), dtype=torch.uint8, device=device)


class NcclReceiver(KVReceiver):
    needs_arrival_marks = True

    def __init__(self, instance_id: str, rank: int) -> None:
        super().__init__(instance_id, rank)
        self._store = dist.TCPStore(
            _node_ip(), 0, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False
        )
        self._threads: list[threading.Thread] = []

    def endpoint(self, actor: Any) -> PeerEndpoint:
        assert self.kv_cache is not None
        return PeerEndpoint(
            "nccl",
            self.instance_id,
            self.rank,
            tuple(self.kv_cache.shape),
            dtype_name(self.kv_cache.dtype),
            (self._store.host, self._store.port, actor, backend_for(self.kv_cache.device)),
        )

    def accept(self, pair_id: str) -> None:
        """Join a sender's pair group (rank 0 of 2) and receive on it in a thread."""
        assert self.kv_cache is not None
        device = self.kv_cache.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = pair_group(dist.PrefixStore(pair_id, self._store), 0, backend_for(device))
        thread = threading.Thread(
            target=self._serve,
            args=(group, pair_id, device),
            daemon=True,
            name=f"pdserve-nccl-{pair_id[5:11]}",
        )
        thread.start()
        self._threads.append(thread)

    def _serve(self, group: Any, pair_id: str, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        frame = torch.empty(_FRAME.size, dtype=torch.uint8, device=device)
        try:
            while True:
                group.recv([frame], 1, 0).wait()
                length, _ = _FRAME.unpack(frame.cpu().numpy().tobytes())
                if length == 0:
                    return
                head = torch.empty(length, dtype=torch.uint8, device=device)
                group.recv([head], 1, 0).wait()
                headers, marks = unpack_message(head.cpu().numpy().tobytes())
                start = time.perf_counter()
                for header in headers:
                    self._receive_run(group, header, device)
                if headers:
                    nbytes = sum(h.nbytes for h in headers)
                    self.stats.add(nbytes, time.perf_counter() - start)
                for request_id in marks:
                    self.record_mark(request_id)
        except Exception as e:  # the sender died, timed out or closed the pair
            logger.info("nccl pair %s ended: %s", pair_id, e)

    def _receive_run(self, group: Any, header: PageHeader, device: torch.device) -> None:
        """One run's K and V parts, in order: into the cache, or through a buffer."""
        assert self.kv_cache is not None
        dst = self.kv_cache[header.layer]  # [2, blocks, bs, H_local, D]
        direct = PageSource(
            dst, header.block_ids, header.head_start, header.head_end
        ).contiguous_parts()
        if direct is not None:
            for part in direct:
                group.recv([_bytes(part)], 1, 0).wait()
            return
        run = torch.empty(header.shape, dtype=torch_dtype(header.dtype), device=device)
        for part in (run[0], run[1]):
            group.recv([_bytes(part)], 1, 0).wait()
        self.write(header, run[0], run[1])


class NcclSender(KVSender):
    def __init__(self) -> None:
        super().__init__()
        self._groups: dict[tuple[str, int], tuple[Any, torch.device]] = {}
        self._marks: dict[tuple[str, int], list[str]] = {}
        # (works, tensors they read, payload bytes): kept until the works completed.
        self._pending: list[tuple[list[Any], list[torch.Tensor], int]] = []

    def connect(self, endpoint: PeerEndpoint) -> None:
        super().connect(endpoint)
        host, port, actor, backend = endpoint.address
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        pair_id = f"nccl-{uuid.uuid4().hex}"
        accepted = actor.kv_accept.remote(pair_id)
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=TIMEOUT)
        group = pair_group(dist.PrefixStore(pair_id, store), 1, backend)
        ray.get(accepted)
        self._groups[(endpoint.instance_id, endpoint.rank)] = (
            group,
            device or torch.device("cpu"),
        )

    def send(self, peer: tuple[str, int], runs: list[PageRun]) -> None:
        parts: list[torch.Tensor] = []
        device = self._groups[peer][1]
        for _, source in runs:
            pair = source.contiguous_parts()
            if pair is None or pair[0].device != device:
                payload = source.gather().to(device)
                pair = [payload[0], payload[1]]
            parts += [_bytes(pair[0]), _bytes(pair[1])]
        self._post(peer, [h for h, _ in runs], [], parts)

    def _post(
        self,
        peer: tuple[str, int],
        headers: list[PageHeader],
        marks: list[str],
        parts: list[torch.Tensor],
    ) -> None:
        """One message: the frame, the header, then each run's K and V parts, in order."""
        group, device = self._groups[peer]
        head = pack_message(headers, marks)
        tensors = [
            _frame(len(head), len(headers), device),
            torch.tensor(list(head), dtype=torch.uint8, device=device),
            *parts,
        ]
        try:
            works = [group.send([t], 0, 0) for t in tensors]
        except RuntimeError as e:  # the peer is gone
            self.stats.failures += 1
            raise TransferError(f"nccl transfer failed: {e}") from e
        self._pending.append((works, tensors, sum(h.nbytes for h in headers)))

    def finish(self, peer: tuple[str, int], request_id: str) -> None:
        """Queue the mark; ``flush`` sends a step's marks to a rank as one message."""
        self._marks.setdefault(peer, []).append(request_id)

    def flush(self) -> None:
        marks, self._marks = self._marks, {}
        for peer, request_ids in marks.items():
            self._post(peer, [], request_ids, [])
        pending, self._pending = self._pending, []
        if not pending:
            return
        start = time.perf_counter()
        try:
            for works, _, _ in pending:
                for w in works:
                    w.wait()
        except RuntimeError as e:  # the peer is gone, or did not receive within TIMEOUT
            self.stats.failures += 1
            raise TransferError(f"nccl transfer failed: {e}") from e
        carried = [n for _, _, n in pending if n]
        self.stats.add(sum(carried), time.perf_counter() - start, messages=len(carried))

    def disconnect(self, instance_id: str) -> None:
        for key in [k for k in self._groups if k[0] == instance_id]:
            self._marks.pop(key, None)
            self._close(*self._groups.pop(key))
        super().disconnect(instance_id)

    def _close(self, group: Any, device: torch.device) -> None:
        with contextlib.suppress(RuntimeError):
            group.send([_frame(0, 0, device)], 0, 0).wait()

    def close(self) -> None:
        for group, device in self._groups.values():
            self._close(group, device)
        self._groups.clear()
        self._marks.clear()


register("nccl", NcclSender, NcclReceiver)
