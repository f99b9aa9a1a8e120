"""The "cpu" kernel ops (C) against the reference arithmetic, and the C KV write.

Tolerances: the new residual (an add in the activation dtype) and RoPE (each
product and sum rounded where the reference rounds) are exact. RMSNorm sums its
squares in another order and silu uses its own exp, so they may differ from the
reference in the last place: float32 by ``1e-5`` relative, bfloat16 by one bf16
step (``1e-2`` relative).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kernels import cpu_ops, reference, select_kernels
from pdserve.kernels.attention import AttentionMetadata, select_backend, torch_ref
from pdserve.kernels.cpu_ops import CpuKernels, library

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

if library() is None:
    pytest.skip("no C compiler: the cpu kernel ops are unavailable", allow_module_level=True)


class _NoFallback:
    """Stands in for the reference module inside ``cpu_ops``: any fallback fails."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the C op fell back to reference.{name}")


@pytest.fixture
def c_only(monkeypatch):
    """The test's inputs must take the C path: ``cpu_ops`` cannot reach the reference."""
    monkeypatch.setattr(cpu_ops, "reference", _NoFallback())


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOL[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (
        (got.float() - want.float()).abs().max()
    )


def _rows(tokens: int, width: int, dtype: torch.dtype, gen: torch.Generator, strided: bool):
    """[tokens, width] values; ``strided``: a view whose rows are further apart."""
    pad = 5 if strided else 0
    full = torch.randn(tokens, width + pad, generator=gen).to(dtype)
    return full[:, :width]


def test_auto_picks_the_c_ops_on_the_cpu() -> None:
    assert select_kernels("auto", CPU).name == "cpu"
    assert isinstance(select_kernels("cpu", CPU), CpuKernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width"), [(1, 512), (37, 200), (3, 33)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.usefixtures("c_only")
def test_rms_norm_residual(dtype, tokens: int, width: int, strided: bool, with_residual: bool):
    gen = torch.Generator().manual_seed(tokens * width)
    x = _rows(tokens, width, dtype, gen, strided)
    residual = _rows(tokens, width, dtype, gen, not strided) if with_residual else None
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    got_out, got_res = CpuKernels().rms_norm_residual(x, residual, weight, 1e-5)
    want_out, want_res = reference.rms_norm_residual(x, residual, weight, 1e-5)
    _close(got_out, want_out)
    assert torch.equal(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (9, 1100), (4, 7)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.usefixtures("c_only")
def test_silu_and_mul(dtype, tokens: int, inter: int, strided: bool) -> None:
    gen = torch.Generator().manual_seed(tokens + inter)
    gate_up = 4 * _rows(tokens, 2 * inter, dtype, gen, strided)
    _close(CpuKernels().silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (6, 3, 12), (3, 1, 10)])
@pytest.mark.usefixtures("c_only")
def test_rotate_is_the_reference_exactly(dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    tokens = 7
    # q and k as the model has them: a strided view of the fused qkv output.
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    x = qkv[:, : heads + kv_heads]
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert torch.equal(CpuKernels().rotate(x, cos, sin), reference.rotate(x, cos, sin))


def test_other_dtypes_and_layouts_run_as_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    ops = CpuKernels()
    half = torch.randn(3, 16, generator=gen).half()
    assert torch.equal(ops.silu_and_mul(half), reference.silu_and_mul(half))
    three_d = torch.randn(2, 3, 16, generator=gen)
    assert torch.equal(ops.silu_and_mul(three_d), reference.silu_and_mul(three_d))
    columns = torch.randn(16, 4, generator=gen).t()  # last dimension not contiguous
    weight = torch.ones(16)
    got, _ = ops.rms_norm_residual(columns, None, weight, 1e-6)
    assert torch.equal(got, reference.rms_norm_residual(columns, None, weight, 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_c_kv_write_fills_the_slots_like_the_reference(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens = 4, 2, 12, 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided tokens
    slots = torch.tensor([3, 17, 0, 40, 41], dtype=torch.int64)
    want = [torch.zeros(6, 8, kv_heads, dim, dtype=dtype) for _ in range(2)]
    got = [c.clone() for c in want]
    torch_ref.write_kv(k, v, want[0], want[1], slots)
    backend = select_backend("cpu", CPU)(heads, kv_heads, dim, dim**-0.5)
    backend.write_kv(k, v, got[0], got[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _decode_meta(tables: torch.Tensor, lens: list[int], slots: torch.Tensor) -> AttentionMetadata:
    """A step of one decode token per sequence: context ``lens``, new tokens at ``slots``."""
    return AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=len(lens),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32),
        decode_block_tables=tables,
        max_decode_seq_len=max(lens),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        prefill_query_lens_list=[],
        prefill_seq_lens_list=[],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (6, 3, 12)])
def test_decode_only_step_writes_and_attends_like_the_reference(
    dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """The one-call decode step: caches and outputs as the torch backend's forward."""
    gen = torch.Generator().manual_seed(heads + head_dim)
    block, lens = 16, [40, 1, 17]
    tables = torch.randperm(12, generator=gen, dtype=torch.int32).view(3, 4)
    slots = torch.tensor(
        [int(tables[i, (n - 1) // block]) * block + (n - 1) % block for i, n in enumerate(lens)]
    )
    qkv = torch.randn(3, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split_with_sizes([heads, kv_heads, kv_heads], 1)  # strided views
    meta = _decode_meta(tables, lens, slots)
    caches = [torch.randn(12, block, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv"]
    want_caches = [c.clone() for c in caches]
    backends = [
        select_backend(n, CPU)(heads, kv_heads, head_dim, head_dim**-0.5) for n in ("cpu", "torch")
    ]
    got = backends[0].forward(q, k, v, caches[0], caches[1], meta)
    want = backends[1].forward(q, k, v, want_caches[0], want_caches[1], meta)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    assert torch.allclose(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (6, 3, 12), (3, 1, 10)])
def test_decode_step_with_rope_is_the_reference_rotation_then_the_step(
    dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """RoPE inside the one-call decode step: k cached as the reference rotates it, and
    the output that of the C step on the reference's rotated q, bit for bit."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    block, lens = 16, [40, 1, 17]
    tables = torch.randperm(12, generator=gen, dtype=torch.int32).view(3, 4)
    slots = torch.tensor(
        [int(tables[i, (n - 1) // block]) * block + (n - 1) % block for i, n in enumerate(lens)]
    )
    qkv = torch.randn(3, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(3, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [torch.randn(12, block, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv"]
    want_caches = [c.clone() for c in caches]
    q, k = reference.rotate(qkv[:, : heads + kv_heads], cos, sin).split_with_sizes(
        [heads, kv_heads], 1
    )
    backend = select_backend("cpu", CPU)(heads, kv_heads, head_dim, head_dim**-0.5)
    meta = _decode_meta(tables, lens, slots)
    want = backend.forward(q, k, qkv[:, heads + kv_heads :], *want_caches, meta)
    flat = qkv.flatten(1).clone()  # [T, (Hq + 2 * Hkv) * D], as the projection gives it
    got = backend.forward_rope(flat, cos, sin, caches[0], caches[1], meta)
    assert got is not None and torch.equal(got, want.flatten(1))
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    # A step with prefill chunks is not fused: the caller rotates and calls forward.
    mixed = replace(meta, prefill_query_lens_list=[2], prefill_seq_lens_list=[2], derived={})
    assert backend.forward_rope(flat, cos, sin, caches[0], caches[1], mixed) is None
