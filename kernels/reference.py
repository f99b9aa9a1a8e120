"""The reference arithmetic of the fused layer ops, in plain torch.

These are what the "torch" kernel ops (:mod:`pdserve.kernels.torch_ops`)
compute, and so what every layer built without explicit ops computes; the
Triton kernels are tested against them, rounding included. This module imports
nothing of pdserve, so the layers and the kernel registry can both use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H], weight [H] -> ``(norm(x + residual) * weight, x + residual)``."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    if dtype == torch.float32:
        # One fused kernel; the same arithmetic as below for float32.
        return F.rms_norm(x, weight.shape, weight, eps), x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[..., 2 * I]`` tensor -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by RoPE tables cos/sin [T, 1, D / 2] (GPT-NeoX half rotation).

    The same arithmetic as ``x * cos + rotate_half(x) * sin``.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> ([T, k] float32 weights summing to 1, [T, k] expert ids).

    Softmax over the experts in float32, keep the ``k`` largest, renormalise.
    """
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts
