"""SiLU-and-multiply of a fused gate/up projection: ``silu(gate) * up``.

Same rounding as :func:`pdserve.kernels.reference.silu_and_mul`: the
SiLU is computed in float32 and rounded to the activation dtype, then
multiplied by ``up`` and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.support import check_dtype, next_pow2, rows_per_program

_MAX_COLS = 1024  # columns per program; wide rows are split over the grid's second axis


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_rows,
    inter,
    stride_x,
    stride_o,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    src = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate columns, then up columns) -> [..., I]."""
    check_dtype(gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even, got {gate_up.shape[-1]}")
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0] and inter:
        block = min(_MAX_COLS, next_pow2(inter))
        rows = rows_per_program(block, x.shape[0])
        grid = (triton.cdiv(x.shape[0], rows), triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x, out, x.shape[0], inter, x.stride(0), out.stride(0), ROWS=rows, BLOCK=block
        )
    return out.view(*gate_up.shape[:-1], inter)
