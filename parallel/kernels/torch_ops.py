"""The "torch" kernel ops: the layers' own reference code, unchanged.

This is what a layer built without explicit ops computes, and the ground truth
the Triton kernels are tested against.
"""

from __future__ import annotations

import torch

from pdserve.parallel.kernels import KernelOps, register_kernels
from pdserve.parallel.layers import rms_norm_residual, silu_and_mul
from pdserve.parallel.moe import route
from pdserve.parallel.rotary import rotate_reference


@register_kernels
class TorchKernels(KernelOps):
    name = "torch"

    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_residual(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_reference(x, cos, sin)

    def route(self, router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return route(router_logits, top_k)
