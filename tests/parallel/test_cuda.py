"""The CUDA paths: run where torch.cuda.is_available(), skipped elsewhere (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.reference import MAX_NEW_TOKENS

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP needs 2 GPUs")
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


@needs_cuda
@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral"])
def test_cuda_greedy_matches_transformers(references, name: str) -> None:
    folder, prompts, reference = references(name)
    llm = LLM(str(folder), device="cuda", dtype="float32", max_num_batched_tokens=64)
    assert llm.engine is not None and llm.engine.executor.runner.device.type == "cuda"  # type: ignore[attr-defined]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
    llm.check_idle()


@needs_cuda
def test_cuda_bfloat16_generates(reference_models) -> None:
    folder = reference_models("llama")
    llm = LLM(str(folder), device="cuda", dtype="bfloat16")
    out = llm.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == MAX_NEW_TOKENS
    llm.check_idle()


@needs_two_gpus
def test_nccl_tensor_parallel_matches_transformers(ray_session, references) -> None:
    folder, prompts, reference = references("llama")
    llm = LLM(
        str(folder), device="cuda", dtype="float32", tensor_parallel_size=2, num_gpus_per_rank=1
    )
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
        llm.check_idle()
    finally:
        llm.shutdown()
