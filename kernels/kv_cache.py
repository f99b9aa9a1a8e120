"""Writing a step's new keys and values into their pages of the paged KV cache.

Token ``t`` goes to cache slot ``slot_mapping[t]``, i.e. block
``slot // block_size``, row ``slot % block_size`` (see
:mod:`pdserve.kernels.attention.backend`); a negative slot is padding and is
skipped. Inputs may be strided views (k and v are slices of the fused QKV
output); the cache may be any view whose last dimension is contiguous.
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
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # heads * head_dim, the elements of one token
    TOKENS: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK_ROW)
    head = cols // HEAD_DIM
    dim = cols % HEAD_DIM
    mask = (slots >= 0)[:, None] & (cols < ROW)[None, :]
    block = slots // block_size
    row = slots % block_size
    t = tokens.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=mask)
    k_dst = (block * stride_kcb + row * stride_kcs)[:, None] + (head * stride_kch + dim)[None, :]
    v_dst = (block * stride_vcb + row * stride_vcs)[:, None] + (head * stride_vch + dim)[None, :]
    tl.store(k_cache_ptr + k_dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at ``slot_mapping [T]``."""
    check_dtype(k, v, k_cache, v_cache)
    num_tokens, heads, dim = k.shape
    if num_tokens == 0:
        return
    require_last_dim_contiguous(k, v, k_cache, v_cache)
    row = heads * dim
    tokens = rows_per_program(row, num_tokens)
    _write_kv_kernel[(triton.cdiv(num_tokens, tokens),)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k_cache.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        HEAD_DIM=dim,
        ROW=row,
        TOKENS=tokens,
        BLOCK_ROW=next_pow2(row),
    )
