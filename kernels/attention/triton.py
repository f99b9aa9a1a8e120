"""Paged attention in Triton: the default backend on CUDA.

Per layer and step: one kernel writes the new K/V into their pages
(:mod:`~pdserve.kernels.kv_cache`), one attends the decode tokens
(:mod:`~pdserve.kernels.decode_attention`, split-K over long contexts)
and one the prefill chunks after their cached prefixes
(:mod:`~pdserve.kernels.prefill_attention`). Both read K/V in place
through the block tables; nothing is gathered or padded on the host. On a CPU
it runs only under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
"""

from __future__ import annotations

import torch

from pdserve.kernels.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_backend,
)
from pdserve.kernels.decode_attention import paged_decode_attention
from pdserve.kernels.kv_cache import write_kv
from pdserve.kernels.prefill_attention import paged_prefill_attention
from pdserve.kernels.support import runs_on


@register_backend
class TritonAttention(AttentionBackend):
    name = "triton"

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return runs_on(device)

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
        paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.max_decode_seq_len,
            self.scale,
            out=out,
        )

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
        # k, v are in the cache already: the kernel reads every key through the block table.
        paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_query_start_loc,
            meta.prefill_seq_lens,
            max(meta.prefill_query_lens_list),
            self.scale,
            out=out,
        )
