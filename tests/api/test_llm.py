"""The offline API on the built-in model: stops, seeds, limits, errors, aborts."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.errors import InvalidArgumentError, ModelNotFoundError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny", max_num_batched_tokens=64)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    yield
    if "llm" in request.fixturenames:
        request.getfixturevalue("llm").engine.assert_idle()


def greedy(llm: LLM, prompt: str, n: int = 24) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=n, **GREEDY))[0].outputs[0].token_ids


def test_text_in_text_out(llm: LLM) -> None:
    out = llm.generate(["Hello, world!", [5, 6, 7]], SamplingParams(max_tokens=8, **GREEDY))
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    assert out[0].prompt == "Hello, world!" and out[1].prompt is None
    assert out[0].prompt_token_ids == llm.tokenizer.encode("Hello, world!")
    for o in out:
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)
        assert o.outputs[0].finish_reason == "length"
        assert o.metrics.ttft is not None and o.metrics.ttft > 0


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    prompt = "Once upon a time"
    full = llm.tokenizer.decode(greedy(llm, prompt))
    stop = full[10:13]
    assert stop.strip() and full.find(stop) == 10
    out = llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0].outputs[0]
    assert out.text == full[:10]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(max_tokens=24, stop=[stop], include_stop_str_in_output=True, **GREEDY),
    )[0].outputs[0]
    assert kept.text == full[:13]


def test_stop_token_ids_end_generation(llm: LLM) -> None:
    tokens = greedy(llm, "The router")
    stop_at = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 3)
    out = llm.generate(
        "The router", SamplingParams(max_tokens=24, stop_token_ids=[tokens[stop_at]], **GREEDY)
    )[0].outputs[0]
    assert out.token_ids == tokens[: stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[stop_at]


def test_min_tokens_suppresses_stop_tokens(llm: LLM) -> None:
    tokens = greedy(llm, "The router")
    params = SamplingParams(max_tokens=10, min_tokens=6, stop_token_ids=[tokens[0]], **GREEDY)
    out = llm.generate("The router", params)[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert tokens[0] not in out.token_ids[:6]


def test_eos_stops_unless_ignored() -> None:
    llm = LLM("builtin:tiny")
    tokens = greedy(llm, "Hello")
    llm.engine.eos_token_ids = (tokens[4],)  # pretend the model's EOS is the 5th token
    out = llm.generate("Hello", SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(tokens[4]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert greedy(llm, "Hello") == tokens  # ignore_eos=True runs to max_tokens
    llm.engine.assert_idle()


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate("Hello", p)[0].outputs[0].token_ids
    batched = (
        llm.generate(
            ["Something else", "Hello", "More"],
            [
                SamplingParams(max_tokens=20, temperature=1.0),
                p,
                SamplingParams(max_tokens=5, temperature=0.3),
            ],
        )[1]
        .outputs[0]
        .token_ids
    )
    assert batched == alone
    other = llm.generate(
        "Hello", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99)
    )
    assert other[0].outputs[0].token_ids != alone


def test_context_limit(llm: LLM) -> None:
    small = LLM("builtin:tiny", max_model_len=40)
    with pytest.raises(InvalidArgumentError) as err:
        small.generate([1] * 40, SamplingParams(max_tokens=4))
    assert err.value.field == "prompt"
    out = small.generate([1] * 30, SamplingParams(max_tokens=100, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    small.engine.assert_idle()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens="8"), "max_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ([], "prompts"),
        ([[]], "prompt"),
        ([[10**9]], "prompt_token_ids"),
        ([3.5], "prompts[0]"),
        (None, "prompts"),
        (7, "prompts"),
        ("\ud800", "prompts"),
        (["ok", "x\ud800"], "prompts[1]"),
    ],
)
def test_bad_prompts_name_the_field_and_leave_nothing_behind(llm: LLM, prompt, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert err.value.field == field


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_tokens": 2}, "sampling_params"),
        ("greedy", "sampling_params"),
        ([SamplingParams(), {"max_tokens": 2}], "sampling_params[1]"),
        ([], "sampling_params"),
    ],
)
def test_bad_sampling_params_arguments_name_the_argument(llm: LLM, params, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        llm.generate(["a", "b"], params)
    assert err.value.field == field
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(InvalidArgumentError):
        llm.generate(["fine", [10**9]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_unknown_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="built-in"):
        LLM("builtin:nonesuch")


def test_bad_engine_options_name_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        LLM("builtin:tiny", block_size=0)
    assert err.value.field == "block_size"
    with pytest.raises(InvalidArgumentError) as err:
        LLM("builtin:tiny", no_such_option=1)
    assert err.value.field == "no_such_option"
    with pytest.raises(InvalidArgumentError) as err:
        LLM("builtin:tiny", max_model_len=10**6)
    assert err.value.field == "max_model_len"


def test_abort_mid_generation_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    for i in range(4):
        engine.add_request(
            f"abort-{i}", "a prompt that is long enough " * (i + 1), SamplingParams(max_tokens=50)
        )
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    for i in range(4):
        out = engine.abort_request(f"abort-{i}")
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort_request("abort-0") is None


def test_streamed_deltas_add_up_to_the_text(llm: LLM) -> None:
    engine = llm.engine
    full = llm.tokenizer.decode(greedy(llm, "Hello"))
    stop = full[8:11]
    engine.add_request("stream", "Hello", SamplingParams(max_tokens=24, stop=[stop], **GREEDY))
    pieces = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            assert stop not in "".join(pieces)  # never sent text that is later cut
    assert "".join(pieces) == full[:8]
