"""Fused residual add + RMS normalisation, one pass over each row.

Same contract and rounding as :func:`pdserve.kernels.reference.rms_norm_residual`:
the sum ``x + residual`` is rounded to the activation dtype (it is the new
residual), normalised in float32, rounded again, then scaled by the weight in
the activation dtype. For float32 every rounding is exact and this is
``F.rms_norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.support import (
    check_dtype,
    next_pow2,
    require_last_dim_contiguous,
    rows_per_program,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, 1) / hidden
    h = (x * tl.rsqrt(mean_square + eps)[:, None]).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_o + cols[None, :], (h * w[None, :]).to(dtype), mask=mask
    )


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H], weight [H] -> (norm(x + residual), x + residual), each [T, H]."""
    tensors = (x, weight) if residual is None else (x, residual, weight)
    check_dtype(*tensors)
    require_last_dim_contiguous(*tensors)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    num_rows = x2.shape[0]
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    new_residual = x
    res2 = res_out = x2  # placeholders when there is no residual to add
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        res_out = torch.empty_like(out)
        new_residual = res_out.view(x.shape)
    if num_rows:
        rows = rows_per_program(hidden, num_rows)
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x2,
            res2,
            weight,
            out,
            res_out,
            num_rows,
            hidden,
            eps,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            ROWS=rows,
            BLOCK=next_pow2(hidden),
            num_warps=min(16, max(4, next_pow2(hidden) // 1024)),
        )
    return out.view(x.shape), new_residual
