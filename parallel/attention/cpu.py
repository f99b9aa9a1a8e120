"""Paged attention tuned for CPUs: decode in a small C kernel, prefill as the reference.

The torch reference gathers every decode sequence's blocks into a padded copy
each layer and step; on a CPU that copy costs more than the attention itself.
``cpu_kernel.c`` reads each key and value row once, in place, through the block
table. It is compiled with the system C compiler on first use (about a second)
and cached next to the built-in models; without a compiler the ``cpu`` backend
reports itself unsupported and ``auto`` falls back to ``torch``.

The kernel reads a float32 or a bfloat16 cache (bf16 rows are widened to
float32 as they are loaded; every sum is float32). With bfloat16 it rounds the
softmax weights to bf16 before they weight V, as torch's CPU flash attention
(what ``transformers`` runs) does, so greedy tokens track it; float32 is unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve.core.builtin_models import cache_dir
from pdserve.parallel.attention.backend import AttentionMetadata, register_backend
from pdserve.parallel.attention.torch_ref import TorchAttention
from pdserve.parallel.cpu_features import cpu_model

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernel.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def kernel_library() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None if it cannot be built."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the cpu attention backend is unavailable")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + cpu_model().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_decode_{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            logger.warning("building the cpu attention kernel failed:\n%s", proc.stderr)
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    )
    return lib


@register_backend
class CpuAttention(TorchAttention):
    """Decode through the C kernel; prefill (and its cached prefix) as the reference."""

    name = "cpu"

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return device.type == "cpu" and kernel_library() is not None

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        # q, out: [Nd, Hq, D]; caches [num_blocks, bs, Hkv, D] (contiguous)
        if q.dtype not in _DTYPE_CODES:
            super().decode(q, k_cache, v_cache, meta, out)
            return
        lib = kernel_library()
        assert lib is not None
        q = q.contiguous()
        tables = meta.decode_block_tables.contiguous()
        lens = meta.decode_seq_lens.contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()
        failed = lib.paged_decode_attention(
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            q.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            k_cache.shape[1],
            tables.shape[1],
            self.scale,
            _DTYPE_CODES[q.dtype],
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("cpu attention kernel could not allocate its scratch memory")
