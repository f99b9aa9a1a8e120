"""``torch.distributed`` point-to-point connector.

Every (prefill rank, decode rank) pair gets its own two-process gloo group, made
outside either instance's own process group: the decode rank listens on a TCP
store; a sender names a fresh pair id, asks the decode rank's actor to accept
it, and both build the pair group under that prefix. Each message is three
sends on the pair, in order: the header length, the msgpack header, the
payload bytes. A receiver thread per pair writes pages as they arrive and
counts end-of-transfer marks, which the decode rank checks before a request
runs (``needs_arrival_marks``).

The payload is sent as its K part then its V part. When the source pages are
consecutive with all their heads, the sender sends views of its cache (no
copy); when the destination pages are, the receiver receives straight into its
cache (no copy). Otherwise one side gathers or scatters through a buffer.

Payloads travel as bytes over gloo; a KV cache on a GPU is staged through
host memory (NCCL pair groups are not wired in yet).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import KVReceiver, KVSender, PeerEndpoint, register
from pdserve.transfer.wire import PageHeader, PageSource, dtype_name, torch_dtype

logger = logging.getLogger(__name__)

_TIMEOUT = timedelta(seconds=60)
_CLOSE = -1
_MARK_LAYER = -1


def _node_ip() -> str:
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


class P2PReceiver(KVReceiver):
    needs_arrival_marks = True

    def __init__(self, instance_id: str, rank: int) -> None:
        super().__init__(instance_id, rank)
        self._store = dist.TCPStore(
            _node_ip(), 0, 2, is_master=True, timeout=_TIMEOUT, wait_for_workers=False
        )
        self._threads: list[threading.Thread] = []

    def endpoint(self, actor: Any) -> PeerEndpoint:
        assert self.kv_cache is not None
        return PeerEndpoint(
            "p2p",
            self.instance_id,
            self.rank,
            tuple(self.kv_cache.shape),
            dtype_name(self.kv_cache.dtype),
            (self._store.host, self._store.port, actor),
        )

    def accept(self, pair_id: str) -> None:
        """Join a sender's pair group (rank 0 of 2) and receive on it in a thread."""
        group = dist.ProcessGroupGloo(dist.PrefixStore(pair_id, self._store), 0, 2, _TIMEOUT)
        thread = threading.Thread(
            target=self._serve,
            args=(group, pair_id),
            daemon=True,
            name=f"pdserve-p2p-{pair_id[:6]}",
        )
        thread.start()
        self._threads.append(thread)

    def _serve(self, group: Any, pair_id: str) -> None:
        # One staging buffer per pair: several senders' threads write into one rank.
        staging = torch.empty(0, dtype=torch.uint8)
        try:
            while True:
                length = torch.empty(1, dtype=torch.int64)
                group.recv([length], 1, 0).wait()
                n = int(length.item())
                if n == _CLOSE:
                    return
                raw = torch.empty(n, dtype=torch.uint8)
                group.recv([raw], 1, 0).wait()
                header = PageHeader.unpack(raw.numpy().tobytes())
                if header.layer == _MARK_LAYER:
                    self.record_mark(header.request_id)
                    continue
                staging = self._receive_payload(group, header, staging)
        except Exception as e:  # the sender died or closed the pair
            logger.info("p2p pair %s ended: %s", pair_id, e)

    def _receive_payload(
        self, group: Any, header: PageHeader, staging: torch.Tensor
    ) -> torch.Tensor:
        """Write one message's pages; returns the (possibly grown) staging buffer."""
        assert self.kv_cache is not None
        dst = self.kv_cache[header.layer]  # [2, blocks, bs, H_local, D]
        target = PageSource(dst, header.block_ids, header.head_start, header.head_end)
        parts = target.contiguous_parts()
        with self.stats.timed(header.nbytes):
            if parts is not None:  # straight into the cache
                for part in parts:
                    group.recv([part.view(torch.uint8).reshape(-1)], 1, 0).wait()
                return staging
            half = header.nbytes // 2
            if staging.numel() < header.nbytes:
                staging = torch.empty(header.nbytes, dtype=torch.uint8)
            buf = staging[: header.nbytes]
            for i in range(2):
                group.recv([buf[i * half : (i + 1) * half]], 1, 0).wait()
            payload = buf.view(torch_dtype(header.dtype)).view(header.shape)
            source = PageSource(payload, list(range(len(header.block_ids))), 0, payload.shape[3])
            source.copy_into(dst, header.block_ids, header.head_start, header.head_end)
        return staging


class P2PSender(KVSender):
    def __init__(self) -> None:
        super().__init__()
        self._groups: dict[tuple[str, int], Any] = {}
        self._pending: list[tuple[Any, list[torch.Tensor], int]] = []

    def connect(self, endpoint: PeerEndpoint) -> None:
        super().connect(endpoint)
        host, port, actor = endpoint.address
        pair_id = f"pair-{uuid.uuid4().hex}"
        accepted = actor.kv_accept.remote(pair_id)
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=_TIMEOUT)
        group = dist.ProcessGroupGloo(dist.PrefixStore(pair_id, store), 1, 2, _TIMEOUT)
        ray.get(accepted)
        self._groups[(endpoint.instance_id, endpoint.rank)] = group

    def _post(self, peer: tuple[str, int], header: PageHeader, parts: list[torch.Tensor]) -> None:
        group = self._groups[peer]
        head = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
        length = torch.tensor([head.numel()], dtype=torch.int64)
        tensors = [length, head] + [p.view(torch.uint8).reshape(-1) for p in parts]
        works = [group.send([t], 0, 0) for t in tensors]
        self._pending.append((works, tensors, header.nbytes if parts else 0))

    def send(self, peer: tuple[str, int], header: PageHeader, source: PageSource) -> None:
        parts = source.contiguous_parts()
        if parts is None or parts[0].device.type != "cpu":
            payload = source.gather().cpu()
            parts = [payload[0], payload[1]]
        self._post(peer, header, parts)

    def finish(self, peer: tuple[str, int], request_id: str) -> None:
        self._post(peer, PageHeader(request_id, _MARK_LAYER, [], "float32", [0], 0, 0), [])

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        nbytes = sum(n for _, _, n in pending)
        if not pending:
            return
        with self.stats.timed(nbytes):
            try:
                for works, _, _ in pending:
                    for w in works:
                        w.wait()
            except RuntimeError as e:
                raise TransferError(f"p2p transfer failed: {e}") from e
        self.stats.messages += sum(1 for _, _, n in pending if n) - 1

    def disconnect(self, instance_id: str) -> None:
        for key in [k for k in self._groups if k[0] == instance_id]:
            self._close(self._groups.pop(key))
        super().disconnect(instance_id)

    def _close(self, group: Any) -> None:
        with contextlib.suppress(RuntimeError):
            group.send([torch.tensor([_CLOSE], dtype=torch.int64)], 0, 0).wait()

    def close(self) -> None:
        for group in self._groups.values():
            self._close(group)
        self._groups.clear()


register("p2p", P2PSender, P2PReceiver)
