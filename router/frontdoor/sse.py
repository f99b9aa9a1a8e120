"""OpenAI's response objects for one request, and its stream as server-sent events.

A streamed completion writes one event per token delta, so the bytes of a
chunk are assembled from pieces encoded once per request (everything before
the delta's text, and the tail after its finish reason): per delta only the
text and the finish reason are encoded. The bytes equal ``json.dumps`` of the
chunk object (default separators, ASCII), so clients see the same stream as
from a dict.
"""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring_ascii
from typing import Any

from pdserve.router.frontdoor.tools import ToolChoice, ToolStream, tool_calls_field
from pdserve.router.stream import StreamDelta, Usage

DONE = b"data: [DONE]\n\n"
Choice = tuple[str, str | None, dict[str, Any] | None]  # text, finish reason, logprobs


class ResponseShape:
    """The response objects of one request (``chat``: chat completions; ``tools``: the
    tools its reply may call, router/frontdoor/tools.py)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        version: str = "",
        tools: ToolChoice | None = None,
    ) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.version = version  # name@version that served it (system_fingerprint)
        self.chat = chat
        self.created = int(time.time())
        self.started: set[int] = set()  # choices that sent their first chunk
        self.tools = tools
        self._tool_streams: dict[int, ToolStream] = {}  # per choice
        base = json.dumps(self._base("chat.completion.chunk" if chat else "text_completion"))
        # `{...base, "choices": [{"index": ` then `0, "text": ` or `0, "delta": {"content": `
        self._head = "data: " + base[:-1] + ', "choices": [{"index": '
        self._opening = ', "delta": {"content": ' if chat else ', "text": '
        self._tail = ', "logprobs": null}]}\n\n'

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.version or None,
        }

    def whole(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        """The response of a request that does not stream: (text, finish reason, logprobs
        object or None) per choice."""
        if self.chat:
            out = self._base("chat.completion")
            rows = [self._chat_row(i, *choice) for i, choice in enumerate(choices)]
        else:
            out = self._base("text_completion")
            rows = [
                {"index": i, "text": text, "finish_reason": reason, "logprobs": logprobs}
                for i, (text, reason, logprobs) in enumerate(choices)
            ]
        return {**out, "choices": rows, "usage": usage_object(usage)}

    def _chat_row(
        self, index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            message["content"], calls, reason = self.tools.reply(text, reason)
            if calls:
                message["tool_calls"] = tool_calls_field(calls)
        return {"index": index, "message": message, "finish_reason": reason, "logprobs": logprobs}

    def chunk_event(
        self, delta: StreamDelta, index: int = 0, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        """The event of one delta of choice ``index``: ``data: {chunk}\\n\\n`` (with its
        tokens' ``logprobs`` object where the request asked for them); with tools, what
        the delta lets the choice send (``b""``: nothing yet)."""
        if self.tools is not None:
            return self._tool_chunk(delta, index, logprobs)
        if logprobs is not None:
            return self._chunk({"content": delta.text}, index, delta.finish_reason, logprobs)
        text = encode_basestring_ascii(delta.text)
        if self.chat:
            text += "}" if index in self.started else ', "role": "assistant"}'
            self.started.add(index)
        reason = delta.finish_reason
        finish = "null" if reason is None else encode_basestring_ascii(reason)
        return (
            f'{self._head}{index}{self._opening}{text}, "finish_reason": {finish}{self._tail}'
        ).encode()

    def _tool_chunk(self, delta: StreamDelta, index: int, logprobs: dict[str, Any] | None) -> bytes:
        assert self.tools is not None
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = self.tools.stream()
        fields, reason = stream.feed(delta.text) or {}, delta.finish_reason
        if reason is not None:
            last, reason = stream.end(reason)
            for key, value in (last or {}).items():
                fields[key] = fields.get(key, type(value)()) + value  # content, tool_calls
        if not fields and reason is None and logprobs is None:
            return b""
        return self._chunk(fields, index, reason, logprobs)

    def _chunk(
        self,
        fields: dict[str, Any],
        index: int,
        reason: str | None,
        logprobs: dict[str, Any] | None,
    ) -> bytes:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = fields if index in self.started else {**fields, "role": "assistant"}
            self.started.add(index)
        else:
            choice["text"] = fields["content"]
        choice.update(finish_reason=reason, logprobs=logprobs)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return event({**self._base(obj), "choices": [choice]})

    def usage_event(self, usage: Usage) -> bytes:
        """The last chunk of a stream that asked for usage (no choices)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return event({**self._base(obj), "choices": [], "usage": usage_object(usage)})


def usage_object(u: Usage) -> dict[str, Any]:
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }
    if u.max_tokens_capped is not None:  # overload: the router lowered max_tokens
        out["max_tokens_capped"] = u.max_tokens_capped
    return out


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
