"""``torch.distributed`` point-to-point connector.

Every (prefill rank, decode rank) pair gets its own two-process gloo group, made
as :mod:`~pdserve.transfer.pairs` makes pairs. A receiver thread per
pair writes pages as they arrive and counts end-of-transfer marks, which the
decode rank checks before a request runs (``needs_arrival_marks``).

A message (see :mod:`~pdserve.transfer.wire`) is one header frame on tag 0
and its payload: every run's K part back to back, then every V part::

    tag 0:  [u32 header length][u32 inline][msgpack header]   into a HEADER_SLOT buffer
    tag 1:  all K parts, all V parts: two sends     (inline: into staging, INLINE_PART max)
    tag 2:  K part, V part of run 0, K, V of run 1  (direct: into the cache)

A gloo send moves its bytes only once the matching receive is posted, so a
receive posted late costs a round trip, which on a busy host means waking the
receiving thread. The receiver therefore keeps receives posted ahead: two
header slots, and two inline pairs of staging buffers. A message whose K (and
V) parts together fit ``INLINE_PART`` goes inline: its parts land in the next
posted pair without waiting for the receiving thread (one part is a view of
the sender's cache when the message is one run of consecutive pages; several
runs are packed first), and the receiver copies them into the cache. A larger
message goes direct: once the receiver read its header it posts one receive
per part, straight into the cache when the run's pages are consecutive with
all their heads and through the pair's own staging buffer otherwise. A header
never exceeds its slot: a message whose header would is split into several.
A header length of 0 closes the pair. Each pair holds 4 x ``INLINE_PART``
(8 MiB) of inline staging and two header slots on the decode rank.

Payloads travel as bytes over gloo; a KV cache on a GPU is staged through
host memory (the ``nccl`` connector moves GPU pages device to device).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from collections import deque
from datetime import timedelta
from typing import Any

import numpy as np
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

_TIMEOUT = timedelta(seconds=60)
HEADER_SLOT = 256 * 1024  # bytes of each header receive; fits ~60k block ids
INLINE_PART = 2 << 20  # bytes of each inline staging buffer (K or V of a message)
_HEADER_TAG, _INLINE_TAG, _DIRECT_TAG = 0, 1, 2
_FRAME = struct.Struct("<II")  # header length, inline (1) or direct (0)


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Byte tensors back to back: the one itself, or a copy (numpy's, on this thread)."""
    if len(parts) == 1:
        return parts[0]
    return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))


class P2PReceiver(PairReceiver):
    def join(self, store: Any) -> Any:
        return dist.ProcessGroupGloo(store, 0, 2, _TIMEOUT)

    def serve(self, group: Any, pair_id: str) -> None:
        inbox = _Inbox(group)  # one per pair: several senders' threads write into one rank
        try:
            while (message := inbox.next_header()) is not None:
                headers, marks, inline = message
                if inline:
                    self._receive_inline(inbox, headers)
                elif headers:
                    self._receive_direct(inbox, headers)
                for request_id in marks:
                    self.record_mark(request_id)
        except Exception as e:  # the sender died or closed the pair
            logger.info("p2p pair %s ended: %s", pair_id, e)

    def _receive_inline(self, inbox: _Inbox, headers: list[PageHeader]) -> None:
        """Copy one inline message's runs from the staging pair they landed in."""
        start = time.perf_counter()
        keys, values = inbox.inline_parts()  # all K parts, all V parts, as bytes
        offset = 0
        for header in headers:
            half, dtype = header.nbytes // 2, torch_dtype(header.dtype)
            k, v = (
                b[offset : offset + half].view(dtype).view(header.shape[1:]) for b in (keys, values)
            )
            self.write(header, k, v)
            offset += half
        inbox.release_inline()
        self.stats.add(2 * offset, time.perf_counter() - start)

    def _direct_parts(self, header: PageHeader) -> list[torch.Tensor] | None:
        """The run's K and V destinations in the cache, when it can receive straight there."""
        assert self.kv_cache is not None
        if self.kv_cache.device.type != "cpu":
            return None
        dst = self.kv_cache[header.layer]  # [2, blocks, bs, H_local, D]
        return PageSource(
            dst, header.block_ids, header.head_start, header.head_end
        ).contiguous_parts()

    def _receive_direct(self, inbox: _Inbox, headers: list[PageHeader]) -> None:
        """Receive one direct message's parts: into the cache, or staged and scattered."""
        start = time.perf_counter()
        targets = [self._direct_parts(h) for h in headers]
        staged = sum(h.nbytes for h, t in zip(headers, targets, strict=True) if t is None)
        if inbox.staging.numel() < staged:
            inbox.staging = torch.empty(staged, dtype=torch.uint8)
        works, scatter, offset = [], [], 0
        for header, parts in zip(headers, targets, strict=True):
            if parts is None:
                buf = inbox.staging[offset : offset + header.nbytes]
                offset += header.nbytes
                half = header.nbytes // 2
                parts = [buf[:half], buf[half:]]
                scatter.append((header, buf))
            works += [inbox.group.recv([byte_view(p)], 1, _DIRECT_TAG) for p in parts]
        for w in works:
            w.wait()
        for header, buf in scatter:
            self._scatter(header, buf)
        self.stats.add(sum(h.nbytes for h in headers), time.perf_counter() - start)

    def _scatter(self, header: PageHeader, buf: torch.Tensor) -> None:
        """Copy a staged run ``[2, pages, bs, heads, D]`` into its pages of the cache."""
        assert self.kv_cache is not None
        payload = buf.view(torch_dtype(header.dtype)).view(header.shape)
        source = PageSource(payload, list(range(header.shape[1])), 0, header.shape[3])
        dst_pages = self.kv_cache[header.layer].transpose(0, 1)
        source.copy_into(dst_pages, header.block_ids, header.head_start, header.head_end)


class _Inbox:
    """One pair's receives posted ahead: two header slots and two inline staging pairs.

    A header slot is posted again once the other one was read; an inline pair
    once its message was copied out. Gloo matches receives to sends in order
    per tag, so the n-th inline message lands in the n-th pair posted.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.staging = torch.empty(0, dtype=torch.uint8)  # direct runs to scatter
        self._slots = [torch.empty(HEADER_SLOT, dtype=torch.uint8) for _ in range(2)]
        self._turn = 0
        self._header = group.recv([self._slots[0]], 1, _HEADER_TAG)
        self._inline: deque[tuple[list[torch.Tensor], list[Any]]] = deque()
        for _ in range(2):
            self._post_inline([torch.empty(INLINE_PART, dtype=torch.uint8) for _ in range(2)])

    def _post_inline(self, pair: list[torch.Tensor]) -> None:
        self._inline.append((pair, [self.group.recv([b], 1, _INLINE_TAG) for b in pair]))

    def next_header(self) -> tuple[list[PageHeader], list[str], bool] | None:
        """The next message's runs, marks and whether it is inline; None once closed."""
        self._header.wait()
        view = self._slots[self._turn].numpy().data  # a memoryview of the slot
        n, inline = _FRAME.unpack_from(view)
        if n == 0:
            return None
        headers, marks = unpack_message(view[_FRAME.size : _FRAME.size + n])
        self._turn ^= 1  # the slot just read is posted again only after the next one
        self._header = self.group.recv([self._slots[self._turn]], 1, _HEADER_TAG)
        return headers, marks, bool(inline)

    def inline_parts(self) -> list[torch.Tensor]:
        """The oldest inline pair (K bytes, V bytes) once landed; then ``release_inline``."""
        pair, works = self._inline[0]
        for w in works:
            w.wait()
        return pair

    def release_inline(self) -> None:
        pair, _ = self._inline.popleft()
        self._post_inline(pair)


class P2PSender(PairSender):
    def join(self, store: Any, *extras: Any) -> Any:
        return dist.ProcessGroupGloo(store, 1, 2, _TIMEOUT)

    def send(self, peer: tuple[str, int], runs: list[PageRun]) -> None:
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for _, source in runs:
            pair = source.contiguous_parts()
            if pair is None or pair[0].device.type != "cpu":
                payload = source.gather().cpu()
                pair = [payload[0], payload[1]]
            keys.append(byte_view(pair[0]))
            values.append(byte_view(pair[1]))
        self._post(peer, [h for h, _ in runs], [], keys, values)

    def _post(
        self,
        peer: tuple[str, int],
        headers: list[PageHeader],
        marks: list[str],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> None:
        """One message: the header frame, then the K and V parts (one per run), inline or direct."""
        head = pack_message(headers, marks)
        if _FRAME.size + len(head) > HEADER_SLOT:
            self._split(peer, headers, marks, keys, values, len(head))
            return
        inline = 0 < sum(k.numel() for k in keys) <= INLINE_PART
        if inline:
            parts, tag = [_packed(keys), _packed(values)], _INLINE_TAG
        else:
            parts, tag = [p for kv in zip(keys, values, strict=True) for p in kv], _DIRECT_TAG
        frame = bytearray(_FRAME.size + len(head))
        _FRAME.pack_into(frame, 0, len(head), int(inline))
        frame[_FRAME.size :] = head
        tensors = [torch.frombuffer(frame, dtype=torch.uint8), *parts]
        group = self._groups[peer]
        works = [group.send([tensors[0]], 0, _HEADER_TAG)]
        works += [group.send([p], 0, tag) for p in parts]
        self.pending(works, tensors, sum(h.nbytes for h in headers))

    def _split(
        self,
        peer: tuple[str, int],
        headers: list[PageHeader],
        marks: list[str],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        size: int,
    ) -> None:
        """Post a message whose header exceeds the slot as several, in the same order."""
        if len(headers) > 1:
            mid = len(headers) // 2
            self._post(peer, headers[:mid], [], keys[:mid], values[:mid])
            self._post(peer, headers[mid:], marks, keys[mid:], values[mid:])
        elif headers and marks:
            self._post(peer, headers, [], keys, values)
            self._post(peer, [], marks, [], [])
        elif len(marks) > 1:
            self._post(peer, [], marks[: len(marks) // 2], [], [])
            self._post(peer, [], marks[len(marks) // 2 :], [], [])
        else:
            raise TransferError(
                f"a page header of {size} bytes exceeds the p2p header slot "
                f"({HEADER_SLOT} bytes): send fewer pages per request and layer"
            )

    def post_marks(self, peer: tuple[str, int], request_ids: list[str]) -> None:
        self._post(peer, [], request_ids, [], [])

    def close_pair(self, link: Any) -> None:
        frame = torch.zeros(_FRAME.size, dtype=torch.uint8)  # header length 0
        with contextlib.suppress(RuntimeError):
            link.send([frame], 0, _HEADER_TAG).wait()


register("p2p", P2PSender, P2PReceiver)
