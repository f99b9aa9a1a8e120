"""Fused layer kernels, chosen by name: the seam between the model's layers and their ops.

The layers that have fused forms (:class:`~pdserve.parallel.layers.RMSNorm`,
the dense and MoE MLPs, the attention's rotary step, the MoE router) are built
with a :class:`KernelOps` and call it for their arithmetic; the model runner
picks the ops once (:func:`select_kernels`) and passes them down through
:func:`~pdserve.parallel.models.build_model`. Implementations register by name in
:data:`KERNEL_OPS`: "torch" (the reference, bit for bit the layers' own code) and
"triton" (:mod:`pdserve.parallel.kernels.triton_ops`, for CUDA, or the CPU under
``TRITON_INTERPRET=1``). The paged attention kernels are used through the
attention backend registry instead (:mod:`pdserve.parallel.attention.triton`).
"""

from __future__ import annotations

import abc
import contextlib
import functools
from typing import ClassVar

import torch

from pdserve.core.errors import InvalidArgumentError


class KernelOps(abc.ABC):
    """The fused ops of one implementation. Stateless: one instance serves every layer.

    Every op returns new tensors and leaves its inputs untouched.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, H], weight [H] -> (norm(x + residual) * weight, x + residual)."""

    @abc.abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * I] -> silu(gate) * up, [..., I]."""

    @abc.abstractmethod
    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D], cos/sin [T, 1, D / 2] -> x rotated by RoPE, [T, H, D]."""

    @abc.abstractmethod
    def route(self, router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, E] -> ([T, k] float32 weights summing to 1, [T, k] int64 expert ids)."""

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return True


KERNEL_OPS: dict[str, type[KernelOps]] = {}


def register_kernels(cls: type[KernelOps]) -> type[KernelOps]:
    KERNEL_OPS[cls.name] = cls
    return cls


def _import_implementations() -> None:
    from pdserve.parallel.kernels import torch_ops  # noqa: F401

    with contextlib.suppress(ImportError):  # without Triton the torch ops serve every device
        from pdserve.parallel.kernels import triton_ops  # noqa: F401


def select_kernels(name: str, device: torch.device) -> KernelOps:
    """The ops called ``name``, or for "auto" Triton on CUDA and torch elsewhere."""
    _import_implementations()
    if name == "auto":
        preferred = {"cuda": ["triton"]}.get(device.type, [])
        name = next(
            (n for n in preferred if n in KERNEL_OPS and KERNEL_OPS[n].supports(device)), "torch"
        )
    if name not in KERNEL_OPS:
        raise InvalidArgumentError(
            "kernel_backend", f"unknown kernels {name!r}; known: {sorted(KERNEL_OPS)}"
        )
    ops = KERNEL_OPS[name]
    if not ops.supports(device):
        raise InvalidArgumentError(
            "kernel_backend", f"kernels {name!r} cannot run on {device.type}"
        )
    return ops()


@functools.cache
def reference_kernels() -> KernelOps:
    """The torch reference ops: what a layer built without explicit ops uses."""
    from pdserve.parallel.kernels.torch_ops import TorchKernels

    return TorchKernels()


__all__ = [
    "KERNEL_OPS",
    "KernelOps",
    "reference_kernels",
    "register_kernels",
    "select_kernels",
]
