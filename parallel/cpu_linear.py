"""Pre-packed float32 matmuls for CPUs (oneDNN), used by the parallel linear layers.

At decode batch sizes (8-64 rows) ``F.linear`` runs MKL's generic GEMM at about
100 GFLOP/s on the test machines; oneDNN with the weight reordered once into its
blocked layout reaches about 140-150. :func:`pack_linears` reorders every dense
linear of a model after loading; the packed copy replaces the plain weight, so
memory does not double. It uses the oneDNN ops that ``torch.compile`` itself
emits on CPU; where they are missing or disagree with ``F.linear`` on a probe,
nothing is packed and the layers keep ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for: a typical decode batch.
_PACK_BATCH_HINT = 32


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [T, in] float32; packed: oneDNN weight for [out, in] -> [T, out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when packed matmuls run here and match ``F.linear`` on a probe."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen)
        x = torch.randn(5, 40, generator=gen)
        got = packed_linear(x, _pack(w), None)
    except (AttributeError, RuntimeError) as e:
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", e)
        return False
    return bool(torch.allclose(got, F.linear(x, w), rtol=1e-4, atol=1e-4))


def pack_linears(model: nn.Module) -> int:
    """Pack the weight of every layer that has ``pack()``; returns how many."""
    count = 0
    for module in model.modules():
        pack = getattr(module, "pack", None)
        if callable(pack):
            pack(_pack)
            count += 1
    return count
