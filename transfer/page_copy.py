"""One message's pages copied between two host KV caches mapped in one process.

The shared-memory sender's data path. A message's runs (one per request) are
merged first: runs that read the same source layer with the same heads into
the same destination layer and heads form one *group*, whose block lists are
the runs' lists laid end to end.

A group whose pages hold every head on both sides, in one dtype and page shape,
goes to one call of ``page_copy.c`` with the two layers' addresses and its
block ids (one int64 buffer, no tensor made): the C side checks every id
against its layer, copies each range of pages consecutive on both sides as two
byte ranges (K, V), and from ``parallel_from`` bytes up splits the bytes over
torch's OpenMP threads, as torch's own ``copy_`` does. Requests whose pages sit
next to each other on both sides so cost one range. Other groups (a subset of
heads, re-sharding between TP sizes), and every group where the C helper cannot
be built, take one torch ``copy_`` between page-major views per range.

Layouts: a source layer is ``[2, blocks, block_size, heads, head_dim]``;
:class:`LayerPages` holds a destination layer.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels.cpu_build import compile_library, declare
from pdserve.transfer.wire import PageHeader, PageRun, PageSource, block_runs

Group = tuple[PageHeader, PageSource, list[int], list[int]]  # header, source, src ids, dst ids


@functools.cache
def _copy_pages() -> Callable[[int], int] | None:
    """``pd_copy_pages`` of ``page_copy.c``, built on first use; None without a compiler."""
    lib = compile_library(Path(__file__).with_name("page_copy.c"), "page_copy")
    if lib is None:
        return None
    copy_pages: Callable[[int], int] = declare(lib, "pd_copy_pages", [ctypes.c_void_p])
    return copy_pages


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One destination layer, made once per connected peer.

    ``pages`` is the layer page-major, ``[blocks, 2, block_size, heads,
    head_dim]``; ``base`` the address of K page 0, ``v_offset`` the bytes from
    there to V page 0, ``page_bytes`` one page of K (or V) with every head.
    """

    pages: torch.Tensor
    base: int
    v_offset: int
    page_bytes: int
    blocks: int
    heads: int
    dtype: torch.dtype
    itemsize: int
    page_shape: tuple[int, ...]  # [block_size, heads, head_dim]
    page_strides: tuple[int, ...]  # of a dense layer's [blocks, block_size, heads, head_dim]

    @classmethod
    def of(cls, layer: torch.Tensor) -> LayerPages:
        """``layer``: ``[2, blocks, block_size, heads, head_dim]``, each page dense."""
        assert _dense_pages(layer), "each page of a destination layer must be dense"
        size = layer.element_size()
        return cls(
            layer.transpose(0, 1),
            layer.data_ptr(),
            layer.stride(0) * size,
            layer.stride(1) * size,
            layer.shape[1],
            layer.shape[3],
            layer.dtype,
            size,
            tuple(layer.shape[2:]),
            layer.stride()[1:],
        )


def _dense_pages(layer: torch.Tensor) -> bool:
    """Whether each page of ``[2, blocks, bs, H, D]`` is one dense block of memory."""
    _, _, bs, heads, dim = layer.shape
    return layer.stride()[1:] == (bs * heads * dim, heads * dim, dim, 1)


def _groups(runs: list[PageRun]) -> list[Group]:
    """Runs merged where source, layer and heads agree, in order of first appearance."""
    if len(runs) == 1:
        header, source = runs[0]
        return [(header, source, source.block_ids, header.block_ids)]
    groups: dict[tuple[int, int, int, int, int, int], Group] = {}
    for header, source in runs:
        key = (
            id(source.cache),
            source.head_start,
            source.head_end,
            header.layer,
            header.head_start,
            header.head_end,
        )
        group = groups.get(key)
        if group is None:
            groups[key] = (header, source, list(source.block_ids), list(header.block_ids))
        else:
            group[2].extend(source.block_ids)
            group[3].extend(header.block_ids)
    return list(groups.values())


def _copy_by_address(
    copy_pages: Callable[[int], int],
    dst: LayerPages,
    group: Group,
    parallel_from: int,
) -> bool:
    """Copy ``group`` by ``pd_copy_pages`` if its pages are whole dense pages of one
    dtype and page shape on both sides; False, copying nothing, if they are not."""
    header, source, src_ids, dst_ids = group
    cache = source.cache
    shape, stride = cache.shape, cache.stride()
    if not (
        header.head_start == 0
        and header.head_end == dst.heads
        and source.head_start == 0
        and source.head_end == dst.heads
        and cache.dtype == dst.dtype
        and cache.is_cpu
        and shape[2:] == dst.page_shape
        and stride[1:] == dst.page_strides
    ):
        return False
    args = array("q", [dst.base, dst.v_offset, dst.blocks, cache.data_ptr()])
    args.extend((stride[0] * dst.itemsize, shape[1], dst.page_bytes, len(src_ids), parallel_from))
    args.extend(src_ids)
    args.extend(dst_ids)
    failed = copy_pages(args.buffer_info()[0])
    if failed:
        raise RuntimeError(
            f"pages {src_ids} -> {dst_ids} outside the caches "
            f"({shape[1]} source, {dst.blocks} destination pages)"
            if failed == 1
            else "out of memory"
        )
    return True


def copy_runs(layers: list[LayerPages], runs: list[PageRun], parallel_from: int) -> int:
    """Copy one message's runs into ``layers``; returns the bytes copied.

    Raises RuntimeError or IndexError when a run does not fit the caches.
    """
    total = 0
    copy_pages = _copy_pages()
    for group in _groups(runs):
        header, source, src_ids, dst_ids = group
        if len(src_ids) != len(dst_ids):
            raise RuntimeError(f"{len(src_ids)} source pages for {len(dst_ids)} destination pages")
        dst = layers[header.layer]
        h0, h1 = header.head_start, header.head_end
        total += len(src_ids) * 2 * dst.page_bytes * (h1 - h0) // dst.heads
        if copy_pages is not None and _copy_by_address(copy_pages, dst, group, parallel_from):
            continue
        for s, d, n in block_runs(src_ids, dst_ids):
            if h0 == 0 and h1 == dst.heads:
                dst.pages[d : d + n] = source.pages[s : s + n]
            else:
                dst.pages[d : d + n, :, :, h0:h1] = source.pages[s : s + n]
    return total
