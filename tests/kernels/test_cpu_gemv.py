"""The bf16 C GEMV (decode linears of 1-8 rows) against ``F.linear`` in float32.

The kernel sums float32 products of bf16 values (exact) in its own order and
rounds the output once to bf16, so each output is within one bf16 step of the
float32 reference. Where the packed linears claim the C path (bf16, at most
``MAX_ROWS`` rows) the oneDNN path is made unreachable.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.distributed.context import SINGLE_RANK
from pdserve.kernels import cpu_gemv, cpu_linear
from pdserve.kernels.cpu_linear import pack_linears, packed_linear, packing_available
from pdserve.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

CPU = torch.device("cpu")

if not cpu_gemv.available():
    pytest.skip(
        "no AVX-512 BF16 or no C compiler: the C GEMV is not built", allow_module_level=True
    )

# (out, in): the builtin:small linears, then odd sizes (ragged row blocks and k tails).
SHAPES = [(1024, 512), (2816, 512), (512, 1408), (1209, 512), (5, 7), (33, 95), (1, 1), (67, 31)]


@pytest.fixture
def c_only(monkeypatch):
    """Anything but the C GEMV fails: the oneDNN path of ``cpu_linear``."""

    def fail(*args: object) -> torch.Tensor:
        raise AssertionError("the bf16 linear left the C GEMV")

    monkeypatch.setattr(cpu_linear, "_LINEAR_POINTWISE", fail)


def _operands(rows: int, out: int, inner: int, bias: bool, strided: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner + (3 if strided else 0), generator=gen).bfloat16()[:, :inner]
    w = (torch.randn(out, inner, generator=gen) / inner**0.5).bfloat16()
    b = torch.randn(out, generator=gen).bfloat16() if bias else None
    return x, w, b


def _within_one_step(got: torch.Tensor, x, w, b) -> None:
    """``got`` (bf16) within one bf16 step of the float32 ``F.linear`` at every output."""
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # One bf16 step at |want|: 2^(exponent - 7); float32 sums in another order add
    # a few float32 steps of the sum of magnitudes, far below it but for cancellations.
    _, exponent = torch.frexp(want.abs().clamp_min(2.0**-120))
    step = torch.ldexp(torch.ones_like(want), exponent - 8)
    slack = 1e-6 * F.linear(x.float().abs(), w.float().abs())
    err = (got.float() - want).abs()
    assert bool((err <= step + slack).all()), (err / (step + slack)).max()


@pytest.mark.parametrize(("out", "inner"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("bias", "strided"), [(False, False), (True, True)])
def test_gemv_matches_float32_linear(out: int, inner: int, rows: int, bias, strided) -> None:
    x, w, b = _operands(rows, out, inner, bias, strided, seed=out * inner + rows)
    assert cpu_gemv.fits(x, w, b)
    _within_one_step(cpu_gemv.gemv_bf16(x, w, b), x, w, b)


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_the_thread_split_does_not_change_the_result(rows: int) -> None:
    x, w, b = _operands(rows, 1209, 512, True, False, seed=rows)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_gemv.gemv_bf16(x, w, b)
        torch.set_num_threads(max(2, threads))
        split = cpu_gemv.gemv_bf16(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split)


def test_fits_refuses_what_the_kernel_does_not_take() -> None:
    x, w, _ = _operands(cpu_gemv.MAX_ROWS + 1, 16, 32, False, False, seed=0)
    assert not cpu_gemv.fits(x, w, None)  # too many rows
    assert not cpu_gemv.fits(x[:4].float(), w, None)  # float32 rows
    assert not cpu_gemv.fits(x[:4, :16], w, None)  # inner size differs
    assert not cpu_gemv.fits(x[:4].t().contiguous().t(), w, None)  # strided columns
    assert cpu_gemv.fits(x[:-1], w, None)


def test_bf16_packing_keeps_a_plain_weight_for_the_gemv() -> None:
    assert packing_available(CPU, torch.bfloat16)
    layer = ColumnParallelLinear(48, [40, 40], True, SINGLE_RANK, torch.bfloat16)
    assert pack_linears(layer) == 1
    assert layer.packed is not None and layer.packed.plain is not None
    assert layer.packed.plain.shape == (80, 48) and layer.weight.numel() == 0
    assert layer.held_tensors() == (layer.packed.onednn, layer.packed.plain)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.usefixtures("c_only")
def test_packed_layers_take_the_gemv_at_decode_rows(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    column = ColumnParallelLinear(96, [40, 24], True, SINGLE_RANK, torch.bfloat16)
    row = RowParallelLinear(64, 96, False, SINGLE_RANK, torch.bfloat16)
    head = ParallelLMHead(77, 96, SINGLE_RANK, torch.bfloat16)
    for layer in (column, row, head):
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=gen).bfloat16()
    weights = [(column.weight.data.clone(), column.bias), (row.weight.data.clone(), None)]
    head_weight = head.weight.data.clone()
    assert pack_linears(column) + pack_linears(row) + pack_linears(head) == 3
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    h = column(x)
    _within_one_step(h, x, *weights[0])
    y = torch.randn(rows, 64, generator=gen).bfloat16()
    _within_one_step(row(y), y, *weights[1])
    _within_one_step(head.compute_logits(x), x, head_weight, None)


@pytest.mark.parametrize("rows", [9, 33])
def test_more_rows_than_the_gemv_takes_use_onednn(rows: int) -> None:
    x, w, b = _operands(rows, 200, 96, True, False, seed=rows)
    packed = cpu_linear._pack(w)
    got = packed_linear(x, packed, b)
    _within_one_step(got, x, w, b)


def test_switched_off_a_layer_keeps_one_copy(monkeypatch) -> None:
    w = torch.randn(64, 32).to(torch.bfloat16)
    assert cpu_linear._pack(w).plain is not None
    monkeypatch.setenv(cpu_gemv.ENV_SWITCH, "0")
    packed = cpu_linear._pack(w)
    assert packed.plain is None and len(packed.tensors) == 1
