"""Paged prefill attention: prompt chunks, causal, after each sequence's cached prefix.

The chunks of all sequences are packed back to back (varlen): chunk ``i`` is
rows ``[start_loc[i], start_loc[i + 1])`` of ``q`` and ends the context at
``seq_lens[i]``, so its query ``j`` sits at position ``seq_len - q_len + j`` and
sees every key up to and including that position. Keys and values are read
from the paged cache (the chunk's own were written there first), through the
block table. Grid ``(sequence, query head, query tile)``; tiles past a
sequence's chunk return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.paged import LOG2_E, attend_tile, load_paged_tile, paged_slots
from pdserve.kernels.support import (
    attention_tile,
    check_dtype,
    dot_settings,
    next_pow2,
    require_last_dim_contiguous,
)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(start_loc_ptr + seq)
    q_len = tl.load(start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_mask = m_mask[:, None] & d_mask[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m
    table = tables_ptr + seq.to(tl.int64) * stride_table
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The tile's last query sees up to position prefix + (tile + 1) * BLOCK_M - 1.
    end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        pages, slots = paged_slots(table, offs_n, n_mask, block_size)
        k = load_paged_tile(k_head, pages, slots, stride_kb, stride_ks, offs_d, n_mask, d_mask)
        v = load_paged_tile(v_head, pages, slots, stride_vb, stride_vs, offs_d, n_mask, d_mask)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Tp, Hq, D] (chunks packed) over caches [num_blocks, bs, Hkv, D] -> out [Tp, Hq, D].

    ``query_start_loc [Np + 1]``, ``seq_lens [Np]`` and ``block_tables [Np, max_blocks]``
    (int32) describe each chunk; ``max_query_len`` is the longest chunk.
    """
    check_dtype(q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    require_last_dim_contiguous(q, k_cache, v_cache, out)
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    if num_seqs == 0 or max_query_len == 0:
        return out
    tile = attention_tile(q.dtype)
    block_m = min(tile, max(16, next_pow2(max_query_len)))
    upcast, precision = dot_settings(q.dtype)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2_E,
        k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=tile,
        UPCAST=upcast,
        PRECISION=precision,
    )
    return out
