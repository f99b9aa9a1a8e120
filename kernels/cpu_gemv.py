"""bf16 linears of one to eight rows as a C kernel (``cpu_gemv.c``): decode at batch 1-8.

A linear of a few rows reads its whole weight to produce a handful of outputs,
so its time is the weight's bytes over the memory's read bandwidth. oneDNN's
packed kernels (:mod:`~pdserve.kernels.cpu_linear`) are tuned for blocks of
rows and spend about 10 us per call before they read, as long as streaming a
0.5 MiB weight takes; the model's decode-sized linears then run at about two
thirds of the read bandwidth. This kernel costs a few us per call (a ctypes
call) and streams a plain row-major ``[out, in]`` bf16 weight with AVX-512 BF16,
float32 sums and one rounding of the output, as oneDNN does.
It is built where the CPU has AVX-512 BF16 (:func:`available`); elsewhere the
linears keep oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.core.env import env_switch
from pdserve.kernels.cpu_build import compile_library, declare

# The most rows the kernel takes (its accumulators fill the registers); beyond it
# the linears use oneDNN, whose blocked kernels reuse each weight load across rows.
MAX_ROWS = 8
ENV_SWITCH = "PDSERVE_CPU_GEMV"  # "0": no plain weight copies, oneDNN at every row count

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _gemv() -> ctypes._NamedFuncPointer | None:
    lib = compile_library(Path(__file__).with_name("cpu_gemv.c"), "cpu_gemv")
    if lib is None or not declare(lib, "gemv_available", [])():
        return None
    return declare(lib, "gemv_bf16", [_P, _P, _I, _P, _P, _I, _I, _I, ctypes.c_int])


def available() -> bool:
    """True when the kernel is built here (a C compiler and AVX-512 BF16) and not
    switched off (``PDSERVE_CPU_GEMV=0``, ``off``, ``false`` or ``no``: its layers keep
    one weight copy, oneDNN's)."""
    return env_switch(ENV_SWITCH) and _gemv() is not None


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16 x of at most :data:`MAX_ROWS` rows.

    x: [M, in] bf16 with a contiguous last dimension (rows may be strided);
    weight: [out, in] bf16 contiguous; bias: [out] bf16 contiguous or None -> [M, out].
    The caller checks the shapes and dtypes (:func:`fits`); :func:`available` must hold.
    """
    fn = _gemv()
    assert fn is not None, "gemv_bf16 called where cpu_gemv.c is not built"
    rows, inner = x.shape
    out = x.new_empty(rows, weight.shape[0])
    fn(
        out.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        rows,
        weight.shape[0],
        inner,
        torch.get_num_threads(),
    )
    return out


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True when :func:`gemv_bf16` takes these operands (see its shapes)."""
    shape = x.shape
    return (
        len(shape) == 2
        and 0 < shape[0] <= MAX_ROWS
        and x.dtype == torch.bfloat16
        and x.is_cpu
        and shape[1] == weight.shape[1]
        and (x.stride(1) == 1 or shape[1] == 1)
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    )
