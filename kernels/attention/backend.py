"""The attention backend seam: metadata of a mixed batch, and the backend interface.

A step's tokens are flat, decode tokens first (one per sequence), then prefill
chunks (``query_len`` tokens each, possibly after a cached prefix)::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes    prefill 0     prefill 1
    slot_mapping[t] = block_table[pos_t // block_size] * block_size + pos_t % block_size

Every backend writes the new K/V into the paged cache at ``slot_mapping`` and
then attends each query to its sequence's whole context through the block table.
Backends register by name in :data:`ATTENTION_BACKENDS`;
:func:`pdserve.kernels.attention.select_backend` chooses one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the batch, shared by every layer.

    Tensors (int32 unless noted, on the model's device):
        slot_mapping: [T] int64, the cache slot of each new token.
        decode_seq_lens: [Nd] context length of each decode sequence, new token included.
        decode_block_tables: [Nd, max_blocks] block ids, padded with 0.
        prefill_query_start_loc: [Np + 1] offsets of each chunk in the prefill tokens.
        prefill_seq_lens: [Np] context length after the chunk.
        prefill_block_tables: [Np, max_blocks].
    Python lists mirror the prefill lengths for backends that loop on the host.
    ``derived`` holds what a backend works out from these once per step for all
    layers (host pointers, checks), under the backend's name; never copied.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    max_decode_seq_len: int
    prefill_query_start_loc: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_query_lens_list: list[int]
    prefill_seq_lens_list: list[int]
    derived: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens_list)

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens


class AttentionBackend(abc.ABC):
    """Paged attention for one layer shape.

    ``forward`` is called once per layer per step, with the layer's own K/V cache
    views (``[num_blocks, block_size, Hkv, D]``). It writes the new keys and
    values into the cache (its only side effect) and returns the attention output.
    It never allocates or frees blocks: the block tables are the scheduler's.

    ``forward`` is the same for every backend: ``write_kv``, then ``decode`` for
    the decode tokens and ``prefill`` for the prefill chunks, each filling its
    own rows of the output. A backend implements those three, once per layer and
    step each (``decode`` and ``prefill`` only when the step has such tokens).
    """

    name: ClassVar[str]

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> out: [T, Hq, D] (contiguous)."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:  # decodes only (no slicing: the common step at small batch)
            self.decode(q, k_cache, v_cache, meta, out)
        elif nd:
            self.decode(q[:nd], k_cache, v_cache, meta, out[:nd])
        if meta.num_prefills:
            self.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, out[nd:])
        return out

    def forward_rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """RoPE and ``forward`` fused, for a step of decodes only; None where not fused.

        qkv: [T, (Hq + 2 * Hkv) * D], the fused projection's output, heads flat (this
        step's to overwrite); cos/sin: [T, 1, D / 2]. Rotates q and k as
        :func:`pdserve.kernels.reference.rotate` does, then as ``forward``
        -> out [T, Hq * D], heads flat, which the backend may reuse from its next
        call on (read it before). On None the caller rotates and calls ``forward``.
        """
        return None

    @abc.abstractmethod
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the step's k, v [T, Hkv, D] into the caches at ``slot_mapping`` [T]."""

    @abc.abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """q [Nd, Hq, D], one token per decode sequence, over its whole context -> out [Nd, Hq, D].

        ``out`` is contiguous; the new tokens' K/V are already in the cache.
        """

    @abc.abstractmethod
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
        """Prefill chunks q [Tp, Hq, D], k/v [Tp, Hkv, D] -> out [Tp, Hq, D].

        Each chunk attends causally to itself after its cached prefix (in the cache).
        """

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return True


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls
