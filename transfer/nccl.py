"""``nccl`` connector: pages device to device over a ``torch.distributed`` pair group.

Every (prefill rank, decode rank) pair gets a two-process group of its own, made
as :mod:`~pdserve.transfer.pairs` makes pairs (``p2p``'s too). The group is NCCL when the decode rank's KV
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
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import register
from pdserve.transfer.pairs import PairReceiver, PairSender, byte_view
from pdserve.transfer.wire import (
    PageHeader,
    PageRun,
    PageSource,
    pack_message,
    torch_dtype,
    unpack_message,
)

logger = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=60)  # the pair group's: how long a send or receive may wait
_FRAME = struct.Struct("<II")  # header length (0: close), number of runs


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


class NcclReceiver(PairReceiver):
    def address_extras(self) -> tuple[Any, ...]:
        assert self.kv_cache is not None
        return (backend_for(self.kv_cache.device),)

    def join(self, store: Any) -> Any:
        assert self.kv_cache is not None
        device = self.kv_cache.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return pair_group(store, 0, backend_for(device))

    def serve(self, group: Any, pair_id: str) -> None:
        assert self.kv_cache is not None
        device = self.kv_cache.device
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
                group.recv([byte_view(part)], 1, 0).wait()
            return
        run = torch.empty(header.shape, dtype=torch_dtype(header.dtype), device=device)
        for part in (run[0], run[1]):
            group.recv([byte_view(part)], 1, 0).wait()
        self.write(header, run[0], run[1])


class NcclSender(PairSender):
    def join(self, store: Any, *extras: Any) -> Any:
        """(the pair group, the device its buffers are on): the decode rank says the backend."""
        (backend,) = extras
        if backend != "nccl":
            return pair_group(store, 1, backend), torch.device("cpu")
        return pair_group(store, 1, backend), torch.device("cuda", torch.cuda.current_device())

    def send(self, peer: tuple[str, int], runs: list[PageRun]) -> None:
        parts: list[torch.Tensor] = []
        device = self._groups[peer][1]
        for _, source in runs:
            pair = source.contiguous_parts()
            if pair is None or pair[0].device != device:
                payload = source.gather().to(device)
                pair = [payload[0], payload[1]]
            parts += [byte_view(pair[0]), byte_view(pair[1])]
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
        self.pending(works, tensors, sum(h.nbytes for h in headers))

    def post_marks(self, peer: tuple[str, int], request_ids: list[str]) -> None:
        self._post(peer, [], request_ids, [])

    def close_pair(self, link: Any) -> None:
        group, device = link
        with contextlib.suppress(RuntimeError):
            group.send([_frame(0, 0, device)], 0, 0).wait()


register("nccl", NcclSender, NcclReceiver)
