"""Pre-packed float32 and bfloat16 matmuls for CPUs (oneDNN), used by the parallel linear layers.

At decode batch sizes (8-64 rows) ``F.linear`` runs MKL's generic GEMM at about
100 GFLOP/s on the test machines; oneDNN with the weight reordered once into its
blocked layout reaches about 140-150. :func:`pack_linears` reorders every dense
linear of a model after loading; the packed copy replaces the plain weight, so
memory does not double. It uses the oneDNN ops that ``torch.compile`` itself
emits on CPU; where they are missing or disagree with ``F.linear`` on a probe,
nothing is packed and the layers keep ``F.linear``. bfloat16 weights are packed
only where the CPU has bf16 natively (:mod:`~pdserve.parallel.cpu_features`):
oneDNN then multiplies bf16 with float32 accumulation, rounding the output once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.parallel.cpu_features import has_native_bf16

logger = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for: a typical decode batch.
_PACK_BATCH_HINT = 32
# How far a packed probe may be from ``F.linear``: float32 sums in another order;
# bfloat16 outputs may round to the neighbouring value.
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _missing_op(*args: object) -> torch.Tensor:
    raise RuntimeError("this torch build has no oneDNN packed linear")


# The op's overload, looked up once: a model makes ~30 of these calls per decode step.
# Its builtin (``_op``) where torch exposes one: ``OpOverload.__call__`` is a Python
# frame that only forwards to it.
_LINEAR_POINTWISE: Callable[..., torch.Tensor]
try:
    _overload = torch.ops.mkldnn._linear_pointwise.default
    _LINEAR_POINTWISE = getattr(_overload, "_op", _overload)
except (AttributeError, RuntimeError):
    _LINEAR_POINTWISE = _missing_op


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [T, in] in the weight's dtype; packed: oneDNN weight for [out, in] -> [T, out]
    return _LINEAR_POINTWISE(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when packed matmuls run here and match ``F.linear`` on a probe."""
    if device.type != "cpu" or dtype not in _PROBE_TOLERANCE:
        return False
    if dtype == torch.bfloat16 and not has_native_bf16():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        got = packed_linear(x, _pack(w), None)
    except (AttributeError, RuntimeError) as e:
        logger.info("oneDNN packed linear (%s) unavailable (%s); using F.linear", dtype, e)
        return False
    tol = _PROBE_TOLERANCE[dtype]
    return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=tol, atol=tol))


def pack_linears(model: nn.Module) -> int:
    """Pack the weight of every layer that has ``pack()``; returns how many."""
    count = 0
    for module in model.modules():
        pack = getattr(module, "pack", None)
        if callable(pack):
            pack(_pack)
            count += 1
    return count
