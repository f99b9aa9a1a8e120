"""Prompt logprobs against transformers' log-softmax of its own logits: every prompt
token after the first, over chunked prompts, a prompt whose blocks are cached (the
prompt is computed in full anyway) and requests preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams

K = 3
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=K)


def _hf(folder, prompts: list[list[int]]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out.append(model(ids, attention_mask=torch.ones_like(ids)).logits[0].log_softmax(-1))
    return out


def _check(want: torch.Tensor, prompt: list[int], got) -> None:  # type: ignore[no-untyped-def]
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        value, top = got[j]
        assert value == pytest.approx(want[j - 1, prompt[j]].item(), abs=1e-4), j
        best = want[j - 1].topk(K)
        assert [t for t, _ in top] == best.indices.tolist(), j
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4), j


def test_prompt_logprobs_match_transformers_chunked_and_cached(references) -> None:
    folder, prompts, _ = references("llama")
    chosen = prompts[:6]  # four share a 70-token prefix; chunks of at most 64 tokens
    want = _hf(folder, chosen)
    llm = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    for _ in range(2):  # the second time the prompts' blocks are in the prefix cache
        outs = llm.generate(chosen, PARAMS)
        for w, prompt, o in zip(want, chosen, outs, strict=True):
            _check(w, prompt, o.prompt_logprobs)
    (plain,) = llm.generate(chosen[:1], SamplingParams(max_tokens=2, temperature=0))
    assert plain.prompt_logprobs is None and plain.metrics.num_cached_prompt_tokens > 0
    llm.check_idle()


def test_preempted_requests_keep_one_entry_per_prompt_token(references) -> None:
    folder, prompts, _ = references("llama")
    want = _hf(folder, prompts)
    tight = LLM(str(folder), num_blocks=24, block_size=16, max_num_batched_tokens=128)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=K)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for w, prompt, o in zip(want, prompts, outs, strict=True):
        _check(w, prompt, o.prompt_logprobs)
    tight.check_idle()
