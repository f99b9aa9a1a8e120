"""The HTTP front door's stream events: OpenAI's chunk objects, as the openai client reads them."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from pdserve.router.frontdoor.sse import ResponseShape
from pdserve.router.stream import StreamDelta, Usage

TEXTS = ["Hello", ' a "quoted"\\ word\n', "naïve ☃ 😀", "", "\x00\x1f\t</script>"]


def _data(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[len(b"data: ") : -2])


@pytest.mark.parametrize("chat", [False, True])
def test_chunk_events_are_the_chunk_objects_as_json(chat: bool) -> None:
    shape = ResponseShape("req-1", "tiny", chat, "tiny@v2")
    deltas = [StreamDelta([i], text) for i, text in enumerate(TEXTS)]
    deltas.append(StreamDelta([9], "end", "length", Usage(5, 6)))
    kind = "chat.completion.chunk" if chat else "text_completion"
    for n, delta in enumerate(deltas):
        event = shape.chunk_event(delta)
        if chat:
            content = {"content": delta.text, **({"role": "assistant"} if n == 0 else {})}
            choice = {
                "index": 0,
                "delta": content,
                "finish_reason": delta.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {
                "index": 0,
                "text": delta.text,
                "finish_reason": delta.finish_reason,
                "logprobs": None,
            }
        want = {
            "id": ("chatcmpl-" if chat else "cmpl-") + "req-1",
            "object": kind,
            "created": shape.created,
            "model": "tiny",
            "system_fingerprint": "tiny@v2",
            "choices": [choice],
        }
        assert event == b"data: " + json.dumps(want).encode() + b"\n\n"
        if not chat and delta.finish_reason is None:
            continue  # the openai client reads these unvalidated (its type wants a reason)
        parsed = (ChatCompletionChunk if chat else Completion).model_validate(_data(event))
        got = parsed.choices[0]
        assert (got.delta.content if chat else got.text) == delta.text  # type: ignore[union-attr]
        assert got.finish_reason == delta.finish_reason


def test_usage_event_has_no_choices_and_counts_the_tokens() -> None:
    shape = ResponseShape("req-2", "tiny", True)
    data = _data(shape.usage_event(Usage(7, 3, cached_prompt_tokens=4)))
    chunk = ChatCompletionChunk.model_validate(data)
    assert chunk.choices == [] and data["system_fingerprint"] is None
    assert chunk.usage is not None and chunk.usage.total_tokens == 10
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
