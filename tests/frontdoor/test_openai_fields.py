"""Which OpenAI fields the HTTP door takes: the fields clients send at their
do-nothing value pass; any other value of them, and unknown fields, are refused
by name. Over real HTTP too, where a request that passes meets a router with no
instance (429), and a refused one never reaches it (400)."""

from __future__ import annotations

import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.frontdoor.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_fields,
    response_schema,
)
from tests.frontdoor.test_lora_http import _run

TAKEN = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "logprobs": None,
    "logit_bias": {},
}
TAKEN_CHAT = {
    "n": None,
    "logit_bias": None,
    "top_logprobs": None,
    "response_format": {"type": "text"},
    "tools": [],
    "functions": None,
    "tool_choice": "none",
    "function_call": "auto",
    "parallel_tool_calls": False,
    "modalities": ["text"],
    "service_tier": "auto",
    "store": False,
    "metadata": {"team": "a"},
}
REFUSED = [("best_of", 3), ("suffix", "x")]
REFUSED_CHAT = [
    ("functions", [{"name": "f"}]),
    ("function_call", {"name": "f"}),
    ("service_tier", "flex"),
    ("store", True),
    ("modalities", ["text", "audio"]),
]


def test_do_nothing_values_pass_and_others_are_refused_by_name() -> None:
    check_fields({"model": "m", **TAKEN}, COMPLETION_FIELDS)
    check_fields({"model": "m", **TAKEN_CHAT}, CHAT_FIELDS)
    for fields, refused in ((COMPLETION_FIELDS, REFUSED), (CHAT_FIELDS, REFUSED_CHAT)):
        for name, value in refused:
            with pytest.raises(InvalidArgumentError, match="is not supported") as e:
                check_fields({"model": "m", name: value}, fields)
            assert e.value.field == name
    for name, fields in (
        ("bogus", COMPLETION_FIELDS),
        ("tools", COMPLETION_FIELDS),
        ("best_of", CHAT_FIELDS),
    ):
        with pytest.raises(InvalidArgumentError, match="unknown field"):
            check_fields({name: None}, fields)


def test_over_http_a_request_with_do_nothing_fields_reaches_the_router() -> None:
    completion = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
    requests = [
        ("POST", "/v1/completions", {**completion, **TAKEN}),
        ("POST", "/v1/completions", {**completion, "best_of": 2}),
    ]
    (taken, refused), seen = _run(requests)
    assert taken[0] == 429 and len(seen) == 1  # no instance: refused by admission, not the door
    assert refused[0] == 400 and refused[1]["error"]["param"] == "best_of"


def test_response_formats_become_a_schema_or_are_refused_by_name() -> None:
    assert response_schema(None) is None and response_schema({"type": "text"}) is None
    assert response_schema({"type": "json_object"}) == '{"type": "object"}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert response_schema(spec) == '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    bad = [
        ({"type": "grammar"}, "response_format"),
        ("json", "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "response_format.json_schema"),
    ]
    for value, field in bad:
        with pytest.raises(InvalidArgumentError) as e:
            response_schema(value)
        assert e.value.field == field
