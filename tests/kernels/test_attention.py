"""Attention backends against a plain dense attention written out per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan
from pdserve.kernels.attention import select_backend
from pdserve.parallel.batch import prepare_batch

BLOCK = 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, Hq, D] at positions start.., k/v [start+n, Hkv, D] -> [n, Hq, D], causal."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (cached tokens, new tokens) per sequence: one token, exactly one block, block
# boundaries, a chunk after a cached prefix, and a longer decode.
LAYOUT = [(0, 1), (0, BLOCK), (BLOCK - 1, 1), (BLOCK, 1), (2 * BLOCK, 3), (0, 7), (21, 1), (5, 6)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (8, 2, 64), (6, 3, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense(
    backend: str, heads: int, kv_heads: int, head_dim: int, dtype
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered pages
    seqs, full_k, full_v = [], [], []
    for i, (cached, new) in enumerate(LAYOUT):
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(cached):  # the prefix is already in the cache
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[pos]
        seqs.append(ScheduledSeq(f"s{i}", [0] * new, cached, table, RowSampling()))
        full_k.append(k)
        full_v.append(v)
    batch = prepare_batch(StepPlan(1, seqs), BLOCK, torch.device("cpu"))
    # The batch puts one-token sequences first: build q/k/v in that order.
    order = [s for s in seqs if s.num_tokens == 1] + [s for s in seqs if s.num_tokens > 1]
    index = {s.request_id: i for i, s in enumerate(seqs)}
    q_parts, k_new, v_new = [], [], []
    queries = {}
    for s in order:
        i = index[s.request_id]
        q = torch.randn(s.num_tokens, heads, head_dim, generator=gen).to(dtype)
        queries[s.request_id] = q
        q_parts.append(q)
        k_new.append(full_k[i][s.start_pos :])
        v_new.append(full_v[i][s.start_pos :])
    impl = select_backend(backend, torch.device("cpu"))(heads, kv_heads, head_dim, head_dim**-0.5)
    out = impl.forward(
        torch.cat(q_parts), torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, batch.meta
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    row = 0
    for s in order:
        i = index[s.request_id]
        want = dense_attention(queries[s.request_id], full_k[i], full_v[i], s.start_pos)
        got = out[row : row + s.num_tokens].float()
        assert torch.allclose(got, want, atol=tol, rtol=tol), (s, (got - want).abs().max())
        row += s.num_tokens
    # The new keys and values were written into their pages.
    for s in seqs:
        i = index[s.request_id]
        for pos in range(s.start_pos, s.seq_len):
            assert torch.equal(k_cache[s.block_table[pos // BLOCK], pos % BLOCK], full_k[i][pos])
