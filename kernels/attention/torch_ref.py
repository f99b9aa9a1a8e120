"""Reference paged attention in plain torch: the ground truth for every other backend.

Decode sequences are handled together: their blocks are gathered into a padded
``[Nd, L, Hkv, D]`` context and masked by length. Prefill chunks are handled one
by one, causally, after their cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_backend,
)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values: k, v [T, Hkv, D] into caches [num_blocks, bs, Hkv, D]."""
    num_blocks, block_size, heads, dim = k_cache.shape
    k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, bs, H, D], tables [N, B] -> contexts [N, H, length, D]."""
    n = block_tables.shape[0]
    block_size = cache.shape[1]
    blocks_needed = -(-length // block_size)
    ctx = cache[block_tables[:, :blocks_needed].long()]  # [N, B', bs, H, D]
    ctx = ctx.reshape(n, blocks_needed * block_size, cache.shape[2], cache.shape[3])
    return ctx[:, :length].transpose(1, 2)


@register_backend
class TorchAttention(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        # q: [Nd, Hq, D] -> [Nd, Hq, 1, D]; context [Nd, Hkv, L, D]
        length = meta.max_decode_seq_len
        keys = gather_kv(k_cache, meta.decode_block_tables, length)
        values = gather_kv(v_cache, meta.decode_block_tables, length)
        positions = torch.arange(length, device=q.device)
        mask = positions.unsqueeze(0) < meta.decode_seq_lens.unsqueeze(1)  # [Nd, L]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        )
        out.copy_(o.squeeze(2))

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        start = 0
        for i, (qlen, seq_len) in enumerate(
            zip(meta.prefill_query_lens_list, meta.prefill_seq_lens_list, strict=True)
        ):
            qi = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
            if qlen == seq_len:
                # No cached prefix: the chunk's own K/V are the whole context.
                ki = k[start : start + qlen].transpose(0, 1).unsqueeze(0)
                vi = v[start : start + qlen].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                table = meta.prefill_block_tables[i : i + 1]
                ki = gather_kv(k_cache, table, seq_len)
                vi = gather_kv(v_cache, table, seq_len)
                # Query j sits at position seq_len - qlen + j and sees keys up to it.
                q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device).unsqueeze(1)
                k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=k_pos <= q_pos, scale=self.scale, enable_gqa=True
                )
            out[start : start + qlen] = o.squeeze(0).transpose(0, 1)
            start += qlen
