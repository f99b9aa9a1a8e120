"""Rotary position embedding (GPT-NeoX half rotation) applied to q and k in one pass.

Same arithmetic and rounding as :func:`pdserve.kernels.reference.rotate`:
``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` with every product and sum
rounded to the activation dtype. The tables are the caller's, so any frequency
rule (plain, linear, llama3) is just different tables: either already taken at
the step's positions (``cos, sin [T, 1, D / 2]``), or whole
(``[max_positions, D / 2]``) with ``positions [T]`` to index them here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.support import next_pow2, require_last_dim_contiguous


@triton.jit
def _rotate_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    row = token
    if HAS_POSITIONS:
        row = tl.load(pos_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    c_mask = cols < HALF
    mask = (heads < NUM_HEADS)[:, None] & c_mask[None, :]
    cos = tl.load(cos_ptr + row * stride_ct + cols, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_st + cols, mask=c_mask, other=0.0).to(tl.float32)
    cos = cos.to(dtype).to(tl.float32)[None, :]  # the tables in the activations' dtype
    sin = sin.to(dtype).to(tl.float32)[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HALF, o2.to(dtype), mask=mask)


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H, D] (may be a strided view) -> rotated copy [T, H, D].

    Without ``positions``, row ``t`` of ``cos``/``sin`` belongs to token ``t``
    (``[T, 1, D / 2]`` as :meth:`RotaryEmbedding.tables` returns, heads
    broadcast); with ``positions [T]``, token ``t`` uses row ``positions[t]`` of
    whole ``[max_positions, D / 2]`` float32 tables.
    """
    num_tokens, num_heads, dim = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"unsupported dtype {x.dtype}")
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if dim % 2 or cos2.shape[1] != dim // 2 or sin2.shape != cos2.shape:
        raise ValueError(f"tables {tuple(cos.shape)} do not fit head_dim {dim}")
    require_last_dim_contiguous(x, cos2, sin2)
    out = torch.empty((num_tokens, num_heads, dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotate_kernel[(num_tokens,)](
            x,
            cos2,
            sin2,
            x if positions is None else positions,
            out,
            x.stride(0),
            x.stride(1),
            cos2.stride(0),
            sin2.stride(0),
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HALF=dim // 2,
            HAS_POSITIONS=positions is not None,
            BLOCK_H=next_pow2(num_heads),
            BLOCK_HALF=next_pow2(dim // 2),
        )
    return out
