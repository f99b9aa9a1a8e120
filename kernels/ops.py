"""The kernel ops seam: the :class:`KernelOps` interface and the registry of its implementations.

Implementations register themselves by name with :func:`register_kernels` when
their module is imported; :func:`~pdserve.kernels.select_kernels`
imports them and picks one.
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from typing import ClassVar

import torch


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


def triton_may_be_chosen(name: str, device: torch.device, known: Collection[str]) -> bool:
    """Whether selecting ``name`` on ``device`` may pick a Triton implementation, so it
    must be imported to register: on CUDA, or for a name not among ``known`` (it may be
    "triton"; an unknown name's error lists every one). On a CPU, "auto" never picks
    Triton, and importing it costs a rank 0.27 CPU-s of its start (py-spy)."""
    return device.type == "cuda" or (name != "auto" and name not in known)
