"""Weight-only quantization of the dense linear layers, applied after loading.

:func:`quantize_linears` replaces the float weight ``W [out, in]`` of every dense
linear (attention qkv and o, MLP gate_up and down) by integers and float scales,
symmetric (no zero point):

- "int8": one scale per output row::

    scale[o] = max_i |W[o, i]| / 127        q[o, i] = round(W[o, i] / scale[o])  in [-127, 127]
    y = x @ (q * scale[:, None]).T  ==  (x @ q.T) * scale

- "int4": one scale per row and group of ``INT4_GROUP`` input columns,
  ``scale = max |W| / 7`` over the group, ``q = round(W / scale)`` in [-8, 7],
  two values a byte.

The float weight is freed: an int8 linear holds a quarter of its float32 bytes
(plus 4 a row), an int4 linear an eighth (plus a scale a group). Embeddings, the
LM head, norms and MoE experts stay in the model dtype. The matmul is chosen
once per runner from the scheme and the kernel backend (:func:`select_path`):

- "torch" (CPU): ``torch._weight_int8pack_mm`` / ``torch._weight_int4pack_mm_for_cpu``
  on activations rounded to bfloat16, accumulated in float32 inside the op. Their
  float32 and float16 inputs take unvectorised code (10-40x slower than a float32
  matmul on the test machine), so they are not offered. int8 scales are applied
  in float32 after the op; int4 scales go in as bfloat16.
- "triton": :mod:`~pdserve.kernels.int8_linear` and
  :mod:`~pdserve.kernels.int4_linear` (CUDA, or the CPU interpreter):
  activations in their own dtype, weights dequantized in registers, float32
  accumulation.

A path is used only after it matches the dequantized reference on a probe and
accepts every linear's shape; otherwise building the runner fails with an error
naming ``quantization`` and the model is left as loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

# (x [T, in], the stored tensors) -> [T, out] in x's dtype
QuantMatmul = Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]

_INT8_MAX = 127
_INT4_MAX = 7
INT4_GROUP = 32  # input columns per int4 scale; the CPU op takes 32, 64, 128 or 256
# ``torch._weight_int8pack_mm`` reads input rows in blocks of 16 and crashes the
# process on other sizes, so its wrapper checks first.
_CPU_INT8_IN_MULTIPLE = 16
_CPU_INT4_OUT_MULTIPLE = 16
# Largest probe error allowed, relative to the reference's largest entry: above
# bfloat16 rounding of the activations, far below a wrong result.
_PROBE_TOLERANCE = 2e-2


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (q [out, in] int8, scale [out] float32), symmetric per row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / _INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [out, in] int8, scale [out]) -> W [out, in] float32: the weight the model computes with."""
    return q.float() * scale.float()[:, None]


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q [out, in] int8 in [-8, 7], scale [out, in / INT4_GROUP] float32)."""
    out, inp = weight.shape
    w = weight.detach().float().reshape(out, inp // INT4_GROUP, INT4_GROUP)
    scale = w.abs().amax(dim=2) / _INT4_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, :, None]).clamp(-_INT4_MAX - 1, _INT4_MAX).to(torch.int8)
    return q.reshape(out, inp), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [out, in], scale [out, in / INT4_GROUP]) -> W [out, in] float32."""
    out, inp = q.shape
    groups = q.float().reshape(out, inp // INT4_GROUP, INT4_GROUP) * scale.float()[:, :, None]
    return groups.reshape(out, inp)


def cpu_int8pack_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``torch._weight_int8pack_mm`` with bfloat16 activations and float32 scaling after."""
    if q.shape[1] % _CPU_INT8_IN_MULTIPLE:
        raise ValueError(f"input size {q.shape[1]} is not a multiple of {_CPU_INT8_IN_MULTIPLE}")
    unit = torch.ones(q.shape[0], dtype=torch.bfloat16, device=x.device)
    y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q, unit)
    return (y.float() * scale).to(x.dtype)


def _cpu_int4_prepare(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """W -> (packed [out, in / 2] uint8 in the op's layout, scales_and_zeros [in / G, out, 2] bf16)."""
    q, scale = quantize_int4(weight)
    packed = torch._convert_weight_to_int4pack_for_cpu((q + 8).to(torch.int32), 1)
    scales_and_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1)
    return packed, scales_and_zeros.to(torch.bfloat16).contiguous()


def _cpu_int4_matmul(x: torch.Tensor, stored: tuple[torch.Tensor, ...]) -> torch.Tensor:
    packed, scales_and_zeros = stored
    xb = x.to(torch.bfloat16).contiguous()
    return torch._weight_int4pack_mm_for_cpu(xb, packed, INT4_GROUP, scales_and_zeros).to(x.dtype)


def _triton_int8_matmul(x: torch.Tensor, stored: tuple[torch.Tensor, ...]) -> torch.Tensor:
    from pdserve.kernels.int8_linear import int8_linear

    return int8_linear(x, *stored)


def _triton_int4_prepare(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from pdserve.kernels.int4_linear import pack_int4

    q, scale = quantize_int4(weight)
    return pack_int4(q), scale


def _triton_int4_matmul(x: torch.Tensor, stored: tuple[torch.Tensor, ...]) -> torch.Tensor:
    from pdserve.kernels.int4_linear import int4_linear

    packed, scale = stored
    return int4_linear(x, packed, scale, INT4_GROUP)


def _int8_fake(weight: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize_weight(weight))


def _int4_fake(weight: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(weight))


def _multiple(what: str, size: int, of: int) -> str | None:
    return None if size % of == 0 else f"{what} {size} is not a multiple of {of}"


@dataclass(frozen=True)
class QuantPath:
    """One way to run a scheme's linears: how a weight is stored, multiplied, and checked."""

    scheme: str
    backend: str
    prepare: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # W [out, in] -> stored
    matmul: QuantMatmul
    fake: Callable[[torch.Tensor], torch.Tensor]  # W -> the float weight it computes with
    check: Callable[[int, int], str | None]  # (out, in) -> why it cannot take that shape


def _cpu_int8_matmul(x: torch.Tensor, stored: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return cpu_int8pack_matmul(x, *stored)


def _cpu_int8_check(out: int, inp: int) -> str | None:
    return _multiple("input size", inp, _CPU_INT8_IN_MULTIPLE)


def _cpu_int4_check(out: int, inp: int) -> str | None:
    return _multiple("input size", inp, INT4_GROUP) or _multiple(
        "output size", out, _CPU_INT4_OUT_MULTIPLE
    )


def _triton_int8_check(out: int, inp: int) -> str | None:
    return None


def _triton_int4_check(out: int, inp: int) -> str | None:
    return _multiple("input size", inp, 2 * INT4_GROUP)  # two halves of whole groups


# The paths by (scheme, kernel backend registry name).
QUANT_PATHS = {
    ("int8", "torch"): QuantPath(
        "int8", "torch", quantize_weight, _cpu_int8_matmul, _int8_fake, _cpu_int8_check
    ),
    ("int8", "triton"): QuantPath(
        "int8", "triton", quantize_weight, _triton_int8_matmul, _int8_fake, _triton_int8_check
    ),
    ("int4", "torch"): QuantPath(
        "int4", "torch", _cpu_int4_prepare, _cpu_int4_matmul, _int4_fake, _cpu_int4_check
    ),
    ("int4", "triton"): QuantPath(
        "int4", "triton", _triton_int4_prepare, _triton_int4_matmul, _int4_fake, _triton_int4_check
    ),
}
# The "cpu" kernels (C row-wise ops) multiply as the torch ones do.
QUANT_PATHS.update({(scheme, "cpu"): QUANT_PATHS[scheme, "torch"] for scheme in ("int8", "int4")})


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear's weight, quantized: what ``_Linear`` holds instead of its float weight."""

    # The path's stored form, e.g. (q [out, in] int8, scale [out] float32) for int8.
    tensors: tuple[torch.Tensor, ...]
    matmul: QuantMatmul

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        y = self.matmul(x, self.tensors)
        return y if bias is None else y + bias


def _probe(path: QuantPath, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``path`` cannot serve ``dtype`` activations on ``device``, or None if it can."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen)
    x = torch.randn(5, 128, generator=gen).to(device=device, dtype=dtype)
    try:
        stored = tuple(t.to(device) for t in path.prepare(w))
        got = path.matmul(x, stored).float()
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    want = F.linear(x.float(), path.fake(w).to(device))
    err = float((got - want).abs().max())
    if not err <= _PROBE_TOLERANCE * float(want.abs().max()):
        return f"its result differs from the dequantized reference by {err:.3g} on a probe"
    return None


def select_path(
    scheme: str, kernel_backend: str, device: torch.device, dtype: torch.dtype
) -> QuantPath:
    """The path of ``scheme`` on ``kernel_backend`` (a resolved name) if it runs here, else an error."""
    path = QUANT_PATHS.get((scheme, kernel_backend))
    problem = _probe(path, device, dtype) if path else f"no {scheme} matmul for these kernels"
    if problem is not None or path is None:
        raise InvalidArgumentError(
            "quantization",
            f"{scheme} cannot run on {device.type} with {dtype} activations and kernel_backend "
            f"{kernel_backend!r} ({problem}); it runs with the torch kernels on the CPU and "
            f"the triton kernels on CUDA, or use quantization none",
        )
    return path


class QuantizableLinear(Protocol):
    """A layer whose float weight ``[out, in]`` can be swapped for a :class:`QuantizedWeight`."""

    weight: torch.Tensor

    def quantize(self, make: Callable[[torch.Tensor], QuantizedWeight]) -> None: ...


def quantizable(module: nn.Module) -> bool:
    """Whether ``module`` is a :class:`QuantizableLinear`. Not ``isinstance`` on the
    protocol: from Python 3.12 that looks attributes up statically, and a module's
    ``weight`` lives in its parameters, so it would find none and quantize nothing."""
    return callable(getattr(module, "quantize", None)) and isinstance(
        getattr(module, "weight", None), torch.Tensor
    )


def quantize_linears(model: nn.Module, path: QuantPath) -> int:
    """Quantize every :class:`QuantizableLinear` of ``model``; returns how many.

    Checks every layer first: a model the path cannot take is left untouched.
    """
    layers: list[QuantizableLinear] = [m for m in model.modules() if quantizable(m)]  # type: ignore[misc]
    if not layers:
        raise InvalidArgumentError("quantization", f"{path.scheme}: the model has no linear layer")
    for layer in layers:
        out, inp = layer.weight.shape
        problem = path.check(out, inp)
        if problem is not None:
            raise InvalidArgumentError(
                "quantization",
                f"{path.scheme} with the {path.backend} kernels cannot take "
                f"{type(layer).__name__} [{out}, {inp}]: {problem} "
                f"(use another kernel_backend or quantization)",
            )

    def make(w: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(tuple(t.to(w.device) for t in path.prepare(w)), path.matmul)

    for layer in layers:
        layer.quantize(make)
    logger.info("%s: quantized %d linears (%s kernels)", path.scheme, len(layers), path.backend)
    return len(layers)


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: parameters and the packed or quantized copies of linears."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        held = getattr(module, "held_tensors", None)
        if callable(held):
            total += sum(t.numel() * t.element_size() for t in held())
    return total
