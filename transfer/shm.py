"""Shared-memory connector (same node; the default on CPU).

The decode rank allocates its KV cache in a file under ``/dev/shm``; a prefill
rank on the same node maps that file and copies each layer's pages straight
into the reserved pages, no message on the data path. The sender keeps each
mapped layer's address and page-major view (:class:`~pdserve.transfer.page_copy.LayerPages`),
made once at ``connect``; a message's runs are merged and copied by one call
(:func:`~pdserve.transfer.page_copy.copy_runs`). The copy runs inline, right
after the layer that wrote the pages: at memory speed a layer's pages take far
less time than the layer's compute, and a copy on a helper thread measured half
as fast (torch runs it single-threaded there).

The file is allocated and mapped in full when the cache is made
(:mod:`~pdserve.transfer.host_memory`): no page fault lands in a step, and a
``/dev/shm`` too small for the cache is an error at start-up, not a SIGBUS
later. The decode rank removes its file when it closes; files left by a
process that died are swept when the next receiver starts.
"""

from __future__ import annotations

import atexit
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import KVReceiver, KVSender, register
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.host_memory import populate, reserve_file
from pdserve.transfer.page_copy import LayerPages, copy_runs
from pdserve.transfer.wire import PageRun, dtype_name, torch_dtype

SHM_DIR = Path(os.environ.get("PDSERVE_SHM_DIR", "/dev/shm"))
_PATTERN = re.compile(r"pdserve-kv-(\d+)-[0-9a-f]+$")
PARALLEL_FROM = 256 * 1024  # bytes of a message from which its copy uses torch's threads


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def sweep_stale_files() -> int:
    """Remove KV files of processes that no longer exist; returns how many."""
    removed = 0
    if not SHM_DIR.is_dir():
        return 0
    for path in SHM_DIR.glob("pdserve-kv-*"):
        m = _PATTERN.match(path.name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except PermissionError:
            pass
    return removed


class ShmReceiver(KVReceiver):
    def __init__(self, instance_id: str, rank: int) -> None:
        super().__init__(instance_id, rank)
        sweep_stale_files()
        self.path = SHM_DIR / f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        atexit.register(self.close)

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if device.type != "cpu":
            raise TransferError(
                f"the shm connector needs the KV cache in host memory, not {device}: "
                "use the cuda_ipc connector"
            )
        numel = 1
        for d in shape:
            numel *= d
        reserve_file(self.path, numel * torch.tensor([], dtype=dtype).element_size())
        self._shape, self._dtype = shape, dtype
        self.kv_cache = _map(str(self.path), shape, dtype)
        populate(self.kv_cache)
        return self.kv_cache

    def endpoint(self, actor: Any) -> PeerEndpoint:
        return PeerEndpoint(
            "shm", self.instance_id, self.rank, self._shape, dtype_name(self._dtype), str(self.path)
        )

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class ShmSender(KVSender):
    def __init__(self, parallel_from: int = PARALLEL_FROM) -> None:
        """``parallel_from``: bytes of a message from which its copy is split over
        torch's threads (below, one thread copies it: a thread wakes slower than
        it copies a few pages)."""
        super().__init__()
        self.parallel_from = parallel_from
        # Per decode rank, per local layer: that layer of its file.
        self._pages: dict[tuple[str, int], list[LayerPages]] = {}

    def connect(self, endpoint: PeerEndpoint) -> None:
        super().connect(endpoint)
        if not Path(endpoint.address).exists():
            raise TransferError(
                f"decode rank {endpoint.instance_id}/{endpoint.rank} is not on this node "
                f"({endpoint.address} missing): use the object_store or p2p connector"
            )
        key = (endpoint.instance_id, endpoint.rank)
        cache = _map(endpoint.address, endpoint.kv_shape, torch_dtype(endpoint.dtype))
        populate(cache)  # no page faults in the copies of a step
        self._pages[key] = [LayerPages.of(layer) for layer in cache.unbind(0)]

    def send(self, peer: tuple[str, int], runs: list[PageRun]) -> None:
        start = time.perf_counter()
        try:
            nbytes = copy_runs(self._pages[peer], runs, self.parallel_from)
        except (RuntimeError, IndexError) as e:
            self.stats.failures += 1
            raise TransferError(f"shared-memory copy to {peer} failed: {e}") from e
        self.stats.add(nbytes, time.perf_counter() - start)

    def flush(self) -> None:
        """Copies are synchronous: when ``send`` returned, the pages were in place."""

    def disconnect(self, instance_id: str) -> None:
        super().disconnect(instance_id)
        for key in [k for k in self._pages if k[0] == instance_id]:
            del self._pages[key]

    def close(self) -> None:
        self._pages.clear()


register("shm", ShmSender, ShmReceiver)
