"""The CUDA paths: run where torch.cuda.is_available(), skipped elsewhere (CI has no GPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.reference import MAX_NEW_TOKENS

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP needs 2 GPUs")
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


@needs_cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral"])
def test_cuda_greedy_matches_transformers(references, name: str, graphs: bool) -> None:
    """Decode steps replayed from CUDA graphs (the default) and launched eagerly give
    transformers' tokens; with graphs, at least one step was replayed (dense models)."""
    folder, prompts, reference = references(name)
    llm = LLM(
        str(folder), device="cuda", dtype="float32", max_num_batched_tokens=64, cuda_graphs=graphs
    )
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    assert runner.device.type == "cuda"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
    if graphs and name != "mixtral":  # MoE routing syncs with the host: no graphs
        assert runner.graphs is not None and not runner.graphs.broken
        assert runner.graphs.graphs, "no decode step was replayed from a graph"
    else:
        assert runner.graphs is None
    llm.check_idle()


@needs_cuda
def test_cuda_graphs_pad_batches_and_keep_kv_apart(references) -> None:
    """Batches of every size from 1 to 10 (padded to buckets 1, 2, 4, 8, 16), each
    sequence on its own pages: greedy tokens equal the eager engine's."""
    folder, prompts, _ = references("llama")
    runs = []
    for graphs in (True, False):
        llm = LLM(str(folder), device="cuda", dtype="float32", cuda_graphs=graphs)
        runs.append(
            [
                [o.outputs[0].token_ids for o in llm.generate(prompts[:n], GREEDY)]
                for n in range(1, len(prompts) + 1)
            ]
        )
        llm.check_idle()
    assert runs[0] == runs[1]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@needs_cuda
@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral"])
def test_cuda_bfloat16_agrees_with_float32(references, name: str) -> None:
    """bf16 greedy tokens against transformers' float32 ones: how long they agree is a
    figure (written to ``$PDSERVE_GPU_OUT/bf16_agreement.jsonl`` by ``make gpu-check``);
    the test asserts only that most first tokens agree (bf16 may flip a near-tie later)."""
    folder, prompts, reference = references(name)
    llm = LLM(str(folder), device="cuda", dtype="bfloat16")
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    llm.check_idle()
    prefixes = [common_prefix(o, r) for o, r in zip(outs, reference, strict=True)]
    figure = {
        "model": name,
        "prompts": len(prompts),
        "tokens_each": MAX_NEW_TOKENS,
        "identical": sum(p == MAX_NEW_TOKENS for p in prefixes),
        "first_token_agrees": sum(p > 0 for p in prefixes),
        "mean_agreeing_prefix": round(sum(prefixes) / len(prefixes), 2),
    }
    if out := os.environ.get("PDSERVE_GPU_OUT"):
        with open(os.path.join(out, "bf16_agreement.jsonl"), "a") as f:
            f.write(json.dumps(figure) + "\n")
    assert all(len(o) == MAX_NEW_TOKENS for o in outs)
    assert figure["first_token_agrees"] >= len(prompts) / 2, figure


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
