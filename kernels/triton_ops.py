"""The "triton" kernel ops: each fused layer op as one Triton kernel launch.

Runs on CUDA; on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1``
when this module is first imported), which is how the tests check it without a
GPU. Importing it fails with ImportError where Triton is not installed.
"""

from __future__ import annotations

import torch

from pdserve.kernels import activation, norm, rotary, routing
from pdserve.kernels.ops import KernelOps, register_kernels
from pdserve.kernels.support import runs_on


@register_kernels
class TritonKernels(KernelOps):
    name = "triton"

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return runs_on(device)

    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.rms_norm_residual(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(gate_up)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotary.rotate(x, cos, sin)

    def route(self, router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.route(router_logits, top_k)
