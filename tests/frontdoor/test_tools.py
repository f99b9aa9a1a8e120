"""Tool calling's request checks, output schemas and parsing (router/frontdoor/tools.py)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.frontdoor.messages import template_message
from pdserve.router.frontdoor.tools import ToolChoice, tool_choice

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "description": "now"}},
]


def choice(mode: Any = None, **extra: Any) -> ToolChoice:
    got = tool_choice({"tools": TOOLS, "tool_choice": mode, **extra})
    assert got is not None
    return got


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": {"weather": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "integer", "minimum": 10, "maximum": 1},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        tool_choice(body)
    assert e.value.field == field


def test_no_tools_means_no_tool_choice() -> None:
    assert tool_choice({}) is None
    assert tool_choice({"tools": [], "tool_choice": "none"}) is None
    assert choice().mode == "auto" and choice("none").mode == "none"
    assert choice().schema() is None and choice("none").schema() is None


def test_a_named_choice_is_constrained_to_its_parameters() -> None:
    named = choice({"type": "function", "function": {"name": "weather"}})
    assert json.loads(named.schema() or "") == WEATHER
    assert named.reply('{"city": "Oslo"}', "stop") == (
        None,
        [("weather", '{"city": "Oslo"}')],
        "stop",
    )
    assert named.reply('{"city": "Os', "length")[2] == "length"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_follow_the_array_schema(parallel: bool) -> None:
    required = choice("required", parallel_tool_calls=parallel)
    schema = json.loads(required.schema() or "")
    one = [{"name": "weather", "parameters": {"city": "Oslo", "days": 2}}]
    two = [*one, {"name": "time", "parameters": {}}]
    jsonschema.validate(one, schema)
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    for bad in ([], [{"name": "weather", "parameters": {}}], [{"name": "x", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls, reason = required.reply(json.dumps(two), "stop")
    assert content is None and reason == "tool_calls"
    assert calls == [("weather", '{"city": "Oslo", "days": 2}'), ("time", "{}")]
    assert required.reply('[{"name": "wea', "length") == ('[{"name": "wea', [], "length")


CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
AUTO_CASES = [
    ("It is sunny.", ("It is sunny.", [], "stop")),
    (CALL, (None, [("weather", '{"city": "Oslo"}')], "tool_calls")),
    ("Let me look.\n" + CALL, ("Let me look.\n", [("weather", '{"city": "Oslo"}')], "tool_calls")),
    (
        CALL + "\n" + CALL.replace("weather", "time").replace('{"city": "Oslo"}', "{}"),
        (None, [("weather", '{"city": "Oslo"}'), ("time", "{}")], "tool_calls"),
    ),
    (CALL[: -len("</tool_call>")], (None, [("weather", '{"city": "Oslo"}')], "tool_calls")),
    ("a < b, and <tool is not a call", ("a < b, and <tool is not a call", [], "stop")),
    (CALL.replace("weather", "rain"), (CALL.replace("weather", "rain"), [], "stop")),
    (CALL + " and more", (CALL + " and more", [], "stop")),
    (
        '\n {"name": "weather", "parameters": {"city": "Oslo"}}',
        (None, [("weather", '{"city": "Oslo"}')], "tool_calls"),
    ),
    (
        '[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]',
        (None, [("weather", '{"city": "Oslo"}'), ("time", "{}")], "tool_calls"),
    ),
    (
        '{"name": "weather", "arguments": {"city": "Oslo"}} is what I would call',
        ('{"name": "weather", "arguments": {"city": "Oslo"}} is what I would call', [], "stop"),
    ),
    (
        '[{"name": "weather", "arguments": {}}, {"name": "rain", "arguments": {}}]',
        ('[{"name": "weather", "arguments": {}}, {"name": "rain", "arguments": {}}]', [], "stop"),
    ),
    (
        '{"answer": 42}\n' + CALL,
        ('{"answer": 42}\n', [("weather", '{"city": "Oslo"}')], "tool_calls"),
    ),
    ("  ", ("  ", [], "stop")),
    (
        '<tool_call>{"name": "weather", "arguments": 3}</tool_call>',
        ('<tool_call>{"name": "weather", "arguments": 3}</tool_call>', [], "stop"),
    ),
]


@pytest.mark.parametrize(("text", "expected"), AUTO_CASES)
def test_auto_takes_hermes_calls_of_declared_tools_out_of_the_text(
    text: str, expected: tuple[str | None, list[tuple[str, str]], str]
) -> None:
    assert choice().reply(text, "stop") == expected


def streamed(
    tools: ToolChoice, pieces: list[str], reason: str
) -> tuple[str, list[Any], str | None]:
    """(content, tool call deltas, finish reason) of a stream of ``pieces``."""
    stream, content, calls = tools.stream(), "", []
    for i, piece in enumerate(pieces):
        fields = [stream.feed(piece)]
        if i == len(pieces) - 1:
            last, reason_out = stream.end(reason)
            fields.append(last)
        for f in filter(None, fields):
            assert set(f) <= {"content", "tool_calls"} and f.get("content") != ""
            content += f.get("content", "")
            calls += f.get("tool_calls", [])
    return content, calls, reason_out


@pytest.mark.parametrize(("text", "expected"), AUTO_CASES)
def test_a_streamed_auto_reply_equals_the_whole_one_at_every_split(
    text: str, expected: tuple[str | None, list[tuple[str, str]], str]
) -> None:
    content, calls, reason = expected
    cuts = [sorted(c) for c in itertools.combinations(range(1, len(text)), 2)][::7]
    for a, b in [(0, 0), *cuts]:
        got_content, got_calls, got_reason = streamed(
            choice(), [text[:a], text[a:b], text[b:]], "stop"
        )
        assert got_content == (content or "") and got_reason == reason
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
        assert [c["index"] for c in got_calls] == list(range(len(calls)))


def test_a_streamed_named_call_sends_its_arguments_as_they_come() -> None:
    named = choice({"type": "function", "function": {"name": "weather"}})
    content, calls, reason = streamed(named, ['{"ci', "", 'ty": "Oslo"}'], "stop")
    assert content == "" and reason == "stop"
    first, *rest = calls
    assert first["function"]["name"] == "weather" and first["id"].startswith("call_")
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in rest)
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'


def test_messages_carry_tool_calls_and_answers_to_the_template() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    asked = template_message({"role": "assistant", "content": None, "tool_calls": [call]}, 1)
    assert asked == {"role": "assistant", "content": "", "tool_calls": [call]}
    answer = template_message({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, 2)
    assert answer == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    bad = [
        ({"role": "user", "content": "x", "tool_calls": [call]}, "messages[0].tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": "x"}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {}}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"role": "tool", "content": "sunny"}, "messages[0].tool_call_id"),
        ({"role": "assistant", "content": None}, "messages[0].content"),
    ]
    for message, field in bad:
        with pytest.raises(InvalidArgumentError) as e:
            template_message(message, 0)
        assert e.value.field == field
