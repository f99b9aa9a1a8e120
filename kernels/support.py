"""Where the Triton kernels can run, and the launch settings they share.

Triton decides when a kernel is *decorated* whether it compiles for the GPU or
runs in its CPU interpreter (``TRITON_INTERPRET=1``): :data:`INTERPRETED` records
which one this process got, so every kernel module imported with this one agrees.
The interpreter keeps bfloat16 as raw 16-bit integers and cannot multiply them
in ``tl.dot``; :func:`dot_settings` makes the attention kernels upcast there. It
also rounds float32 to bfloat16 by truncation (a GPU rounds to nearest even), so
its bfloat16 results may differ from a GPU's by one unit in the last place.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _probe(x_ptr):
    tl.store(x_ptr, 0)


INTERPRETED: bool = not isinstance(_probe, triton.runtime.JITFunction)

# Elements one program of a row-wise kernel should touch: enough to hide
# latency on a GPU, few enough to stay in registers.
_ROW_TILE_ELEMENTS = 4096

# Output tiles of the quantized linear kernels: rows (tokens) and columns.
_LINEAR_MIN_BLOCK_M = 16  # ``tl.dot`` needs at least 16 rows; decode batches are padded up
_LINEAR_MAX_BLOCK_M = 64
_LINEAR_BLOCK_N = 64


def launch_check(device: torch.device) -> None:
    """Run a trivial kernel on ``device``: raises whatever keeps Triton from running there."""
    flag = torch.ones(1, dtype=torch.int32, device=device)
    _probe[(1,)](flag)
    if int(flag.item()) != 0:
        raise RuntimeError(f"a Triton kernel launched on {device} did not run")


def runs_on(device: torch.device) -> bool:
    """Whether these kernels can take tensors on ``device`` in this process."""
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and INTERPRETED


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rows_per_program(row_width: int, num_rows: int) -> int:
    """Rows one program of a row-wise kernel takes: several when rows are short."""
    return max(1, min(_ROW_TILE_ELEMENTS // next_pow2(row_width), next_pow2(num_rows)))


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast ``tl.dot`` operands to float32, input precision) for ``dtype`` activations.

    float32 multiplies exactly ("ieee", not TF32) so it matches the torch
    reference; half types use the tensor cores in their own type.
    """
    upcast = INTERPRETED and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 else "tf32"


def linear_launch(
    x: torch.Tensor, n: int, block_k: int
) -> tuple[torch.Tensor, tuple[int, int], dict[str, Any]]:
    """(output, grid, tile settings) of a quantized linear kernel on activations ``x``
    [m, k] with ``n`` outputs, ``block_k`` of the weight's columns a step: the output is
    [m, n] in ``x``'s dtype, left unwritten (there is nothing to launch when it is empty)."""
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = min(_LINEAR_MAX_BLOCK_M, max(_LINEAR_MIN_BLOCK_M, next_pow2(m)))
    upcast, precision = dot_settings(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, _LINEAR_BLOCK_N))
    tiles = {"BLOCK_M": block_m, "BLOCK_N": _LINEAR_BLOCK_N, "BLOCK_K": block_k}
    return out, grid, {**tiles, "UPCAST": upcast, "PRECISION": precision}


def attention_tile(dtype: torch.dtype) -> int:
    """Keys (and prefill queries) per attention tile: float32 tiles take twice the memory."""
    return 64 if dtype in (torch.bfloat16, torch.float16) else 32


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_dtype(*tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        raise TypeError(f"expected one of float32, bfloat16, float16 throughout, got {dtypes}")


def require_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous (strides {t.stride()})")
