"""logit_bias moves the choice as the OpenAI API defines it: a bias added to a token's
logit before sampling. The engine's raw logprobs (checked against transformers in
test_logprobs.py) say what the model prefers without it."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.errors import InvalidArgumentError


def test_a_bias_moves_greedy_choices_and_leaves_the_logprobs(references) -> None:
    folder, prompts, _ = references("llama")
    llm = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    (base,) = llm.generate(prompts[:1], plain)
    first, (_, top) = base.outputs[0].token_ids[0], base.outputs[0].logprobs[0]
    assert top[0][0] == first
    # the model's first choice pushed down: its second becomes the first token
    down = SamplingParams(max_tokens=1, temperature=0, logit_bias={first: -100}, logprobs=2)
    (out,) = llm.generate(prompts[:1], down)
    assert out.outputs[0].token_ids == [top[1][0]]
    raw = out.outputs[0].logprobs[0][1]  # the logprobs are the raw, unbiased ones
    assert [t for t, _ in raw] == [t for t, _ in top]
    assert [v for _, v in raw] == pytest.approx([v for _, v in top], abs=1e-6)
    # a token pushed up wins every step, sampled or greedy, next to unbiased rows
    up = SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True, logit_bias={7: 100})
    outs = llm.generate([prompts[0]] * 3, [up, plain, up])
    assert outs[0].outputs[0].token_ids == [7] * 5 == outs[2].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == base.outputs[0].token_ids
    llm.check_idle()


@pytest.mark.parametrize(
    ("bias", "why"),
    [
        ({1: 101}, "biases must be in [-100, 100]"),
        ({-1: 1}, "token ids must be in"),
        ({1: float("nan")}, "finite"),
        ({"1": 1}, "must be an integer"),
        ({i: 1 for i in range(301)}, "at most 300"),
        ("x", "must map token ids"),
        ([(7, 1), (7, 2)], "more than once"),
    ],
)
def test_bad_biases_are_refused_by_name(bias, why) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias)
    assert why in str(e.value)
    with pytest.raises(InvalidArgumentError, match="not a token of this model"):
        SamplingParams(logit_bias={500: 1}).check_vocab(100)
