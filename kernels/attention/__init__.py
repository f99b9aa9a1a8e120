"""Paged attention backends (torch reference; Triton on CUDA) behind one interface.

The interface and the registry are in :mod:`~pdserve.kernels.attention.backend`;
:func:`select_backend` imports the implementations (so they register) and picks one.
"""

from __future__ import annotations

import contextlib

import torch

from pdserve.core.errors import InvalidArgumentError
from pdserve.kernels.attention.backend import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
)
from pdserve.kernels.ops import triton_may_be_chosen


def select_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend called ``name``, or the device's default for "auto"."""
    # Import the implementations so they register themselves (Triton's only where it
    # may be chosen).
    from pdserve.kernels.attention import cpu, torch_ref  # noqa: F401

    if triton_may_be_chosen(name, device, ATTENTION_BACKENDS):
        with contextlib.suppress(ImportError):  # without Triton the others still serve
            from pdserve.kernels.attention import triton  # noqa: F401

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
        raise InvalidArgumentError(
            "attention_backend", f"unknown backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}"
        )
    backend = ATTENTION_BACKENDS[name]
    if not backend.supports(device):
        raise InvalidArgumentError(
            "attention_backend", f"backend {name!r} cannot run on {device.type}"
        )
    return backend


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "select_backend"]
