"""``n`` choices of one completion request: ``n`` requests through the router, one stream.

OpenAI's ``n`` asks for several completions of one prompt. Each choice is a
request of its own to the router (admitted, placed and counted like any other).
They arrive together, so most are prefilled before another's blocks are in the
prefix cache: ``n`` choices cost up to ``n`` prefills (forking one prefill's KV
into ``n`` decodes is not done). A request with a ``seed`` gives
choice ``i`` the seed ``seed + i``, so every choice is reproducible and they
differ; without one each choice draws its own noise. Greedy choices are equal.

Their deltas are merged in the order they arrive, each with its choice's index.
If any choice fails, the others are aborted and the request fails as one would;
a client that leaves aborts them all. Usage counts the prompt once and every
choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.placement import CompletionInput
from pdserve.router.stream import StreamDelta, Usage

MAX_N = 64  # choices one request may ask for
_SEEDS = 1 << 63


def choice_count(value: Any) -> int:
    """The request's ``n`` (1 when absent), checked."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N:
        raise InvalidArgumentError("n", f"must be an integer in [1, {MAX_N}], got {value!r}")
    return value


def fan_out(inp: CompletionInput, n: int) -> list[CompletionInput]:
    """One input per choice: choice ``i`` of a seeded request has the seed ``seed + i``."""
    seed = inp.params.seed
    if seed is None:
        return [inp] * n
    return [
        dataclasses.replace(inp, params=dataclasses.replace(inp.params, seed=(seed + i) % _SEEDS))
        for i in range(n)
    ]


async def merged(
    inputs: list[CompletionInput],
    stream: Callable[[CompletionInput], AsyncGenerator[StreamDelta, None]],
) -> AsyncGenerator[tuple[int, StreamDelta], None]:
    """(choice index, delta) of every choice's stream as they come; the first error of
    any choice is raised here once the others are aborted."""
    if len(inputs) == 1:  # no tasks for the common case
        async with contextlib.aclosing(stream(inputs[0])) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    # bounded: a client that reads slowly holds back every choice, as it would one
    queue: asyncio.Queue[tuple[int, StreamDelta | None, BaseException | None]]
    queue = asyncio.Queue(maxsize=4 * len(inputs))

    async def pump(i: int, inp: CompletionInput) -> None:
        try:
            async with contextlib.aclosing(stream(inp)) as deltas:
                async for delta in deltas:
                    await queue.put((i, delta, None))
        except Exception as e:
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, inp)) for i, inp in enumerate(inputs)]
    try:
        running = len(tasks)
        while running:
            i, got, error = await queue.get()
            if error is not None:
                raise error
            if got is None:
                running -= 1
            else:
                yield i, got
    finally:  # done, failed, or the client left: abort what still runs
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(usages: list[Usage]) -> Usage:
    """The prompt counted once (every choice has the same), every choice's tokens."""
    first = usages[0]
    capped = [u.max_tokens_capped for u in usages if u.max_tokens_capped is not None]
    return Usage(
        first.prompt_tokens,
        sum(u.completion_tokens for u in usages),
        first.cached_prompt_tokens,
        min(capped) if capped else None,
    )
