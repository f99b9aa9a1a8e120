"""Token batches at the router: one decode step's tokens for many streams, fanned out
with one delta and one wake-up per stream; deltas a busy consumer left pile into one;
stop strings inside a batch; the idle timer while tokens keep coming."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.core.messages import Reservation, TokenBatch, TokenUpdate
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer
from pdserve.models.builtin import resolve_model
from pdserve.router.config import RouterConfig
from pdserve.router.placement import CompletionInput
from pdserve.router.router import InstanceInfo, Router
from pdserve.router.stream import RequestStream, StreamDelta
from tests.fakes import FakeActor

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def local_decode(name: str) -> FakeActor:
    """A decode instance that prefills every prompt itself: all tokens come from it."""

    def reserve(request, prefill_id, sink) -> Reservation:  # type: ignore[no-untyped-def]
        return Reservation(request.request_id, name, [], 0, 30.0, local=True)

    return FakeActor(reserve=reserve, abort=lambda rid: True)


def test_one_batch_for_several_streams_wakes_each_once_with_its_tokens_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: dict[str, int] = {}
    wait = RequestStream._wait

    async def counted(self: RequestStream) -> None:
        waits[self.request_id] = waits.get(self.request_id, 0) + 1
        await wait(self)

    monkeypatch.setattr(RequestStream, "_wait", counted)
    router = Router(RouterConfig(auth_disabled=True), None, None)
    router.register(InstanceInfo("d1", "decode", "local", local_decode("d1"), 16, 4096))

    async def run() -> dict[str, list[StreamDelta]]:
        streams = {}
        for name in ("a", "b", "c"):
            inp = CompletionInput(name, [1, 2, 3], PARAMS, None)
            s = RequestStream(name, inp.prompt_token_ids, PARAMS, None)
            await router.attempts.launch(s, inp, router.chooser.choose(inp), 0)
            streams[name] = s
        got: dict[str, list[StreamDelta]] = {name: [] for name in streams}

        async def consume(name: str) -> None:
            async for delta in streams[name].deltas():
                got[name].append(delta)

        tasks = [asyncio.ensure_future(consume(name)) for name in streams]
        await asyncio.sleep(0.01)  # every consumer waits
        router.on_tokens(
            TokenBatch(
                "d1",
                [
                    TokenUpdate("a", [10, 11, 12], "", False, None, 3),
                    TokenUpdate("b", [20, 21], "", False, None, 2),
                    TokenUpdate("c", [30, 31, 32, 33], "", True, "length", 4),
                ],
            )
        )
        await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return got

    got = asyncio.run(run())
    assert [d.token_ids for d in got["a"]] == [[10, 11, 12]]
    assert [d.token_ids for d in got["b"]] == [[20, 21]]
    assert [d.token_ids for d in got["c"]] == [[30, 31, 32, 33]]
    assert got["c"][0].finish_reason == "length"
    assert got["c"][0].usage is not None and got["c"][0].usage.completion_tokens == 4
    # a and b: woken once, waiting again; c finished after its one wake-up.
    assert waits == {"a": 2, "b": 2, "c": 1}


def test_deltas_a_busy_consumer_left_leave_as_one_in_order() -> None:
    s = RequestStream("r", [1], PARAMS, None)
    s.add(2, [12, 13])  # out of order: held until 0 and 1 are in
    s.add(0, [10, 11])
    s.add(4, [14])
    s.add(5, [15], "length")

    async def drain() -> list[StreamDelta]:
        return [d async for d in s.deltas()]

    (delta,) = asyncio.run(drain())
    assert delta.token_ids == [10, 11, 12, 13, 14, 15]
    assert delta.finish_reason == "length"
    assert delta.usage is not None and delta.usage.completion_tokens == 6
    assert s.token_times == sorted(s.token_times) and len(s.token_times) == 6
    # One door delay per delta the stream made: the merged one carries each's time.
    assert len(delta.parts_ready_at) == 3 and delta.parts_ready_at[0] == delta.ready_at
    router = Router(RouterConfig(auth_disabled=True), None, None)
    router.delivered(delta)
    assert len(router.door_delay_s) == 3


def test_the_prompt_logprobs_stay_on_the_first_of_merged_deltas() -> None:
    s = RequestStream("r", [1, 2, 3], PARAMS, None)
    prompt = [(-1.0, [(2, -1.0)]), (-2.0, [(3, -2.0)])]
    s.take_prompt_logprobs(prompt)
    s.add(0, [10])
    s.take_prompt_logprobs([(-9.0, [])])  # another attempt's, later: the first is kept
    s.add(1, [11], "length")

    async def drain() -> list[StreamDelta]:
        return [d async for d in s.deltas()]

    (delta,) = asyncio.run(drain())
    assert delta.token_ids == [10, 11] and delta.prompt_logprobs == prompt


def test_a_stop_string_inside_a_batch_ends_the_stream_at_its_token() -> None:
    tokenizer = Tokenizer.from_dir(resolve_model("builtin:tiny"))
    ids = tokenizer.encode("hello world. the end. more text here")
    prompt, output = ids[:1], ids[1:]
    params = SamplingParams(max_tokens=32, stop=["end"])
    s = RequestStream("r", prompt, params, tokenizer)
    s.add(0, output)  # the whole output in one step

    async def drain() -> list[StreamDelta]:
        return [d async for d in s.deltas()]

    deltas = asyncio.run(drain())
    text = "".join(d.text for d in deltas)
    assert text == "hello world. the "
    assert deltas[-1].finish_reason == "stop"
    assert [t for d in deltas for t in d.token_ids] == s.tokens
    assert tokenizer.decode(s.tokens, True).endswith("end")  # cut at the token ending it
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == len(s.tokens)


def test_a_stream_that_keeps_getting_tokens_outlives_its_idle_timeout() -> None:
    s = RequestStream("r", [1], SamplingParams(max_tokens=12), None, idle_timeout_s=0.1)

    async def run() -> list[int]:
        async def feed() -> None:
            for i in range(12):
                await asyncio.sleep(0.03)  # 0.36 s in all, each gap under the timeout
                s.add(i, [100 + i], "length" if i == 11 else None)

        feeder = asyncio.ensure_future(feed())
        tokens = [t async for d in s.deltas() for t in d.token_ids]
        await feeder
        return tokens

    assert asyncio.run(run()) == [100 + i for i in range(12)]
    assert s._idle_timer is None  # cancelled when the stream finished
