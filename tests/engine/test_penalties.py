"""Penalties on repeated tokens: transformers' repetition penalty against its own
``generate``, and OpenAI's presence and frequency penalties against transformers'
logits penalised by their definition, step by step; with speculative drafts the
tokens are those of one-token steps."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan
from pdserve.parallel.penalties import PenaltyState
from tests.engine.speculation import SPEC
from tests.reference import hf_greedy

STEPS = 12
SCHEMA = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'


def _greedy(**penalties: float) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, **penalties)


def _openai_reference(folder, prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy tokens with logit[t] -= frequency * count(t) + presence * (count(t) > 0),
    counting the tokens generated so far, on transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(STEPS):
            ids = torch.tensor([prompt + out])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(logits))
            logits = logits - frequency * counts - presence * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


def test_repetition_penalty_matches_transformers_generate(references) -> None:
    folder, prompts, plain = references("llama")
    llm = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    want = hf_greedy(folder, prompts[:4], STEPS, repetition_penalty=1.8)
    assert want != [p[:STEPS] for p in plain[:4]]  # the penalty changes the reference
    outs = llm.generate(prompts[:4], _greedy(repetition_penalty=1.8))
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.check_idle()


def test_presence_and_frequency_penalties_follow_openai(references) -> None:
    folder, prompts, plain = references("llama")
    llm = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    seen = set()
    for presence, frequency in ((1.5, 0.0), (0.0, 2.0), (-2.0, 0.5)):
        want = _openai_reference(folder, prompts[0], presence, frequency)
        params = _greedy(presence_penalty=presence, frequency_penalty=frequency)
        (got,) = llm.generate(prompts[:1], params)
        assert got.outputs[0].token_ids == want, (presence, frequency)
        seen.add(tuple(want))
    assert plain[0][:STEPS] not in [list(w) for w in seen] and len(seen) == 2
    llm.check_idle()


def test_drafted_rows_get_the_tokens_of_one_token_steps(references) -> None:
    folder, prompts, _ = references("llama")
    repetitive = [p[:12] * 3 for p in prompts[:4]]
    # penalties that favour repeats, so that n-gram drafts get accepted
    params = [
        _greedy(presence_penalty=-2.0, frequency_penalty=0.5, repetition_penalty=0.8),
        SamplingParams(
            max_tokens=STEPS,
            temperature=0.8,
            seed=3,
            ignore_eos=True,
            presence_penalty=-2.0,
            frequency_penalty=0.3,
        ),
    ] * 2
    plain = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    want = [o.outputs[0].token_ids for o in plain.generate(repetitive, params)]
    spec = LLM(str(folder), max_num_batched_tokens=64, block_size=16, **SPEC)
    got = [o.outputs[0].token_ids for o in spec.generate(repetitive, params)]
    assert spec.engine.scheduler.spec.stats.accepted > 0  # some rows verified drafts
    assert got == want
    spec.check_idle()


def test_preempted_rows_start_their_seen_tokens_again(references) -> None:
    """Under a pool too small for the batch, penalised requests are preempted and
    recomputed: the sampling rank drops their seen tokens and is sent them again,
    and the tokens are those of a pool that holds everyone. Nothing is kept after."""
    folder, prompts, _ = references("llama")
    params = [
        _greedy(repetition_penalty=1.3, frequency_penalty=0.4),
        _greedy(presence_penalty=0.7),
        _greedy(),
    ]
    params = [params[i % 3] for i in range(len(prompts))]
    roomy = LLM(str(folder), block_size=16, max_num_batched_tokens=128)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(str(folder), num_blocks=24, block_size=16, max_num_batched_tokens=128)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.scheduler.num_preemptions > 0
    for llm in (roomy, tight):
        llm.engine.assert_idle()
        llm.generate(prompts[:1], _greedy())  # a step that carries the last finished ids
        assert len(llm.engine.executor.runner.sampler.penalties) == 0


def test_two_pipeline_stages_keep_the_seen_tokens_on_the_sampler_rank(
    ray_session, references
) -> None:
    """With two stages the last one samples: the plans carry each row's new tokens
    to it (for penalties and for a JSON schema's matcher), and it gives the one-rank
    engine's tokens."""
    folder, prompts, _ = references("llama")
    params = [
        _greedy(repetition_penalty=1.5),
        _greedy(presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(max_tokens=40, temperature=0, json_schema=SCHEMA),
    ]
    params = [params[i % 3] for i in range(4)]
    one = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    want = [o.outputs[0].token_ids for o in one.generate(prompts[:4], params)]
    llm = LLM(
        str(folder), pipeline_parallel_size=2, num_cpus_per_rank=0.5, max_num_batched_tokens=64
    )
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)] == want
        llm.check_idle()
    finally:
        llm.shutdown()


def test_the_rank_keeps_what_it_was_sent_and_a_plan_run_again_adds_nothing() -> None:
    state = PenaltyState(torch.device("cpu"))
    pen = (0.5, 1.0, 1.3)
    first = [
        RowSampling(penalties=pen, seen=[4, 5, 5], num_seen_prompt=2),
        RowSampling(),
        RowSampling(penalties=pen, seen=[1]),
    ]
    slots = state.advance(first, ["r", "plain", "q"], 8)
    assert slots[1] == -1 and len(state) == 2
    assert _dense(state, [slots[0], slots[2]]) == [
        [0, 0, 0, 0, 1, 2, 0, 0],  # prompt tokens 4 and 5; 5 also generated once
        [0, 2, 0, 0, 0, 0, 0, 0],
    ]
    second = RowSampling(penalties=pen, seen=[6], seen_from=3, num_seen_prompt=2)
    for _ in range(2):  # the same plan twice (run again after an error): counted once
        (slot,) = state.advance([second], ["r"], 8)
        assert _dense(state, [slot]) == [[0, 0, 0, 0, 1, 2, 2, 0]]
    # with drafts 6 and 2 accepted before a position, they count as generated there
    assert _dense(state, [slot], [[6, 2]]) == [[0, 0, 2, 0, 1, 2, 3, 0]]
    gap = RowSampling(penalties=pen, seen=[7], seen_from=9, num_seen_prompt=2)
    with pytest.raises(RuntimeError, match="missing"):
        state.advance([gap], ["r"], 8)
    with pytest.raises(RuntimeError, match="lost"):
        state.advance([second], ["other"], 8)
    state.forget(["r", "q"])
    assert len(state) == 0
    # slots are reused and start empty; more requests than slots grow the tables
    rows = [RowSampling(penalties=pen, seen=[3]) for _ in range(20)]
    slots = state.advance(rows, [f"n{i}" for i in range(20)], 8)
    assert len(set(slots)) == 20 and _dense(state, slots) == [[0, 0, 0, 2, 0, 0, 0, 0]] * 20


def _dense(state: PenaltyState, slots: list[int], drafts: list[list[int]] | None = None) -> list:
    """Per row and token: 0 unseen, 1 seen in the prompt only, 1 + count if generated."""
    out = torch.zeros(len(slots), 8, dtype=torch.long)
    row, token, count = state.seen(slots, drafts)
    out[row, token] = 1 + count.long()
    return out.tolist()


def test_a_plan_carries_the_penalties_to_other_ranks() -> None:
    row = RowSampling(penalties=(0.5, -1.0, 1.3), seen=[4, 5, 4], seen_from=7, num_seen_prompt=1)
    plan = StepPlan(3, [ScheduledSeq("r", [4], 2, [0], row)])
    again = StepPlan.from_msgpack(plan.to_msgpack()).seqs[0].sampling
    assert again is not None
    assert (again.penalties, list(again.seen), again.seen_from, again.num_seen_prompt) == (
        (0.5, -1.0, 1.3),
        [4, 5, 4],
        7,
        1,
    )


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("frequency_penalty", float("nan"), "finite"),
        ("presence_penalty", "1", "a number"),
        ("repetition_penalty", 0, "(0, 10]"),
        ("repetition_penalty", 11, "(0, 10]"),
        ("repetition_penalty", True, "a number"),
    ],
)
def test_bad_penalties_are_refused_by_name(field: str, value: object, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field) as e:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert why in str(e.value)
