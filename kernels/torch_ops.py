"""The "torch" kernel ops: the reference arithmetic of :mod:`~pdserve.kernels.reference`.

This is what a layer built without explicit ops computes, and the ground truth
the Triton kernels are tested against.
"""

from __future__ import annotations

import torch

from pdserve.kernels import reference
from pdserve.kernels.ops import KernelOps, register_kernels


@register_kernels
class TorchKernels(KernelOps):
    name = "torch"

    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.rms_norm_residual(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(gate_up)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return reference.rotate(x, cos, sin)

    def route(self, router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.route(router_logits, top_k)
