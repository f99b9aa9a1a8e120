"""Paged decode attention: one new query token per sequence over its whole context.

Grid ``(sequence, kv head, partition)``. A program takes the ``GROUP`` query
heads that share one KV head (GQA; padded to 16 rows for ``tl.dot``) and reads
that head's keys and values once, through the block table. Long contexts are
split into partitions attended in parallel (split-K); each writes its partial
output and log-sum-exp, and a second small kernel combines them::

    partial [Nd, Hq, P, D] f32, lse [Nd, Hq, P] f32  --combine-->  out [Nd, Hq, D]

With one partition the first kernel writes the output directly.
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
    multiprocessor_count,
    next_pow2,
    require_last_dim_contiguous,
)

PARTITION_ALIGN = 64  # partitions are whole tiles of every dtype
MIN_PARTITION = 256  # shortest partition worth its own program
MAX_PARTITIONS = 64  # keeps the combine kernel's [P, D] tile in registers


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_ptr,
    lse_ptr,
    qk_scale,
    block_size,
    partition_size,
    num_partitions,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if start >= seq_len:
        return  # past this sequence's context: the combine ignores it
    end = tl.minimum(start + partition_size, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask)
    if UPCAST:
        q = q.to(tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        pages, slots = paged_slots(table, offs_n, n_mask, block_size)
        k = load_paged_tile(k_head, pages, slots, stride_kb, stride_ks, offs_d, n_mask, d_mask)
        v = load_paged_tile(v_head, pages, slots, stride_vb, stride_vs, offs_d, n_mask, d_mask)
        m_i, l_i, acc = attend_tile(
            q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, UPCAST, PRECISION
        )
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLIT:
        row = (seq * NUM_HEADS + heads) * num_partitions + part  # [BLOCK_H]
        tl.store(partial_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=q_mask)
        tl.store(lse_ptr + row, m_i + tl.log2(l_safe), mask=h_mask)
    else:
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_kernel(
    partial_ptr,
    lse_ptr,
    seq_lens_ptr,
    out_ptr,
    partition_size,
    num_partitions,
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, partition_size)
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < used
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_partitions + offs_p
    lse = tl.load(lse_ptr + row, mask=p_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = tl.where(p_mask, weight, 0.0)
    mask = p_mask[:, None] & d_mask[None, :]
    parts = tl.load(partial_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    o = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    dst = out_ptr + seq * stride_os + head * stride_oh + offs_d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_partition_size(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Context positions per partition: split only when sequences x heads cannot fill the GPU."""
    whole = triton.cdiv(max(max_seq_len, 1), PARTITION_ALIGN) * PARTITION_ALIGN
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(2 * multiprocessor_count(device), programs)
    parts = min(wanted, MAX_PARTITIONS, triton.cdiv(max_seq_len, MIN_PARTITION))
    if parts <= 1:
        return whole
    return triton.cdiv(triton.cdiv(max_seq_len, parts), PARTITION_ALIGN) * PARTITION_ALIGN


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """q [Nd, Hq, D] over caches [num_blocks, bs, Hkv, D] -> out [Nd, Hq, D].

    ``block_tables [Nd, max_blocks]`` and ``seq_lens [Nd]`` (int32, new token
    included) locate each context. ``partition_size`` (a multiple of 64)
    overrides the split-K heuristic.
    """
    check_dtype(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    require_last_dim_contiguous(q, k_cache, v_cache, out)
    if num_seqs == 0:
        return out
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_seq_len, q.device)
    if partition_size % PARTITION_ALIGN:
        raise ValueError(
            f"partition_size must be a multiple of {PARTITION_ALIGN}, got {partition_size}"
        )
    num_partitions = triton.cdiv(max(max_seq_len, 1), partition_size)
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    split = num_partitions > 1
    partial = lse = out  # unused placeholders without a split
    if split:
        partial = q.new_empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32)
        lse = q.new_empty((num_seqs, num_heads, num_partitions), dtype=torch.float32)
    upcast, precision = dot_settings(q.dtype)
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial,
        lse,
        scale * LOG2_E,
        k_cache.shape[1],
        partition_size,
        num_partitions,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_D=block_d,
        BLOCK_N=attention_tile(q.dtype),
        SPLIT=split,
        UPCAST=upcast,
        PRECISION=precision,
    )
    if split:
        _combine_kernel[(num_seqs, num_heads)](
            partial,
            lse,
            seq_lens,
            out,
            partition_size,
            num_partitions,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_P=next_pow2(num_partitions),
        )
    return out
