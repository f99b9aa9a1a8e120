"""The pieces every paged attention kernel is made of (Triton device functions).

``paged_slots`` finds the page of each context position ``offs_n`` of one
sequence through its block table, and the position's slot in that page;
``load_paged_tile`` reads the keys (or values) of one KV head at those places:
``cache[table[pos // block_size], pos % block_size, kv_head, :]``. The keys and
the values share one look-up of the table. Any block size works, since every
position is addressed on its own.

``attend_tile`` is one step of the online softmax (FlashAttention): scores of a
query tile against a key tile, the running max ``m`` and sum ``l`` in the
base-2 domain (``qk_scale`` includes log2(e)), and the rescaled accumulator.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def paged_slots(table_ptr, offs_n, n_mask, block_size):
    """The page of each position ``offs_n`` (read from the block table) and its slot in it."""
    pages = tl.load(table_ptr + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    return pages, offs_n % block_size


@triton.jit
def load_paged_tile(head_ptr, pages, slots, stride_b, stride_s, offs_d, n_mask, d_mask):
    """[BLOCK_N, BLOCK_D] tile of the cache at ``pages``/``slots`` (zeros where masked);
    ``head_ptr`` is the cache's pointer moved to one KV head."""
    rows = pages * stride_b + slots * stride_s
    mask = n_mask[:, None] & d_mask[None, :]
    return tl.load(head_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def attend_tile(
    q,
    k,
    v,
    mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold the key/value tile into (m_i, l_i, acc); ``mask`` [M, N] marks visible keys."""
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P meets V in V's type (tensor cores for half types), accumulating in float32.
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc
