"""Fused layer kernels, chosen by name: the seam between the model's layers and their ops.

The layers that have fused forms (:class:`~pdserve.models.layers.RMSNorm`,
the dense and MoE MLPs, the attention's rotary step, the MoE router) are built
with a :class:`KernelOps` and call it for their arithmetic; the model runner
picks the ops once (:func:`select_kernels`) and passes them down through
:func:`~pdserve.models.families.build_model`. Implementations register by name in
:data:`KERNEL_OPS` (:mod:`~pdserve.kernels.ops`, the interface):
"torch" (:mod:`~pdserve.kernels.reference`, the arithmetic the layers
are defined by), "cpu" (:mod:`~pdserve.kernels.cpu_ops`, the row-wise
ops as C kernels, the default on CPUs with a C compiler) and "triton"
(:mod:`pdserve.kernels.triton_ops`, for CUDA, or the CPU under
``TRITON_INTERPRET=1``). The paged attention kernels are
used through the attention backend registry instead
(:mod:`pdserve.kernels.attention.triton`).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from pdserve.core.errors import InvalidArgumentError
from pdserve.kernels.ops import KERNEL_OPS, KernelOps, register_kernels, triton_may_be_chosen
from pdserve.kernels.torch_ops import TorchKernels


def _import_implementations(name: str, device: torch.device) -> None:
    from pdserve.kernels import cpu_ops  # noqa: F401

    if triton_may_be_chosen(name, device, KERNEL_OPS):
        with contextlib.suppress(ImportError):  # without Triton the torch ops serve
            from pdserve.kernels import triton_ops  # noqa: F401


def select_kernels(name: str, device: torch.device) -> KernelOps:
    """The ops called ``name``, or for "auto" Triton on CUDA, C on the CPU, else torch."""
    _import_implementations(name, device)
    if name == "auto":
        preferred = {"cuda": ["triton"], "cpu": ["cpu"]}.get(device.type, [])
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
    return TorchKernels()


__all__ = [
    "KERNEL_OPS",
    "KernelOps",
    "reference_kernels",
    "register_kernels",
    "select_kernels",
]
