"""Rotary position embedding (GPT-NeoX half-rotation, as Llama uses), with scaling.

Frequencies follow the checkpoint's settings: plain RoPE, linear scaling, or the
llama3 rule that leaves high frequencies alone, divides low ones by ``factor``
and blends in between. Cos/sin tables are computed once in float32 and cast to
the activations' dtype at use, matching the reference implementation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.core.model_config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE tables at a step's positions (``tables``, once per step); each layer
    rotates q and k with them through its kernel ops
    (reference: :func:`pdserve.kernels.reference.rotate`)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        # dtype -> (the cos buffer they were made from, cos, sin in that dtype)
        self._in_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at ``positions [T]``: each [T, 1, head_dim / 2] in ``dtype``."""
        # The whole tables in ``dtype``, [max_positions, 1, head_dim / 2], converted on
        # first use: a step then gathers its rows with one op per table, not three.
        cos = self.cos
        held = self._in_dtype.get(dtype)
        if held is None or held[0] is not cos:  # first use, or the buffers were moved
            held = (cos, cos.unsqueeze(1).to(dtype), self.sin.unsqueeze(1).to(dtype))
            self._in_dtype[dtype] = held
        return held[1].index_select(0, positions), held[2].index_select(0, positions)
