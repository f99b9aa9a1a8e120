"""pdserve's greedy tokens equal transformers' for every supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.core.model_config import ModelConfig
from tests.reference import MAX_NEW_TOKENS, hf_greedy, parity_prompts

FAMILIES = ["llama", "llama_untied", "qwen2", "mixtral"]
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(name: str, references) -> None:
    folder, prompts, reference = references(name)
    # A 64-token step budget splits the long prompts into chunks.
    llm = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    llm.engine.assert_idle()

    # Again: the prompts' full blocks are now in the prefix cache.
    hits_before = llm.engine.kv.stats.hits
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.kv.stats.hits > hits_before
    llm.engine.assert_idle()


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_greedy_matches_transformers_under_preemption(name: str, references) -> None:
    folder, prompts, reference = references(name)
    # 24 blocks of 16 tokens hold ~a third of the batch: requests get preempted
    # and recomputed, and must still produce the same tokens.
    llm = LLM(str(folder), num_blocks=24, block_size=16, max_num_batched_tokens=128)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.assert_idle()


def test_prefix_cache_off_gives_same_tokens(references) -> None:
    folder, prompts, reference = references("qwen2")
    llm = LLM(str(folder), enable_prefix_caching=False, max_num_batched_tokens=32)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.kv.stats.hits == 0
    llm.engine.assert_idle()


def test_builtin_tiny_matches_transformers(tiny_path: Path) -> None:
    llm = LLM("builtin:tiny")
    prompts = ["Hello, world!", "The router sees the whole cluster.", "What is a block table?"]
    token_prompts = [llm.tokenizer.encode(p) for p in prompts]
    reference = hf_greedy(tiny_path, token_prompts, max_new_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert _tokens(outputs) == reference
    for out, ref in zip(outputs, reference, strict=True):
        assert out.outputs[0].text == llm.tokenizer.decode(ref)
    llm.engine.assert_idle()


def test_bfloat16_logits_track_float32_reference(reference_models) -> None:
    """bf16 is not bit-exact; its next-token logits stay close to the fp32 reference."""
    from transformers import AutoModelForCausalLM

    from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan

    folder = reference_models("llama")
    prompt = parity_prompts(ModelConfig.from_dir(folder).vocab_size)[2]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    llm = LLM(str(folder), dtype="bfloat16")
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    assert runner.kv_cache.dtype == torch.bfloat16
    plan = StepPlan(
        1, [ScheduledSeq("r", prompt, 0, list(range(-(-len(prompt) // 16))), RowSampling())]
    )
    with torch.no_grad():
        batch = runner.prepare(plan)
        hidden, _ = runner.model(batch.input_ids, batch.positions, runner.caches, batch.meta)
        logits = runner.model.compute_logits(hidden[batch.sample_indices])[0]
    scale = ref.abs().max()
    assert (logits - ref).abs().max() < 0.05 * scale
    assert torch.topk(logits, 5).indices[0] in torch.topk(ref, 5).indices
