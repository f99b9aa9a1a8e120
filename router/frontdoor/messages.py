"""A chat request's ``messages``, checked and shaped for the model's chat template.

Each message has a ``role`` and text ``content`` (a string, or a list of text
parts, joined). An assistant message may carry the ``tool_calls`` it made
(its content then may be null) and a ``tool`` message the ``tool_call_id`` it
answers; the template sees them under those names, as transformers' templates
expect. Anything else (images, audio) is refused naming the field.
"""

from __future__ import annotations

from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.sampling_params import check_text

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def template_message(m: Any, i: int) -> dict[str, Any]:
    """Message ``i`` as the chat template gets it."""
    field = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidArgumentError(field, "each message needs a 'role' and 'content'")
    role = m["role"]
    if role not in ROLES:
        raise InvalidArgumentError(f"{field}.role", f"must be one of {sorted(ROLES)}")
    out: dict[str, Any] = {"role": role}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise InvalidArgumentError(f"{field}.tool_calls", "must be a list")
        if role != "assistant":
            raise InvalidArgumentError(f"{field}.tool_calls", "only assistant messages make calls")
        out["tool_calls"] = [_call(c, f"{field}.tool_calls[{k}]") for k, c in enumerate(calls)]
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidArgumentError(f"{field}.tool_call_id", "a tool message needs it")
        out["tool_call_id"] = call_id
    content = m.get("content")
    if content is None and calls:
        content = ""
    out["content"] = _text(content, f"{field}.content")
    return out


def _text(content: Any, field: str) -> str:
    if isinstance(content, list):  # content parts: text only
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) != len(content):
            raise InvalidArgumentError(field, "only text parts are supported")
        content = "".join(strings)
    if not isinstance(content, str):
        raise InvalidArgumentError(field, "must be a string or a list of text parts")
    check_text(field, content)
    return content


def _call(call: Any, field: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgumentError(f"{field}.function", "must be an object with a 'name'")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise InvalidArgumentError(f"{field}.function.arguments", "must be JSON text")
    check_text(f"{field}.function.arguments", arguments)
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
