"""Weight-only int8 matmul: ``y = (x @ q.T) * scale`` with int8 ``q`` read as is.

One program computes a ``[BLOCK_M, BLOCK_N]`` tile of the output: it walks K in
``BLOCK_K`` steps, loads an activation tile and an int8 weight tile, converts the
weights to the activation dtype in registers (exact: int8 values fit every float
type) and accumulates ``tl.dot`` in float32. The per-output-channel scale is
applied once to the accumulator, which equals scaling every weight first since
the scale is constant along K. Weights stay int8 in memory: a decode step reads a
quarter of the bytes of float32 weights.

Float32 activations multiply exactly ("ieee"); under the interpreter bfloat16
is upcast (see :func:`~pdserve.kernels.support.dot_settings`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.linear_tile import dot, load_x, store, tile_start
from pdserve.kernels.support import check_dtype, linear_launch

_BLOCK_K = 64


@triton.jit
def _int8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows, cols, ks, acc = tile_start(BLOCK_M, BLOCK_N, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = load_x(x_ptr, rows, kk, M, K, stride_x)
        w_mask = (kk < K)[:, None] & (cols < N)[None, :]
        # w: [BLOCK_K, BLOCK_N], the transposed tile of q [N, K]
        w = tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=w_mask, other=0)
        acc = dot(x, w, acc, UPCAST, PRECISION)
    scale = tl.load(s_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    store(out_ptr, rows, cols, M, N, stride_o, acc * scale[None, :])


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, in] float, qweight [out, in] int8, scale [out] float32 -> [T, out] in x's dtype."""
    check_dtype(x)
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"qweight must be int8 [out, {x.shape[-1]}], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    out, grid, tiles = linear_launch(x, qweight.shape[0], _BLOCK_K)
    if out.numel() == 0:
        return out
    m, n, k = x.shape[0], qweight.shape[0], qweight.shape[1]
    _int8_linear_kernel[grid](
        x, qweight, scale, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0), **tiles
    )
    return out
