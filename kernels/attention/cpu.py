"""Paged attention tuned for CPUs: decode in a small C kernel, prefill as the reference.

The torch reference gathers every decode sequence's blocks into a padded copy
each layer and step; on a CPU that copy costs more than the attention itself.
``cpu_kernel.c`` reads each key and value row once, in place, through the block
table. It is compiled with the system C compiler on first use
(:mod:`~pdserve.kernels.cpu_build`); without a compiler the ``cpu`` backend
reports itself unsupported and ``auto`` falls back to ``torch``.

The kernel reads a float32 or a bfloat16 cache (bf16 rows are widened to
float32 as they are loaded, or multiplied pairwise by the AVX-512 BF16 dot
product where the CPU has it; every sum is float32). With bfloat16 it rounds the
softmax weights to bf16 before they weight V, as torch's CPU flash attention
(what ``transformers`` runs) does, so greedy tokens track it; float32 is unchanged.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import cast

import torch

from pdserve.kernels.attention.backend import AttentionMetadata, register_backend
from pdserve.kernels.attention.torch_ref import TorchAttention
from pdserve.kernels.cpu_build import compile_library, declare

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Kernels:
    """The compiled kernel's two entry points, declared once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.decode = declare(
            lib, "paged_decode_attention", [_P, _P, _I, *[_P] * 4, *[_I] * 6, _F, _C, _C]
        )
        self.write_kv = declare(lib, "write_kv", [_P, _P, _P, _I, _P, _I, _P, _I, _I, _C])
        self.decode_step = declare(
            lib, "paged_decode_step", [_P, _P, _I, _P, _I, _P, _I, *[_P] * 5, *[_I] * 6, _F, _C, _C]
        )
        self.decode_rope_step = declare(
            lib, "paged_decode_rope_step", [_P, _P, _I, *[_P] * 7, *[_I] * 6, _F, _C, _C]
        )


@functools.cache
def kernel_library() -> _Kernels | None:
    """The compiled kernel, building it on first use; None if it cannot be built."""
    lib = compile_library(Path(__file__).with_name("cpu_kernel.c"), "paged_decode")
    return None if lib is None else _Kernels(lib)


def _heads_packed(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads and dims are contiguous (tokens may be strided)."""
    stride = x.stride()
    return stride[2] == 1 and stride[1] == x.shape[2]


@register_backend
class CpuAttention(TorchAttention):
    """Decode through the C kernel; prefill (and its cached prefix) as the reference.

    The K/V write is C too; a step of decodes only writes and attends in one call,
    with the layer's RoPE in it too where the model asks (``forward_rope``).
    """

    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        lib = kernel_library()
        assert lib is not None, "CpuAttention built where cpu_kernel.c does not compile"
        self.lib = lib
        # The output of the last fused decode step, reused by the next one of the same
        # shape and dtype: the model reads it only in the o_proj right after.
        self._out = torch.empty(0)

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return device.type == "cpu" and kernel_library() is not None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """As every backend's; a decode-only step writes K/V and attends in one C call."""
        # q: [T, Hq, D], k/v: [T, Hkv, D] (tokens may be strided) -> out: [T, Hq, D]
        step = _decode_step_args(meta)
        code = None if step is None else self._code(k, v, k_cache, v_cache, meta.slot_mapping)
        if step is None or code is None or not _heads_packed(q):
            return super().forward(q, k, v, k_cache, v_cache, meta)
        out = q.new_empty(q.shape)
        slots, tables, lens, max_blocks = step
        failed = self.lib.decode_step(
            out.data_ptr(),
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            slots,
            *self._cache_args(k_cache, v_cache, tables, lens, q.shape[0], max_blocks, code),
        )
        if failed:
            raise MemoryError("cpu attention kernel could not allocate its scratch memory")
        return out

    def forward_rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        # qkv: [T, (Hq + 2 * Hkv) * D] (tokens may be strided), cos/sin [T, 1, D / 2]
        # -> [T, Hq * D]
        step = _decode_step_args(meta)
        code = _DTYPE_CODES.get(qkv.dtype)
        d = self.head_dim
        if (
            step is None
            or code is None
            or qkv.shape[1] != (self.num_heads + 2 * self.num_kv_heads) * d
            or not (qkv.is_contiguous() or qkv.stride(1) == 1)
            or not cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == qkv.dtype
            or not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape)
            or cos.shape != (qkv.shape[0], 1, d // 2)
            or d % 2
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            return None
        out = self._out
        if out.shape != (qkv.shape[0], self.num_heads * d) or out.dtype != qkv.dtype:
            out = self._out = qkv.new_empty(qkv.shape[0], self.num_heads * d)
        slots, tables, lens, max_blocks = step
        failed = self.lib.decode_rope_step(
            out.data_ptr(),
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            slots,
            *self._cache_args(k_cache, v_cache, tables, lens, qkv.shape[0], max_blocks, code),
        )
        if failed:
            raise MemoryError("cpu attention kernel could not allocate its scratch memory")
        return out

    def _cache_args(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: int,
        lens: int,
        rows: int,
        max_blocks: int,
        code: int,
    ) -> tuple[int | float, ...]:
        """The arguments every attending entry point of the kernel ends with: the caches,
        the block tables and sequence lengths (pointers), the shapes, the scale, the dtype
        code and the threads."""
        return (
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables,
            lens,
            rows,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            k_cache.shape[1],
            max_blocks,
            self.scale,
            code,
            torch.get_num_threads(),
        )

    @staticmethod
    def _code(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> int | None:
        """The kernel's dtype code if it can write k, v into the caches, else None."""
        code = _DTYPE_CODES.get(k.dtype)
        if (
            code is None
            or not k_cache.dtype == v_cache.dtype == v.dtype == k.dtype
            or not (_heads_packed(k) and _heads_packed(v))
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or not (slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())
        ):
            return None
        return code

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # k, v: [T, Hkv, D] (tokens may be strided); caches [num_blocks, bs, Hkv, D]
        code = self._code(k, v, k_cache, v_cache, slot_mapping)
        if code is None:
            super().write_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        self.lib.write_kv(
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            slot_mapping.data_ptr(),
            k.shape[0],
            k.shape[1] * k.shape[2],
            code,
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        # q: [Nd, Hq, D] (sequences may be strided), out: [Nd, Hq, D];
        # caches [num_blocks, bs, Hkv, D] (contiguous)
        if q.dtype not in _DTYPE_CODES:
            super().decode(q, k_cache, v_cache, meta, out)
            return
        if not _heads_packed(q):
            q = q.contiguous()
        tables = meta.decode_block_tables.contiguous()
        lens = meta.decode_seq_lens.contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()
        failed = self.lib.decode(
            out.data_ptr(),
            q.data_ptr(),
            q.stride(0),
            *self._cache_args(
                k_cache,
                v_cache,
                tables.data_ptr(),
                lens.data_ptr(),
                q.shape[0],
                tables.shape[1],
                _DTYPE_CODES[q.dtype],
            ),
        )
        if failed:
            raise MemoryError("cpu attention kernel could not allocate its scratch memory")


def _decode_step_args(meta: AttentionMetadata) -> tuple[int, int, int, int] | None:
    """(slots, block tables, seq lens pointers, max blocks) of a step of decodes only
    (None for any other), worked out by the step's first layer for all of them."""
    key = CpuAttention.name
    if key not in meta.derived:
        tables, lens, slots = meta.decode_block_tables, meta.decode_seq_lens, meta.slot_mapping
        decodes_only = not meta.num_prefills and slots.shape[0] == meta.num_decode_tokens
        args = None
        if decodes_only and slots.dtype == torch.int64 and slots.is_contiguous() and slots.is_cpu:
            # The tables stay alive on meta: the contiguous copies (if any) must too.
            tables, lens = tables.contiguous(), lens.contiguous()
            meta.derived[f"{key}.held"] = (tables, lens)
            args = (slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1])
        meta.derived[key] = args
    return cast("tuple[int, int, int, int] | None", meta.derived[key])
