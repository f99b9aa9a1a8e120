"""The Triton int8 and int4 matmuls against torch, and the engine on them against ``transformers``.

Without a GPU the kernel runs in Triton's CPU interpreter: ``TRITON_INTERPRET``
must be set before any kernel module is imported, so it is set here, at
collection (as in ``test_kernels``). Shapes are small because the interpreter is slow.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.core.model_config import ModelConfig
from pdserve.models.quant import (
    INT4_GROUP,
    QUANT_PATHS,
    dequantize,
    dequantize_int4,
    quantize_int4,
    quantize_weight,
    select_path,
)
from tests.kernels.triton_check import triton_problem
from tests.models.test_quant import fake_quantized
from tests.reference import hf_greedy, parity_prompts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


_PROBLEM = triton_problem(DEVICE)
if _PROBLEM is not None:
    pytest.skip(_PROBLEM, allow_module_level=True)

from pdserve.kernels.int4_linear import (  # noqa: E402 (after the skip: imports Triton)
    int4_linear,
    pack_int4,
    unpack_int4,
)
from pdserve.kernels.int8_linear import int8_linear  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "out", "inp"), [(1, 64, 64), (5, 100, 72), (16, 48, 130), (33, 130, 40), (0, 8, 16)]
)
def test_int8_linear_matches_dequantized_torch(
    dtype: torch.dtype, rows: int, out: int, inp: int
) -> None:
    gen = torch.Generator().manual_seed(rows + out + inp)
    q, scale = quantize_weight(torch.randn(out, inp, generator=gen))
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    q, scale, x = q.to(DEVICE), scale.to(DEVICE), x.to(DEVICE)
    got = int8_linear(x, q, scale)
    assert got.dtype == dtype and got.shape == (rows, out)
    want = F.linear(x.double(), dequantize(q, scale).double())
    if rows:
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < TOL[dtype]


def test_int8_linear_takes_strided_activations() -> None:
    q, scale = quantize_weight(torch.randn(32, 48))
    wide = torch.randn(6, 96, device=DEVICE)
    x = wide[:, ::2]  # last dimension not contiguous
    want = F.linear(x, dequantize(q, scale).to(DEVICE))
    torch.testing.assert_close(int8_linear(x, q.to(DEVICE), scale.to(DEVICE)), want)


def test_int8_linear_rejects_float_weights() -> None:
    with pytest.raises(ValueError, match="qweight must be int8"):
        int8_linear(
            torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE), torch.ones(4)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "out", "inp"), [(1, 64, 64), (5, 100, 128), (16, 48, 192), (33, 130, 64), (0, 8, 64)]
)
def test_int4_linear_matches_dequantized_torch(
    dtype: torch.dtype, rows: int, out: int, inp: int
) -> None:
    gen = torch.Generator().manual_seed(rows + out + inp)
    q, scale = quantize_int4(torch.randn(out, inp, generator=gen))
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    packed, scale, x = pack_int4(q).to(DEVICE), scale.to(DEVICE), x.to(DEVICE)
    got = int4_linear(x, packed, scale, INT4_GROUP)
    assert got.dtype == dtype and got.shape == (rows, out)
    want = F.linear(x.double(), dequantize_int4(q.to(DEVICE), scale).double())
    if rows:
        assert (got.double() - want).abs().max() / want.abs().max() < TOL[dtype]


def test_int4_linear_rejects_halves_of_partial_groups() -> None:
    q, scale = quantize_int4(torch.randn(8, 32))
    with pytest.raises(ValueError, match="whole groups of 32"):
        int4_linear(torch.randn(2, 32, device=DEVICE), pack_int4(q), scale, INT4_GROUP)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_triton_paths_are_selected(scheme: str) -> None:
    path = select_path(scheme, "triton", DEVICE, torch.float32)
    assert path is QUANT_PATHS[scheme, "triton"]
    assert path.check(130, 64) is None


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_engine_on_triton_matches_transformers_exactly(
    scheme: str, reference_models, tmp_path: Path
) -> None:
    """float32 activations and accumulation: the same greedy tokens as the dequantized model."""
    from pdserve import LLM, SamplingParams

    folder = reference_models("qwen2")  # biases on q, k, v
    prompts = parity_prompts(ModelConfig.from_dir(folder).vocab_size)
    prompts = [prompts[6], prompts[5], prompts[0][:40]]
    max_tokens = 4
    reference = hf_greedy(fake_quantized(folder, tmp_path / "fq", scheme), prompts, max_tokens)
    llm = LLM(
        str(folder),
        kernel_backend="triton",
        device=DEVICE.type,
        dtype="float32",
        quantization=scheme,
        block_size=16,
        max_num_batched_tokens=32,
    )
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    qkv = runner.model.layers[0].attn.qkv
    assert qkv.quantized is not None, (type(qkv), runner.config.quantization, qkv.weight.shape)
    assert qkv.quantized.matmul is QUANT_PATHS[scheme, "triton"].matmul
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    llm.engine.assert_idle()
