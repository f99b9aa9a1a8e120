"""The OpenAI request fields the HTTP front door takes, and the values it supports.

A field not listed is refused by name (a typo must not be ignored silently).
Clients and SDK wrappers also send fields whose value asks for nothing
(``"functions": null``, ``"best_of": 1``, ``"suffix": null``): those are taken, and any
other value of them is refused naming the field, as pdserve does not do it. ``tools``,
``tool_choice`` and ``parallel_tool_calls`` are checked where they are used (tools.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pdserve.core.errors import InvalidArgumentError

COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "top_k",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "region",
    "request_id",
    "priority",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "logit_bias",
    "response_format",
    "cache_salt",
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON | {
    "messages",
    "top_logprobs",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "parallel_tool_calls",
    "modalities",
    "service_tier",
    "store",
    "metadata",
}

# Fields taken only at a value that asks for nothing: name -> that test.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
    "modalities": lambda v: v is None or v == ["text"],
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: not v,
    "metadata": lambda v: v is None or isinstance(v, dict),
}


def check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    """Refuse a field ``allowed`` does not name, a value pdserve does not support, and
    a malformed ``stream`` / ``stream_options``."""
    for name, value in body.items():
        if name not in allowed:
            raise InvalidArgumentError(name, "unknown field")
        neutral = NEUTRAL.get(name)
        if neutral is not None and not neutral(value):
            raise InvalidArgumentError(name, f"is not supported (got {str(value)[:64]})")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidArgumentError("stream", "must be a boolean")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise InvalidArgumentError(
                "stream_options", "must be an object with only 'include_usage'"
            )
        if not isinstance(options.get("include_usage", False), bool):
            raise InvalidArgumentError("stream_options.include_usage", "must be a boolean")


def response_schema(value: Any) -> str | None:
    """The JSON schema (as JSON text) an OpenAI ``response_format`` asks the output to
    follow: ``{"type": "json_object"}`` any JSON object, ``{"type": "json_schema",
    "json_schema": {"schema": {...}}}`` that schema; None for text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object" and len(value) == 1:
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidArgumentError(
                "response_format.json_schema", "must be an object with a 'schema' object"
            )
        return json.dumps(spec["schema"])
    raise InvalidArgumentError(
        "response_format", "must be {'type': 'text'}, {'type': 'json_object'} or a json_schema"
    )
