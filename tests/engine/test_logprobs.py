"""Logprobs of generated tokens against transformers' log-softmax of its own logits:
one rank, with speculative drafts (verified rows), sampled rows, and two pipeline
stages (the sampler rank sends them to the leader)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.core.errors import InvalidArgumentError
from tests.engine.speculation import SPEC

K = 3  # alternatives asked for per token
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=K)


def _hf_logprobs(folder, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token after each prefix of ``output``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].log_softmax(-1)


def _check(folder, prompt: list[int], out) -> None:  # type: ignore[no-untyped-def]
    want = _hf_logprobs(folder, prompt, out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for i, (token, (value, top)) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert value == pytest.approx(want[i, token].item(), abs=1e-4), i
        best = want[i].topk(K)
        assert [t for t, _ in top] == best.indices.tolist(), i
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4), i


def test_greedy_and_sampled_logprobs_match_transformers(references) -> None:
    folder, prompts, _ = references("llama")
    llm = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    greedy = llm.generate(prompts[:4], GREEDY)
    for prompt, o in zip(prompts, greedy, strict=False):
        _check(folder, prompt, o.outputs[0])
        assert all(
            top[0][0] == t
            for t, (_, top) in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
        )
    sampled = SamplingParams(max_tokens=10, temperature=1.5, seed=4, ignore_eos=True, logprobs=0)
    (o,) = llm.generate(prompts[:1], sampled)
    assert all(top == [] for _, top in o.outputs[0].logprobs)  # logprobs=0: the token's own
    want = _hf_logprobs(folder, prompts[0], o.outputs[0].token_ids)
    got = [v for v, _ in o.outputs[0].logprobs]
    assert got == pytest.approx(
        [want[i, t].item() for i, t in enumerate(o.outputs[0].token_ids)], abs=1e-4
    )
    (plain,) = llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0))
    assert plain.outputs[0].logprobs is None
    llm.check_idle()


def test_verified_drafts_have_the_logprobs_of_one_token_steps(references) -> None:
    folder, prompts, _ = references("llama")
    spec = LLM(str(folder), max_num_batched_tokens=64, block_size=16, **SPEC)
    repetitive = [p[:12] * 3 for p in prompts[:4]]
    outs = spec.generate(repetitive, GREEDY)
    assert spec.engine.scheduler.spec.stats.accepted > 0  # some rows verified drafts
    for prompt, o in zip(repetitive, outs, strict=True):
        _check(folder, prompt, o.outputs[0])
    spec.check_idle()


def test_two_pipeline_stages_send_the_logprobs_to_the_leader(ray_session, references) -> None:
    folder, prompts, _ = references("llama")
    llm = LLM(
        str(folder), pipeline_parallel_size=2, num_cpus_per_rank=0.5, max_num_batched_tokens=64
    )
    try:
        outs = llm.generate(prompts[:3], GREEDY)
        for prompt, o in zip(prompts, outs, strict=False):
            _check(folder, prompt, o.outputs[0])
        llm.check_idle()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert e.value.field == field
