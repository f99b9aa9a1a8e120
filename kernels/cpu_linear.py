"""Pre-packed float32 and bfloat16 matmuls for CPUs (oneDNN), used by the parallel linear layers.

At decode batch sizes (8-64 rows) ``F.linear`` runs MKL's generic GEMM at about
100 GFLOP/s on the test machines; oneDNN with the weight reordered once into its
blocked layout reaches about 140-150. :func:`pack_linears` reorders every dense
linear of a model after loading; the packed copy replaces the plain weight, so
memory does not double. It uses the oneDNN ops that ``torch.compile`` itself
emits on CPU; where they are missing or disagree with ``F.linear`` on a probe,
nothing is packed and the layers keep ``F.linear``. bfloat16 weights are packed
only where the CPU has bf16 natively (:mod:`~pdserve.kernels.cpu_features`):
oneDNN then multiplies bf16 with float32 accumulation, rounding the output once.

At one to eight rows (decode at batch 1-8) a linear only streams its weight, and
oneDNN spends about 10 us per call before it starts; where the bf16 C GEMV is
built (:mod:`~pdserve.kernels.cpu_gemv`) a bf16 layer also keeps its
plain ``[out, in]`` weight, which the GEMV streams at the read bandwidth, and
:func:`packed_linear` picks by row count. Those layers hold their weight twice
(``PDSERVE_CPU_GEMV=0`` keeps one copy and oneDNN at every row count).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_gemv
from pdserve.kernels.cpu_features import has_native_bf16

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


class PackedWeight:
    """A dense linear's weight packed for this CPU; replaces the layer's plain weight.

    ``onednn``: oneDNN's blocked copy, for any row count. ``plain``: the
    ``[out, in]`` bf16 weight the C GEMV reads at up to ``cpu_gemv.MAX_ROWS`` rows,
    kept where the GEMV is built; None elsewhere and for float32.
    """

    __slots__ = ("onednn", "plain")

    def __init__(self, onednn: torch.Tensor, plain: torch.Tensor | None) -> None:
        self.onednn = onednn
        self.plain = plain

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the weight holds in memory."""
        return (self.onednn,) if self.plain is None else (self.onednn, self.plain)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [T, in] in the weight's dtype; packed: the weight [out, in] -> [T, out]
    plain = packed.plain
    if plain is not None and cpu_gemv.fits(x, plain, bias):
        return cpu_gemv.gemv_bf16(x, plain, bias)
    return _LINEAR_POINTWISE(x, packed.onednn, bias, "none", [], "")


def duplicate_bytes(model: nn.Module) -> int:
    """Bytes of the plain weight copies kept beside oneDNN's (a step reads one of the two)."""
    total = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, PackedWeight) and packed.plain is not None:
            total += packed.plain.nbytes
    return total


def _pack(weight: torch.Tensor) -> PackedWeight:
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    if weight.dtype != torch.bfloat16 or not cpu_gemv.available():
        return PackedWeight(onednn, None)
    return PackedWeight(onednn, weight.contiguous())


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
        got = _LINEAR_POINTWISE(x, _pack(w).onednn, None, "none", [], "")
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
