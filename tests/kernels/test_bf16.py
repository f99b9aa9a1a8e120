"""bfloat16 on the CPU: feature detection, the C kernel's bf16 cache, greedy parity.

bf16 is not bit-exact against ``transformers`` the way float32 is: GEMMs split
their sums differently, chunked prefill attends over a cached prefix where
``transformers`` attends in one pass, and one rounding may flip a near-tie. The
greedy checks here therefore bound the agreement instead of demanding equality;
the float32 parity tests (``test_parity.py``) stay exact.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.core.model_config import ModelConfig
from pdserve.kernels import cpu_features
from pdserve.kernels.attention import select_backend
from pdserve.kernels.attention.backend import AttentionMetadata
from pdserve.kernels.cpu_linear import packing_available
from tests.reference import MAX_NEW_TOKENS, hf_greedy, parity_prompts

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


def test_native_bf16_is_read_from_the_flags() -> None:
    assert cpu_features.has_native_bf16(frozenset({"avx512f", "avx512_bf16"}))
    assert cpu_features.has_native_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not cpu_features.has_native_bf16(frozenset({"avx512f", "avx2"}))
    assert not cpu_features.has_native_bf16(frozenset())
    expected = "bfloat16" if cpu_features.has_native_bf16() else "float32"
    assert cpu_features.fastest_cpu_dtype() == expected


def test_emulated_bf16_warns_and_still_runs(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not packing_available(CPU, torch.bfloat16)  # no oneDNN bf16 packing either
    assert not cpu_features.warn_if_emulated(torch.float32, CPU)
    with caplog.at_level(logging.WARNING, logger=cpu_features.__name__):
        llm = LLM("builtin:tiny", dtype="bfloat16")
    assert any("slower than float32" in r.getMessage() for r in caplog.records)
    out = llm.generate(["Hello, world!"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.engine.assert_idle()


def _decode_meta(lens: list[int], block: int, num_blocks: int) -> AttentionMetadata:
    gen = torch.Generator().manual_seed(1)
    width = -(-max(lens) // block)
    tables = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)[: len(lens) * width]
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        num_decode_tokens=len(lens),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32),
        decode_block_tables=tables.view(len(lens), width).contiguous(),
        max_decode_seq_len=max(lens),
        prefill_query_start_loc=empty,
        prefill_seq_lens=empty,
        prefill_block_tables=empty.view(0, 1),
        prefill_query_lens_list=[],
        prefill_seq_lens_list=[],
    )


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (6, 3, 12)])
def test_cpu_kernel_reads_a_bf16_cache_like_torch(heads: int, kv_heads: int, head_dim: int) -> None:
    """Long bf16 contexts (past torch's 512-key split): the kernel within a bf16 step of sdpa."""
    cpu = select_backend("cpu", CPU)(heads, kv_heads, head_dim, head_dim**-0.5)
    ref = select_backend("torch", CPU)(heads, kv_heads, head_dim, head_dim**-0.5)
    gen = torch.Generator().manual_seed(0)
    block, lens = 16, [700, 1, 333]
    num_blocks = len(lens) * -(-max(lens) // block)
    # k/v caches: [num_blocks, block, Hkv, D] bf16; q: [3, Hq, D]
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(len(lens), heads, head_dim, generator=gen).bfloat16()
    meta = _decode_meta(lens, block, num_blocks)
    got, want = torch.empty_like(q), torch.empty_like(q)
    cpu.decode(q, k_cache, v_cache, meta, got)
    ref.decode(q, k_cache, v_cache, meta, want)
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def _matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.mark.parametrize("name", ["llama", "llama_untied"])
def test_bf16_greedy_tracks_transformers_bf16(name: str, reference_models) -> None:
    """Measured here (Zen 4, AVX-512 BF16): 10/10 and 9/10 prompts equal over 12 tokens,
    the other one for its first 6 (a 260-token prompt in 64-token chunks)."""
    folder = reference_models(name)
    prompts = parity_prompts(ModelConfig.from_dir(folder).vocab_size)
    reference = hf_greedy(folder, prompts, dtype=torch.bfloat16)
    llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=64, block_size=16)
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    assert runner.kv_cache.dtype == torch.bfloat16
    assert runner.model.lm_head.weight.dtype == torch.bfloat16
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    prefixes = [_matching_prefix(a, b) for a, b in zip(tokens, reference, strict=True)]
    assert min(prefixes) >= 4, prefixes
    assert sum(p == MAX_NEW_TOKENS for p in prefixes) >= len(prompts) - 1, prefixes
    llm.engine.assert_idle()


def test_bench_offline_defaults_to_the_fastest_native_dtype() -> None:
    import argparse

    from pdserve.bench import offline

    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    args = parser.parse_args([])
    assert args.dtype == cpu_features.fastest_cpu_dtype()
    assert args.repeats == 1
