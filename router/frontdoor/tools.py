"""Tool calling in chat completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

The tools go to the model's chat template (its ``tools`` variable, as transformers
passes them); ``tool_choice`` says what the reply may be:

- ``{"type": "function", "function": {"name": N}}``: one call of N. The output is
  constrained to N's ``parameters`` schema (structured output, core/structured.py)
  and is that call's arguments; streamed, each delta's text is a fragment of them.
  The finish reason stays ``stop``, as OpenAI's does for a call it was told to make.
- ``"required"``: one call or more (exactly one when ``parallel_tool_calls`` is
  false). The output is constrained to a JSON array of ``{"name": N, "parameters":
  {...}}`` items, each of a declared tool with its schema; the calls come whole once
  the output is. Finish reason ``tool_calls``.
- ``"auto"`` (the default when tools are given): the output is free. Calls the model
  writes are taken out of its text in the two forms open models are trained on:
  ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks after any text
  (Hermes, Qwen2.5 and others), or an output that is all JSON, one
  ``{"name": N, "arguments" or "parameters": {...}}`` or a list of them (Llama 3.1
  and 3.2; Mistral, whose ``[TOOL_CALLS]`` token is dropped from the text). Output
  that does not parse as calls of declared tools stays content. Streamed, text
  streams as content until a ``<tool_call>`` begins (a piece that may begin one is
  held back); an output that opens with ``{`` or ``[`` is held whole; calls come
  at the end.
- ``"none"``: the tools are rendered; the reply is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.structured import check_schema

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_OPENERS = ("{", "[")  # an auto output opening with one may be all calls
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
Call = tuple[str, str]  # function name, arguments (JSON text)


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools and what its reply may be (``mode``: auto, required, named, none)."""

    tools: tuple[dict[str, Any], ...]
    schemas: dict[str, dict[str, Any]]  # name -> parameters schema
    mode: str
    name: str | None = None  # the function a named choice calls
    parallel: bool = True

    def schema(self) -> str | None:
        """The JSON schema (text) the output must follow; None: free text."""
        if self.mode == "named":
            assert self.name is not None
            return json.dumps(self.schemas[self.name])
        if self.mode != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": s},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n, s in self.schemas.items()
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return json.dumps(array if self.parallel else {**array, "maxItems": 1})

    def reply(self, text: str, reason: str | None) -> tuple[str | None, list[Call], str | None]:
        """(content, calls, finish reason) of a whole output."""
        if self.mode == "named":
            assert self.name is not None
            return None, [(self.name, text)], reason
        calls = self._calls(text)
        if calls is None:
            return text, [], reason
        content, calls_found = calls
        return content, calls_found, "tool_calls" if reason == "stop" else reason

    def _calls(self, text: str) -> tuple[str | None, list[Call]] | None:
        if self.mode == "required":  # a list of calls, unless cut short (length, a stop)
            found = json_calls(text, self.schemas) if text.lstrip()[:1] == "[" else None
            return None if found is None else (None, found)
        if self.mode != "auto":
            return None
        if text.lstrip()[:1] in JSON_OPENERS and (found := json_calls(text, self.schemas)):
            return None, found
        if OPEN in text:
            start = text.index(OPEN)
            found = hermes_calls(text[start:], self.schemas)
            if found:
                return (text[:start] if text[:start].strip() else None), found
        return None

    def stream(self) -> ToolStream:
        return ToolStream(self)


def hermes_calls(text: str, names: dict[str, Any]) -> list[Call] | None:
    """The calls of ``text`` (``<tool_call>...</tool_call>`` blocks, the last one may be
    unclosed, nothing else but whitespace), or None if any block is not a call of a
    declared tool."""
    calls, end = [], 0
    for match in _CALL.finditer(text):
        if text[end : match.start()].strip():
            return None
        end = match.end()
        try:
            call = _call_of(json.loads(match.group(1)), names)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls if calls and not text[end:].strip() else None


def json_calls(text: str, names: dict[str, Any]) -> list[Call] | None:
    """The calls of an output that is all JSON: one call object or a list of them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        call = _call_of(item, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _call_of(value: Any, names: dict[str, Any]) -> Call | None:
    """``{"name": N, "arguments" (or "parameters"): {...}}`` of a declared tool, else None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return (value["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


class ToolStream:
    """One choice's streamed reply: each output piece in, the delta fields to send out."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.held = ""  # text not sent yet
        self.calling = False  # auto: a call may have begun; the rest waits for the end
        self.opened = False  # auto: the first non-space character came; named: any text
        self.id = call_id()

    def feed(self, text: str) -> dict[str, Any] | None:
        """The delta fields for the next piece of output (None: nothing to send yet)."""
        mode = self.choice.mode
        if mode == "named":
            if not text:
                return None
            first, self.opened = not self.opened, True  # the arguments go out as they come
            return {"tool_calls": [self._call_delta(0, self.choice.name or "", text, first)]}
        if mode == "required" or (mode == "auto" and self.calling):
            self.held += text
            return None
        if mode != "auto":
            return {"content": text} if text else None
        self.held += text
        if not self.opened:
            if not self.held.strip():
                return None  # only spaces so far: the output may still open a JSON call
            self.opened = True
            if self.held.lstrip()[0] in JSON_OPENERS:
                self.calling = True
                return None
        if OPEN in self.held:
            self.calling = True
            content, self.held = self.held.split(OPEN, 1)
            self.held = OPEN + self.held
            return {"content": content} if content else None
        keep = _partial_open(self.held)  # may be the start of <tool_call>
        content, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return {"content": content} if content else None

    def end(self, reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The last delta fields (what was held back) and the finish reason."""
        mode = self.choice.mode
        if mode == "named" or mode == "none":
            return None, reason
        if mode == "auto" and not self.calling:
            held, self.held = self.held, ""
            return ({"content": held} if held else None), reason
        content, calls, reason = self.choice.reply(self.held, reason)
        self.held = ""
        if not calls:
            return ({"content": content} if content else None), reason
        deltas = [self._call_delta(i, n, a, True) for i, (n, a) in enumerate(calls)]
        fields = {"content": content} if content else {}
        return {**fields, "tool_calls": deltas}, reason

    def _call_delta(self, index: int, name: str, arguments: str, first: bool) -> dict[str, Any]:
        if not first:
            return {"index": index, "function": {"arguments": arguments}}
        call_ = self.id if index == 0 else call_id()
        return {
            "index": index,
            "id": call_,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }


def _partial_open(text: str) -> int:
    """The length of the longest end of ``text`` that ``<tool_call>`` starts with."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_calls_field(calls: list[Call]) -> list[dict[str, Any]]:
    """A message's ``tool_calls`` for whole calls."""
    return [
        {"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in calls
    ]


def tool_choice(body: dict[str, Any]) -> ToolChoice | None:
    """The request's tools and choice, checked (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidArgumentError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidArgumentError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    schemas = {}
    for i, tool in enumerate(tools):
        name, schema = _tool(tool, f"tools[{i}]")
        if name in schemas:
            raise InvalidArgumentError(f"tools[{i}].function.name", f"{name!r} is declared twice")
        schemas[name] = schema
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgumentError("parallel_tool_calls", "must be a boolean")
    mode, named = _mode(choice, schemas)
    for i, (n, schema) in enumerate(schemas.items()):  # the schemas that will guide decoding
        error = check_schema(json.dumps(schema)) if mode == "required" or n == named else None
        if error:
            raise InvalidArgumentError(
                f"tools[{i}].function.parameters", f"cannot guide decoding: {error[:300]}"
            )
    return ToolChoice(tuple(tools), schemas, mode, named, parallel is not False)


def _tool(tool: Any, field: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidArgumentError(f"{field}.type", "must be 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidArgumentError(f"{field}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"{field}.function.name", "must be 1-64 letters, digits, '_' or '-'"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidArgumentError(f"{field}.function.description", "must be a string")
    schema = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"{field}.function.parameters", "must be a JSON schema object")
    return name, schema


def _mode(choice: Any, schemas: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise InvalidArgumentError(
            "tool_choice",
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
        )
    if name not in schemas:
        raise InvalidArgumentError(
            "tool_choice.function.name", f"{name!r} is not one of the tools {sorted(schemas)}"
        )
    return "named", name
