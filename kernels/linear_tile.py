"""The pieces the quantized linear kernels are made of (Triton device functions).

:func:`tile_start` places one program's ``[BLOCK_M, BLOCK_N]`` output tile and
starts its float32 accumulator; :func:`load_x` reads an activation tile at one
step along K; :func:`dot` accumulates a weight tile, converted to the
activations' type (float32 under the interpreter's bfloat16, see
:func:`~pdserve.kernels.support.dot_settings`); :func:`store` writes
the finished tile in the output's dtype. The launch settings come from
:func:`~pdserve.kernels.support.linear_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_start(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's tile of a quantized linear kernel: its output rows and columns,
    the offsets of one step along K, and a zero float32 accumulator."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return rows, cols, ks, acc


@triton.jit
def load_x(x_ptr, rows, kk, M, K, stride_x):
    """The activations at ``rows`` and columns ``kk`` of ``x`` [M, K] (zeros outside)."""
    mask = (rows < M)[:, None] & (kk < K)[None, :]
    return tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)


@triton.jit
def dot(x, w, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + x @ w``, the weights in the activations' type (float32 when ``UPCAST``)."""
    if UPCAST:
        out = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
    else:
        out = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    return out


@triton.jit
def store(out_ptr, rows, cols, M, N, stride_o, tile):
    """Write the float32 ``tile`` at ``rows`` and ``cols`` of ``out`` [M, N], in its dtype."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], tile.to(dtype), mask=mask)
