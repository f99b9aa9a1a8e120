"""What a request can ask of sampling beyond one completion, on a real cluster (a
prefill and a decode instance): ``n`` choices, logprobs, logit_bias,
penalties, JSON schemas and tool calls, over HTTP (the official openai client) and gRPC."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from pdserve import LLM, SamplingParams
from tests.e2e.test_router import LLM_TOKENIZER, PROMPT, openai_client, request
from tests.e2e.tiny_cluster import AUTH, Cluster, stub


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = Cluster({"local": (1, 1)})
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def doors(cluster):
    return cluster._bootstrap[1]


@pytest.fixture(scope="module")
def reference():
    """The offline engine's greedy tokens and logprobs (tests/engine checks these
    against transformers)."""
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    return LLM("builtin:tiny").generate(PROMPT, params)[0].outputs[0]


def test_openai_n_choices_are_the_seeded_requests_one_by_one(cluster, doors, reference) -> None:
    """``n`` choices of a seeded request are the requests of seeds seed, seed + 1, ...;
    streamed, each choice's chunks carry its index and make the same text."""
    client = openai_client(doors)
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    many = client.completions.create(n=3, seed=7, **ask)
    one = [client.completions.create(seed=7 + i, **ask) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [o.choices[0].text for o in one]
    assert len({c.text for c in many.choices}) > 1  # different seeds, different samples
    assert (
        many.usage.completion_tokens == 24
        and many.usage.prompt_tokens == one[0].usage.prompt_tokens
    )
    greedy = client.completions.create(**{**ask, "temperature": 0, "max_tokens": 12}, n=2)
    assert [c.text for c in greedy.choices] == [reference.text] * 2
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "n": 3,
    }
    whole = client.chat.completions.create(**chat)
    chunks = list(
        client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    )
    texts, roles = ["", "", ""], [None, None, None]
    for c in chunks[:-1]:
        (choice,) = c.choices
        roles[choice.index] = roles[choice.index] or choice.delta.role
        texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices] and roles == ["assistant"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    stream = client.completions.create(
        **{**ask, "max_tokens": 3000}, n=4, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _chunk in zip(range(6), stream, strict=False):
        pass
    stream.close()  # the client leaves: every choice is aborted
    cluster.assert_idle()


def test_openai_logprobs_through_prefill_and_decode_match_the_engine(
    cluster, doors, reference
) -> None:
    """The first token's logprobs come from the prefill instance, the rest from decode;
    both equal the offline engine's (checked against transformers in tests/engine)."""
    want = LLM("builtin:tiny").generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    )
    ref = want[0].outputs[0]
    client = openai_client(doors)
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    lp = client.completions.create(**ask).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([v for v, _ in ref.logprobs], abs=1e-5)
    tok = LLM_TOKENIZER()
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    tops = [v for d in lp.top_logprobs for v in d.values()]
    assert tops == pytest.approx([v for _, top in ref.logprobs for _, v in top], abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = list(client.completions.create(**ask, stream=True))
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert all(c.top_logprobs[0].logprob == c.logprob and len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    cluster.assert_idle()


def test_grpc_logprobs_match_the_engine(cluster, doors, reference) -> None:
    options = dict(max_tokens=12, temperature=0.0, logprobs=2)
    whole = stub(doors).Complete(request(**options), metadata=AUTH)
    assert list(whole.token_ids) == reference.token_ids
    got = [
        (e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in whole.logprobs
    ]
    want = [
        (t, v, top) for t, (v, top) in zip(reference.token_ids, reference.logprobs, strict=True)
    ]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-5)
    assert [t for g in got for t, _ in g[2]] == [t for w in want for t, _ in w[2]]
    chunks = list(stub(doors).Generate(request(**options), metadata=AUTH))
    assert [e.logprob for c in chunks for e in c.logprobs] == [g[1] for g in got]
    plain = stub(doors).Complete(request(max_tokens=3), metadata=AUTH)
    assert len(plain.logprobs) == 0  # not asked for
    with pytest.raises(grpc.RpcError) as e:
        stub(doors).Complete(request(logprobs=21), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in e.value.details()
    cluster.assert_idle()


def test_logit_bias_over_http_and_grpc(cluster, doors) -> None:
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    out = openai_client(doors).completions.create(**ask, logit_bias={"7": 100})
    assert out.choices[0].text == LLM_TOKENIZER().decode([7, 7, 7])
    whole = stub(doors).Complete(request(max_tokens=3, logit_bias={7: 100.0}), metadata=AUTH)
    assert list(whole.token_ids) == [7, 7, 7]
    with pytest.raises(grpc.RpcError) as e:
        stub(doors).Complete(request(logit_bias={7: 500.0}), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in e.value.details()
    cluster.assert_idle()


def test_penalties_through_prefill_and_decode_match_the_engine(cluster, doors, reference) -> None:
    """The prefill instance samples the first token under the penalties, decode the
    rest (seeing the first): the tokens equal the offline engine's."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.25}
    params = SamplingParams(max_tokens=12, temperature=0, **penalties)
    want = LLM("builtin:tiny").generate(PROMPT, params)[0].outputs[0]
    assert want.token_ids != reference.token_ids  # the penalties change the greedy tokens
    whole = stub(doors).Complete(
        request(max_tokens=12, temperature=0.0, **penalties), metadata=AUTH
    )
    assert list(whole.token_ids) == want.token_ids
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    out = openai_client(doors).completions.create(
        **ask, presence_penalty=0.5, frequency_penalty=1.5, extra_body={"repetition_penalty": 1.25}
    )
    assert out.choices[0].text == want.text
    with pytest.raises(grpc.RpcError) as e:
        stub(doors).Complete(request(presence_penalty=3.0), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "presence_penalty" in e.value.details()
    cluster.assert_idle()


def test_response_format_json_schema_through_prefill_and_decode(cluster, doors) -> None:
    """The prefill instance samples the first token under the schema's grammar, decode
    the rest (its matcher fed the first): valid JSON, the offline engine's tokens."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "blue"]}},
        "required": ["ok", "colour"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=40, temperature=0, json_schema=json.dumps(schema))
    want = LLM("builtin:tiny").generate(PROMPT, params)[0].outputs[0]
    assert want.finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), schema)
    client = openai_client(doors)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=40,
        temperature=0,
        response_format=fmt,
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert chat.choices[0].finish_reason == "stop"
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    out = client.completions.create(**ask, extra_body={"response_format": fmt})
    assert out.choices[0].text == want.text
    whole = stub(doors).Complete(
        request(max_tokens=40, json_schema=json.dumps(schema)), metadata=AUTH
    )
    assert list(whole.token_ids) == want.token_ids
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**ask, extra_body={"response_format": {"type": "xml"}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(grpc.RpcError) as g:
        stub(doors).Complete(request(json_schema='{"type": "nonsense"}'), metadata=AUTH)
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json_schema" in g.value.details()
    cluster.assert_idle()


def test_openai_echo_returns_the_prompt_and_its_logprobs(cluster, doors) -> None:
    """``echo`` with ``logprobs: 1`` and one token (how lm-eval scores a continuation):
    the prompt's tokens open the choice with the logprobs the offline engine computes
    for them (checked against transformers in tests/engine), the first one null."""
    tok = LLM_TOKENIZER()
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    want = LLM("builtin:tiny").generate([ids], params)[0]
    assert want.prompt_logprobs is not None
    client = openai_client(doors)
    ask = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    out = client.completions.create(**ask, echo=True).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(
        [e[0] for e in want.prompt_logprobs[1:]], abs=1e-5
    )
    assert lp.token_logprobs[-1] == pytest.approx(want.outputs[0].logprobs[0][0], abs=1e-5)
    assert lp.tokens[: len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert out.text == tok.decode(ids, skip_special_tokens=False) + want.outputs[0].text
    chunks = list(client.completions.create(**ask, echo=True, stream=True))
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs and "".join(c.choices[0].text for c in chunks) == out.text
    text = (
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True
        )
        .choices[0]
        .text
    )
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**ask, echo="yes")
    assert e.value.body["param"] == "echo"
    cluster.assert_idle()


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


def test_openai_tool_calls_through_prefill_and_decode(cluster, doors) -> None:
    """A named tool choice constrains the output to that tool's parameters, ``required``
    to a list of calls of the tools: the offline engine's tokens under the same schema,
    whole and streamed (parsed by the official client); ``auto`` with a model that
    writes no call is its plain reply; a conversation with calls and answers renders."""
    client = openai_client(doors)
    messages = [{"role": "user", "content": PROMPT}]
    ask = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 60,
        "temperature": 0,
        "tools": TOOLS,
    }
    named = {"type": "function", "function": {"name": "weather"}}
    ids = LLM_TOKENIZER().encode(
        LLM_TOKENIZER().apply_chat_template(messages, tools=TOOLS), add_special_tokens=False
    )
    params = SamplingParams(max_tokens=60, temperature=0, json_schema=json.dumps(WEATHER))
    want = LLM("builtin:tiny").generate([ids], params)[0].outputs[0]
    out = client.chat.completions.create(**ask, tool_choice=named).choices[0]
    (call,) = out.message.tool_calls
    assert out.message.content is None and out.finish_reason == want.finish_reason == "stop"
    assert call.function.name == "weather" and call.function.arguments == want.text
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls = [
        c.choices[0].delta.tool_calls
        for c in client.chat.completions.create(**ask, tool_choice=named, stream=True)
    ]
    assert calls[0][0].id.startswith("call_") and calls[0][0].function.name == "weather"
    assert "".join(c[0].function.arguments for c in calls if c) == want.text

    required = client.chat.completions.create(
        **ask, tool_choice="required", parallel_tool_calls=False
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schema = {"weather": WEATHER, "clock": TOOLS[1]["function"]["parameters"]}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    chunks = list(
        client.chat.completions.create(
            **ask, tool_choice="required", parallel_tool_calls=False, stream=True
        )
    )
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    plain = client.chat.completions.create(**{**ask, "tools": None, "max_tokens": 8}).choices[0]
    auto = client.chat.completions.create(**{**ask, "max_tokens": 8}).choices[0]
    assert auto.message.content == plain.message.content and auto.message.tool_calls is None
    history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "clock", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    answer = client.chat.completions.create(**{**ask, "messages": history, "max_tokens": 4})
    assert answer.choices[0].message.content
    for bad, field in [
        (
            {"tool_choice": {"type": "function", "function": {"name": "rain"}}},
            "tool_choice.function.name",
        ),
        (
            {"messages": [*history[:2], {"role": "tool", "content": "noon"}]},
            "messages[2].tool_call_id",
        ),
        ({"tool_choice": named, "response_format": {"type": "json_object"}}, "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**ask, **bad})
        assert e.value.body["param"] == field
    cluster.assert_idle()
