"""The page wire format: one msgpack header for a message, then the raw bytes of its pages.

A message goes to one decode rank and carries one layer's pages of every
request that streams there in that step (one *run* of pages per request), and
any end-of-transfer marks::

    header:  msgpack [marks, [run, ...]]
             run = [request_id, layer, block_ids, dtype, shape, head_start, head_end]
    payload: for each run in header order, its K part then its V part,
             each [pages, block_size, heads, head_dim] in ``dtype``

A run names its destination: the request, the receiving rank's local layer
index, the receiving instance's block ids, and the head range in that rank's
local numbering. A receiver needs nothing else to place the bytes. The header
is packed once per message, whatever the number of runs. As one byte string
(:func:`encode`) a message is ``[u32 header length][header][payload]``;
connectors that move tensors send the header and the parts separately
(:mod:`~pdserve.transfer.p2p`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import msgpack
import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class PageHeader:
    """One run: one request's pages of one layer, for a range of KV heads."""

    request_id: str
    layer: int  # the receiving rank's local layer index
    block_ids: list[int]  # the receiving instance's pages
    dtype: str
    shape: list[int]  # of the payload: [2, pages, block_size, heads, head_dim]
    head_start: int  # local head range on the receiving rank
    head_end: int

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def fields(self) -> list[object]:
        return [
            self.request_id,
            self.layer,
            self.block_ids,
            self.dtype,
            self.shape,
            self.head_start,
            self.head_end,
        ]


def pack_message(headers: Sequence[PageHeader], marks: Sequence[str] = ()) -> bytes:
    """The header of one message: its runs and its end-of-transfer marks, packed once."""
    return bytes(msgpack.packb([list(marks), [h.fields() for h in headers]]))


def unpack_message(data: bytes | memoryview) -> tuple[list[PageHeader], list[str]]:
    """The runs and the marks of a message header."""
    marks, runs = msgpack.unpackb(data)
    return [PageHeader(*run) for run in runs], marks


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def encode(headers: Sequence[PageHeader], payloads: Sequence[torch.Tensor]) -> bytes:
    """One message as bytes (for transports that move opaque buffers).

    ``payloads[i]`` is run ``i``'s ``[2, pages, block_size, heads, head_dim]``.
    """
    head = pack_message(headers)
    raw = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in payloads)
    return _LEN.pack(len(head)) + head + raw


def decode(message: bytes | memoryview) -> tuple[list[PageHeader], list[torch.Tensor]]:
    """Runs and payload tensors (views over ``message``) of an encoded message."""
    view = memoryview(message)
    (n,) = _LEN.unpack(view[: _LEN.size])
    headers, _ = unpack_message(view[_LEN.size : _LEN.size + n])
    body = np.frombuffer(view[_LEN.size + n :], dtype=np.uint8)
    data = torch.from_numpy(body.copy() if not body.flags.writeable else body)
    payloads, offset = [], 0
    for header in headers:
        part = data[offset : offset + header.nbytes]
        payloads.append(part.view(torch_dtype(header.dtype)).view(header.shape))
        offset += header.nbytes
    return headers, payloads


def counts_up(ids: list[int]) -> bool:
    """Whether ``ids`` is one run of consecutive block ids (a list compare, no Python loop)."""
    return bool(ids) and ids == list(range(ids[0], ids[0] + len(ids)))


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of runs where both block lists count up by one."""
    if counts_up(src) and counts_up(dst) and len(src) == len(dst):
        return [(src[0], dst[0], len(src))]
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


@dataclass(frozen=True)
class PageSource:
    """One layer's pages on the sending rank, read only when the connector moves them.

    ``cache`` is that layer's ``[2, blocks, block_size, local heads, head_dim]``.
    """

    cache: torch.Tensor
    block_ids: list[int]
    head_start: int
    head_end: int

    @property
    def nbytes(self) -> int:
        per_block = self.cache[:, 0, :, self.head_start : self.head_end].numel()
        return per_block * len(self.block_ids) * self.cache.element_size()

    @cached_property
    def pages(self) -> torch.Tensor:
        """This source's heads, page-major: ``[blocks, 2, block_size, heads, head_dim]``.

        A view made once; a run of blocks is then a slice of its first dimension,
        the cheapest view torch makes.
        """
        pages = self.cache.transpose(0, 1)
        if self.head_start != 0 or self.head_end != self.cache.shape[3]:
            pages = pages[:, :, :, self.head_start : self.head_end]
        return pages

    def contiguous_parts(self) -> list[torch.Tensor] | None:
        """K and V pages as two views with no copy, when the pages and heads allow it."""
        full_heads = self.head_start == 0 and self.head_end == self.cache.shape[3]
        if not full_heads or not counts_up(self.block_ids):
            return None
        s, n = self.block_ids[0], len(self.block_ids)
        return [self.cache[0, s : s + n], self.cache[1, s : s + n]]

    def gather(self) -> torch.Tensor:
        """The payload ``[2, pages, block_size, heads, head_dim]`` as one tensor."""
        index = torch.tensor(self.block_ids, dtype=torch.long, device=self.cache.device)
        return self.cache[:, index, :, self.head_start : self.head_end].contiguous()

    def copy_into(
        self, dst_pages: torch.Tensor, dst_blocks: list[int], head_start: int, head_end: int
    ) -> None:
        """Copy into another cache's pages, one strided copy per run of blocks.

        ``dst_pages`` is that layer page-major, ``[blocks, 2, block_size, heads,
        head_dim]``, like :attr:`pages`.
        """
        src = self.pages
        full = head_start == 0 and head_end == dst_pages.shape[3]
        for s, d, n in block_runs(self.block_ids, dst_blocks):
            dst = dst_pages[d : d + n] if full else dst_pages[d : d + n, :, :, head_start:head_end]
            dst.copy_(src[s : s + n])


# One run as a sender hands it over: where the pages go, and where they are now.
PageRun = tuple[PageHeader, PageSource]
