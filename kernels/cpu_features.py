"""What this CPU computes natively, and the dtype it runs fastest in.

bfloat16 halves the bytes every decode step reads (weights and KV), but it is
only fast where the CPU multiplies bf16 itself: AVX-512 BF16 (``avx512_bf16``,
Zen 4, Cooper Lake, Sapphire Rapids) or AMX (``amx_bf16``). Elsewhere torch
emulates it, correct but slower than float32. The flags come from
``/proc/cpuinfo`` (Linux); where it cannot be read the answer is "no".

``dtype: auto`` still takes the checkpoint's dtype on every device, so a
float32 checkpoint serves in float32 unless the config asks for bfloat16;
:func:`fastest_cpu_dtype` is what ``pdserve bench offline`` defaults to.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), or the platform's processor string."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where unknown)."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def fastest_cpu_dtype() -> str:
    """The fastest dtype that tracks float32 here: bfloat16 where native, else float32."""
    return "bfloat16" if has_native_bf16() else "float32"


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> bool:
    """Log a warning when bfloat16 runs on a CPU without it; True if it warned."""
    if device.type != "cpu" or dtype != torch.bfloat16 or has_native_bf16():
        return False
    logger.warning(
        "dtype bfloat16 on a CPU without AVX-512 BF16 or AMX (%s): torch emulates it, "
        "so it runs correctly but slower than float32; use dtype float32 here",
        cpu_model() or "unknown CPU",
    )
    return True
