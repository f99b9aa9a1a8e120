"""Chat templates render as transformers renders them, tools and tool calls included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.tokenizer import Tokenizer

# A Hermes-style template written for this test: the tools as JSON in the system turn,
# calls in <tool_call> blocks, tool answers in <tool_response> blocks; it uses the helpers
# templates written for transformers call (tojson with options, raise_exception,
# strftime_now, loop controls).
TEMPLATE = """{{ bos_token }}<|system|>
Today is {{ strftime_now('%Y') | length }} digits of year.
{% if tools %}You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ tools[0].function | tojson(indent=2, sort_keys=true) }}
{% endif %}<|end|>
{% for message in messages %}
{% if message.role not in ['user', 'assistant', 'tool', 'system'] %}{{ raise_exception('odd role ' + message.role) }}{% endif %}
<|{{ message.role }}|>
{% if message.content %}{{ message.content }}{% endif %}
{% for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}
{% if message.role == 'tool' %}<tool_response id="{{ message.tool_call_id }}"/>{% endif %}
<|end|>
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Météo <now> & then",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def pair(folder: Path) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    ours = Tokenizer.from_dir(folder)
    ours.config = {**ours.config, "chat_template": TEMPLATE}
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token=ours.config["bos_token"],
        chat_template=TEMPLATE,
    )
    return ours, theirs


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_a_tool_template_renders_as_transformers_renders_it(
    tiny_path: Path, tools: list[dict[str, Any]] | None
) -> None:
    ours, theirs = pair(tiny_path)
    want = theirs.apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True
    )
    got = ours.apply_chat_template(MESSAGES, tools=tools)
    assert got == want
    if tools:
        assert json.dumps(TOOLS[0], ensure_ascii=False) in got  # not HTML-escaped, not ASCII
        assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}' in got


def test_a_template_that_raises_refuses_the_messages_by_name(tiny_path: Path) -> None:
    ours, _ = pair(tiny_path)
    with pytest.raises(InvalidArgumentError, match="odd role developer") as e:
        ours.apply_chat_template([{"role": "developer", "content": "x"}])
    assert e.value.field == "messages"
