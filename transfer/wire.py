"""The page wire format: a msgpack header followed by the raw bytes of the pages.

One message carries one layer of a set of pages, for a range of KV heads::

    [u32 header length][msgpack header][payload bytes]
    payload: [2 (K, V), num_pages, block_size, heads, head_dim] in ``dtype``

The header names the destination: the request, the receiving rank's local
layer index, the receiving instance's block ids, and the head range in that
rank's local numbering. A receiver needs nothing else to place the bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in _DTYPES.items()}
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class PageHeader:
    request_id: str
    layer: int  # the receiving rank's local layer index
    block_ids: list[int]  # the receiving instance's pages
    dtype: str
    shape: list[int]  # of the payload: [2, pages, block_size, heads, head_dim]
    head_start: int  # local head range on the receiving rank
    head_end: int

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.tensor([], dtype=_DTYPES[self.dtype]).element_size()

    def pack(self) -> bytes:
        return bytes(
            msgpack.packb(
                [
                    self.request_id,
                    self.layer,
                    self.block_ids,
                    self.dtype,
                    self.shape,
                    self.head_start,
                    self.head_end,
                ]
            )
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> PageHeader:
        return cls(*msgpack.unpackb(data))


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def encode(header: PageHeader, payload: torch.Tensor) -> bytes:
    """One message as bytes (for transports that move opaque buffers)."""
    head = header.pack()
    raw = payload.contiguous().view(torch.uint8).numpy().tobytes()
    return _LEN.pack(len(head)) + head + raw


def decode(message: bytes | memoryview) -> tuple[PageHeader, torch.Tensor]:
    """Header and payload tensor (a view over ``message``) of an encoded message."""
    view = memoryview(message)
    (n,) = _LEN.unpack(view[: _LEN.size])
    header = PageHeader.unpack(view[_LEN.size : _LEN.size + n])
    body = np.frombuffer(view[_LEN.size + n :], dtype=np.uint8)
    payload = torch.from_numpy(body.copy() if not body.flags.writeable else body)
    return header, payload.view(torch_dtype(header.dtype)).view(header.shape)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of runs where both block lists count up by one."""
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

    def contiguous_parts(self) -> list[torch.Tensor] | None:
        """K and V pages as two views with no copy, when the pages and heads allow it."""
        runs = block_runs(self.block_ids, self.block_ids)
        full_heads = self.head_start == 0 and self.head_end == self.cache.shape[3]
        if len(runs) != 1 or not full_heads:
            return None
        s, _, n = runs[0]
        return [self.cache[0, s : s + n], self.cache[1, s : s + n]]

    def gather(self) -> torch.Tensor:
        """The payload ``[2, pages, block_size, heads, head_dim]`` as one tensor."""
        index = torch.tensor(self.block_ids, dtype=torch.long, device=self.cache.device)
        return self.cache[:, index, :, self.head_start : self.head_end].contiguous()

    def copy_into(
        self, dst: torch.Tensor, dst_blocks: list[int], head_start: int, head_end: int
    ) -> None:
        """Copy into another layer cache's pages, one strided copy per run of blocks."""
        for s, d, n in block_runs(self.block_ids, dst_blocks):
            dst[:, d : d + n, :, head_start:head_end].copy_(
                self.cache[:, s : s + n, :, self.head_start : self.head_end]
            )
