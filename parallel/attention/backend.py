"""The attention backend seam: metadata of a mixed batch, and the backend interface.

A step's tokens are flat, decode tokens first (one per sequence), then prefill
chunks (``query_len`` tokens each, possibly after a cached prefix)::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes    prefill 0     prefill 1
    slot_mapping[t] = block_table[pos_t // block_size] * block_size + pos_t % block_size

Every backend writes the new K/V into the paged cache at ``slot_mapping`` and
then attends each query to its sequence's whole context through the block table.
Backends are chosen by name from :data:`ATTENTION_BACKENDS`.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
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
    """

    name: ClassVar[str]

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> out: [T, Hq, D]."""

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return True


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def select_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend called ``name``, or the device's default for "auto"."""
    # Import the implementations so they register themselves.
    from pdserve.parallel.attention import cpu, torch_ref  # noqa: F401

    with contextlib.suppress(ImportError):  # without Triton the other backends still serve
        from pdserve.parallel.attention import triton  # noqa: F401

    if name == "auto":
        preferred = {"cuda": ["triton"], "cpu": ["cpu"]}.get(device.type, [])
        name = next(
            (
                n
                for n in preferred
                if n in ATTENTION_BACKENDS and ATTENTION_BACKENDS[n].supports(device)
            ),
            "torch",
        )
    if name not in ATTENTION_BACKENDS:
        from pdserve.core.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "attention_backend", f"unknown backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}"
        )
    backend = ATTENTION_BACKENDS[name]
    if not backend.supports(device):
        from pdserve.core.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "attention_backend", f"backend {name!r} cannot run on {device.type}"
        )
    return backend
