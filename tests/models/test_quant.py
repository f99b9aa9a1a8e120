"""Weight-only int8 and int4: the arithmetic, the layers, the engine option, and its errors.

The engine's greedy tokens are checked against ``transformers`` running a
checkpoint whose dense linears were quantized and dequantized the same way
(``fake_quantized``): the model pdserve computes with, in float32.
"""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.core.config import build_engine_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.deploy.cli import main as cli_main
from pdserve.distributed.context import SINGLE_RANK
from pdserve.models.layers import ColumnParallelLinear, RowParallelLinear
from pdserve.models.quant import (
    INT4_GROUP,
    QUANT_PATHS,
    cpu_int8pack_matmul,
    dequantize,
    dequantize_int4,
    quantizable,
    quantize_int4,
    quantize_linears,
    quantize_weight,
    select_path,
    weights_bytes,
)
from tests.reference import parity_prompts

CPU = torch.device("cpu")
_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quantized(folder: Path, out: Path, scheme: str = "int8") -> Path:
    """A copy of the checkpoint in ``folder`` with every dense linear quantized-dequantized."""
    fake = QUANT_PATHS[scheme, "torch"].fake
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in _DENSE:
                module.weight.copy_(fake(module.weight))
    model.save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / file, out / file)
    return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_quantize_round_trip_is_within_half_a_step() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    w[3] = 0  # an all-zero row
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (96,) and scale.dtype == torch.float32
    assert int(q.abs().max()) <= 127
    assert torch.equal(q[3], torch.zeros_like(q[3]))
    assert ((dequantize(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    # The largest entry of each row maps to +-127 exactly.
    assert torch.equal(
        q.abs().amax(1)[w.abs().amax(1) > 0], torch.full((95,), 127, dtype=torch.int8)
    )


def test_int4_round_trip_is_within_half_a_step_of_each_group() -> None:
    w = torch.randn(32, 4 * INT4_GROUP, generator=torch.Generator().manual_seed(0))
    w[0, :INT4_GROUP] = 0  # an all-zero group
    q, scale = quantize_int4(w)
    assert q.shape == w.shape and scale.shape == (32, 4)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.equal(q[0, :INT4_GROUP], torch.zeros_like(q[0, :INT4_GROUP]))
    step = scale.repeat_interleave(INT4_GROUP, dim=1)
    assert ((dequantize_int4(q, scale) - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_cpu_matmul_matches_dequantized_reference(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_weight(torch.randn(80, 48, generator=gen))
    x = torch.randn(rows, 48, generator=gen).to(dtype)
    got = cpu_int8pack_matmul(x, q, scale)
    assert got.dtype == dtype and got.shape == (rows, 80)
    # Activations are rounded to bfloat16 on this path.
    assert _relative_error(got, F.linear(x.double(), dequantize(q, scale).double())) < 1e-2


def test_cpu_matmul_refuses_input_sizes_it_cannot_take() -> None:
    q, scale = quantize_weight(torch.randn(8, 40))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_int8pack_matmul(torch.randn(2, 40), q, scale)


def _linears() -> tuple[ColumnParallelLinear, RowParallelLinear]:
    torch.manual_seed(0)
    col = ColumnParallelLinear(64, [48, 48], True, SINGLE_RANK, torch.float32)
    row = RowParallelLinear(96, 64, False, SINGLE_RANK, torch.float32)
    for p in (*col.parameters(), *row.parameters()):
        p.data.normal_()
    return col, row


def test_cpu_int4_matmul_matches_dequantized_reference() -> None:
    path = QUANT_PATHS["int4", "torch"]
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 128)
    got = path.matmul(x, path.prepare(w))
    assert _relative_error(got, F.linear(x.double(), path.fake(w).double())) < 1e-2


# Bytes of the stored form of a [out, in] weight, by scheme (CPU path).
_STORED_BYTES = {
    "int8": lambda out, inp: out * inp + 4 * out,
    "int4": lambda out, inp: out * inp // 2 + 2 * 2 * out * (inp // INT4_GROUP),
}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_layers_compute_with_the_dequantized_weight(scheme: str) -> None:
    path = QUANT_PATHS[scheme, "torch"]
    col, row = _linears()
    wants = []
    for layer, inp in ((col, torch.randn(7, 64)), (row, torch.randn(7, 96))):
        wants.append((inp, F.linear(inp, path.fake(layer.weight.data), layer.bias)))
    model = torch.nn.ModuleList([col, row])
    float_bytes = weights_bytes(model)
    assert quantize_linears(model, path) == 2
    assert col.weight.numel() == 0 and row.weight.numel() == 0  # the float weights are freed
    for layer, (inp, want) in zip((col, row), wants, strict=True):
        assert _relative_error(layer(inp), want) < 1e-2
    bias_bytes = 96 * 4
    stored = _STORED_BYTES[scheme](96, 64) + _STORED_BYTES[scheme](64, 96)
    assert weights_bytes(model) == stored + bias_bytes < float_bytes


def test_linears_are_found_where_a_static_lookup_finds_no_weight() -> None:
    """From Python 3.12, isinstance on a protocol looks attributes up statically and
    misses a module's ``weight`` (a parameter): the layers must be found without it."""
    col, row = _linears()
    assert inspect.getattr_static(col, "weight", None) is None
    assert quantizable(col) and quantizable(row)
    assert not quantizable(torch.nn.Linear(4, 4))  # no quantize()
    with pytest.raises(InvalidArgumentError, match="no linear layer"):
        quantize_linears(torch.nn.Sequential(torch.nn.ReLU()), QUANT_PATHS["int8", "torch"])


@pytest.mark.parametrize(
    ("scheme", "shape", "problem"),
    [
        ("int8", (16, 40), "input size 40 is not a multiple of 16"),
        ("int4", (40, 64), "output size 40 is not a multiple of 16"),
        ("int4", (16, 48), "input size 48 is not a multiple of 32"),
    ],
)
def test_a_model_the_cpu_path_cannot_take_is_refused_untouched(
    scheme: str, shape: tuple[int, int], problem: str
) -> None:
    out, inp = shape
    row = RowParallelLinear(inp, out, False, SINGLE_RANK, torch.float32)
    row.weight.data.normal_()
    with pytest.raises(InvalidArgumentError) as err:
        quantize_linears(row, QUANT_PATHS[scheme, "torch"])
    assert err.value.field == "quantization"
    assert f"cannot take RowParallelLinear [{out}, {inp}]: {problem}" in str(err.value)
    assert row.quantized is None and row.weight.shape == (out, inp)


def test_paths_that_cannot_run_are_refused_naming_quantization() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        select_path("int8", "no-such-kernels", CPU, torch.float32)
    assert err.value.field == "quantization"
    assert "int8 cannot run on cpu" in str(err.value)
    for scheme in ("int8", "int4"):
        assert select_path(scheme, "torch", CPU, torch.float32) is QUANT_PATHS[scheme, "torch"]


@pytest.mark.parametrize("value", ["int2", "INT8", "", None, 8])
def test_bad_quantization_values_are_rejected_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        build_engine_config("builtin:tiny", quantization=value)
    assert err.value.field == "quantization"
    assert build_engine_config("builtin:tiny", quantization="int8").quantization == "int8"


def test_cli_flag_reaches_the_config_and_bad_values_exit_2(capsys) -> None:
    assert cli_main(["generate", "--quantization", "fp4", "--max-tokens", "1"]) == 2
    assert "quantization: must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cpu_engine_tracks_transformers_on_the_dequantized_checkpoint(
    scheme: str, reference_models, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU path rounds activations to bfloat16: its logits track, like a bfloat16 model's.

    Exact greedy parity is checked on the float32 Triton path (``test_quant_kernels``).
    """
    from transformers import AutoModelForCausalLM

    from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan

    folder = reference_models("llama")
    prompt = parity_prompts(ModelConfig.from_dir(folder).vocab_size)[2]
    hf = AutoModelForCausalLM.from_pretrained(
        fake_quantized(folder, tmp_path / "fq", scheme)
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    float_llm = LLM(str(folder), device="cpu", dtype="float32")
    with caplog.at_level(logging.INFO, logger="pdserve.parallel.model_runner"):
        llm = LLM(str(folder), device="cpu", dtype="float32", quantization=scheme)
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    float_runner = float_llm.engine.executor.runner  # type: ignore[attr-defined]
    assert runner.weights_bytes < float_runner.weights_bytes
    assert f"weights: {runner.weights_bytes} bytes (quantization {scheme})" in caplog.text
    plan = StepPlan(
        1, [ScheduledSeq("r", prompt, 0, list(range(-(-len(prompt) // 16))), RowSampling())]
    )
    with torch.no_grad():
        batch = runner.prepare(plan)
        hidden, _ = runner.model(batch.input_ids, batch.positions, runner.caches, batch.meta)
        logits = runner.model.compute_logits(hidden[batch.sample_indices])[0]
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
    assert torch.topk(logits, 5).indices[0] in torch.topk(ref, 5).indices
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(llm.generate([prompt], greedy)[0].outputs[0].token_ids) == 4
    llm.engine.assert_idle()
