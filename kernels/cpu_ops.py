"""The "cpu" kernel ops: the row-wise fused ops as small C kernels (``cpu_ops.c``).

At decode batch sizes each reference op is a handful of tiny torch ops (a bf16
RMSNorm is eight, each with its own dispatch and allocation), and their sum
outweighs the matmuls around them. Here RMSNorm with its residual add, RoPE and
silu-and-mul are one C call each, computing the reference arithmetic of
:mod:`~pdserve.kernels.reference` to the rounding (see ``cpu_ops.c``).
The MoE router and any other dtype or layout run as the reference. The library
is built on first use (:mod:`~pdserve.kernels.cpu_build`); without a C
compiler these ops report themselves unsupported and "auto" picks "torch".
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.kernels import reference
from pdserve.kernels.cpu_build import compile_library, declare
from pdserve.kernels.ops import register_kernels
from pdserve.kernels.torch_ops import TorchKernels

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Library:
    """The compiled ops, declared once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.rms_norm_residual = declare(
            lib, "rms_norm_residual", [_P, _P, _P, _I, _P, _I, _P, _I, _I, _F, _C, _C]
        )
        self.rotate = declare(lib, "rotate", [_P, _P, _I, _P, _P, _I, _I, _I, _C, _C])
        self.silu_and_mul = declare(lib, "silu_and_mul", [_P, _P, _I, _I, _I, _C, _C])


@functools.cache
def library() -> _Library | None:
    """The ops, built on first use; None where they cannot be built."""
    lib = compile_library(Path(__file__).with_name("cpu_ops.c"), "cpu_ops")
    return None if lib is None else _Library(lib)


def _rows_ok(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> bool:
    """[T, H] rows with a contiguous last dimension and a contiguous [H] weight, on the CPU."""
    # Ordered cheapest first (is_contiguous() before stride()); a decode step makes
    # this check 17 times.
    shape = x.shape
    return (
        len(shape) == 2
        and (r is x or r.shape == shape)
        and x.is_cpu
        and weight.is_contiguous()
        and weight.shape == shape[1:]
        and (x.is_contiguous() or x.stride(1) == 1)
        and (r is x or r.is_contiguous() or r.stride(1) == 1)
    )


@register_kernels
class CpuKernels(TorchKernels):
    """The torch ops with RMSNorm, RoPE and silu-and-mul in C."""

    name = "cpu"

    def __init__(self) -> None:
        lib = library()
        assert lib is not None, "CpuKernels built where cpu_ops.c does not compile"
        self.lib = lib

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return device.type == "cpu" and library() is not None

    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H] (rows may be strided); weight [H] -> out, x + residual [T, H]
        code = _DTYPE_CODES.get(x.dtype)
        r = x if residual is None else residual
        if code is None or not _rows_ok(x, r, weight) or not r.dtype == x.dtype == weight.dtype:
            return reference.rms_norm_residual(x, residual, weight, eps)
        rows, width = x.shape
        out = x.new_empty(rows, width)
        if residual is None:
            res_out, res_ptr, r_ptr = x, None, None
        else:
            res_out = x.new_empty(rows, width)  # two allocations cost less than one unbind
            res_ptr, r_ptr = res_out.data_ptr(), r.data_ptr()
        self.lib.rms_norm_residual(
            out.data_ptr(),
            res_ptr,
            x.data_ptr(),
            x.stride(0),
            r_ptr,
            r.stride(0),
            weight.data_ptr(),
            rows,
            width,
            eps,
            code,
            torch.get_num_threads(),
        )
        return out, res_out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [T, 2 * I] -> [T, I]
        code = _DTYPE_CODES.get(gate_up.dtype)
        shape = gate_up.shape
        if (
            code is None
            or len(shape) != 2
            or shape[1] % 2
            or not gate_up.is_cpu
            or not (gate_up.is_contiguous() or gate_up.stride(1) == 1)
        ):
            return reference.silu_and_mul(gate_up)
        rows, inter = shape[0], shape[1] // 2
        out = gate_up.new_empty(rows, inter)
        self.lib.silu_and_mul(
            out.data_ptr(),
            gate_up.data_ptr(),
            gate_up.stride(0),
            rows,
            inter,
            code,
            torch.get_num_threads(),
        )
        return out

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D] (tokens may be strided, heads packed); cos/sin [T, 1, D / 2] -> [T, H, D]
        code = _DTYPE_CODES.get(x.dtype)
        tokens, heads, dim = x.shape
        stride = x.stride()
        if (
            code is None
            or stride[2] != 1
            or stride[1] != dim
            or dim % 2
            or not x.is_cpu
            or cos.dtype != x.dtype
            or sin.dtype != x.dtype
            or cos.shape != (tokens, 1, dim // 2)
            or sin.shape != cos.shape
        ):
            return reference.rotate(x, cos, sin)
        cos, sin = cos.contiguous(), sin.contiguous()
        out = x.new_empty(tokens, heads, dim)
        self.lib.rotate(
            out.data_ptr(),
            x.data_ptr(),
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            dim,
            code,
            torch.get_num_threads(),
        )
        return out
