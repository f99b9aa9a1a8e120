"""Weight-only int4 matmul with group scales, dequantized in registers.

Storage (:func:`pack_int4`): ``q [N, K]`` in [-8, 7] is kept as ``q + 8`` in
``packed [N, K / 2]`` uint8, byte ``j`` of a row holding column ``j`` in its low
nibble and column ``j + K / 2`` in its high nibble, so one byte tile feeds two
``tl.dot`` calls on two contiguous activation tiles. ``scale [N, K / G]`` holds
one float32 scale per row and group of ``G`` columns; ``K / 2`` must be a whole
number of groups.

One program computes a ``[BLOCK_M, BLOCK_N]`` output tile: for each byte tile
it unpacks both nibbles, multiplies them by their group's scale (the weight the
model computes with, ``(q) * scale``), and accumulates in float32. Float32
activations multiply exactly ("ieee").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.linear_tile import dot, load_x, store, tile_start
from pdserve.kernels.support import check_dtype, linear_launch

_BLOCK_K = 32  # bytes (column pairs) per step


@triton.jit
def _int4_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    HALF,
    stride_x,
    stride_w,
    stride_s,
    stride_o,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows, cols, ks, acc = tile_start(BLOCK_M, BLOCK_N, BLOCK_K)
    for k0 in range(0, HALF, BLOCK_K):
        kk = k0 + ks
        x_lo = load_x(x_ptr, rows, kk, M, HALF, stride_x)
        x_hi = load_x(x_ptr + HALF, rows, kk, M, HALF, stride_x)  # columns kk + HALF
        w_mask = (kk < HALF)[:, None] & (cols < N)[None, :]
        # byte tile [BLOCK_K, BLOCK_N] of packed [N, HALF], transposed
        b = tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=w_mask, other=0).to(
            tl.int32
        )
        s_row = s_ptr + cols[None, :] * stride_s
        s_lo = tl.load(s_row + (kk // GROUP)[:, None], mask=w_mask, other=0.0).to(tl.float32)
        s_hi = tl.load(s_row + ((kk + HALF) // GROUP)[:, None], mask=w_mask, other=0.0).to(
            tl.float32
        )
        w_lo = ((b & 15) - 8).to(tl.float32) * s_lo
        w_hi = ((b >> 4) - 8).to(tl.float32) * s_hi
        acc = dot(x_lo, w_lo, acc, UPCAST, PRECISION)
        acc = dot(x_hi, w_hi, acc, UPCAST, PRECISION)
    store(out_ptr, rows, cols, M, N, stride_o, acc)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in [-8, 7] -> packed [N, K / 2] uint8 (low: column j, high: j + K / 2)."""
    if q.shape[1] % 2:
        raise ValueError(f"the input size must be even, got {q.shape[1]}")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    half = q.shape[1] // 2
    return (u[:, :half] | (u[:, half:] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: [N, K / 2] uint8 -> [N, K] int8."""
    lo = (packed & 15).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.cat([lo, hi], dim=1)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int
) -> torch.Tensor:
    """x [T, K] float, packed [N, K / 2] uint8, scale [N, K / group] -> [T, N] in x's dtype."""
    check_dtype(x)
    half = packed.shape[1]
    if packed.dtype != torch.uint8 or 2 * half != x.shape[-1] or half % group:
        raise ValueError(
            f"packed must be uint8 [out, {x.shape[-1] // 2}] with whole groups of {group} in "
            f"each half, got {packed.dtype} {tuple(packed.shape)}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    out, grid, tiles = linear_launch(x, packed.shape[0], _BLOCK_K)
    if out.numel() == 0:
        return out
    m, n = out.shape
    _int4_linear_kernel[grid](
        x,
        packed,
        scale,
        out,
        m,
        n,
        half,
        x.stride(0),
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUP=group,
        **tiles,
    )
    return out
