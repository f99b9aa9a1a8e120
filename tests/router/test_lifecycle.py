"""The attempt lifecycle's release paths, with stand-in instances (no Ray, no engine):
quarantine, a hedge that cannot start, a client that leaves while pages are being
reserved or while a moved request waits for a pair, and a stream that goes silent."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.core.errors import OverloadedError, RequestAbortedError, RequestFailedError
from pdserve.core.messages import Reservation
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.placement import CompletionInput
from pdserve.router.router import InstanceInfo, Router
from pdserve.router.stream import RequestStream, StreamFailed
from tests.fakes import FakeActor

INPUT = CompletionInput("c", list(range(40)), SamplingParams(max_tokens=4), None)


def decode(name: str, delay_s: float = 0.0, refuse: bool = False) -> FakeActor:
    """A decode instance that prefills every prompt itself (no prefill instance involved)."""

    def reserve(request, prefill_id, sink) -> Reservation:  # type: ignore[no-untyped-def]
        time.sleep(delay_s)
        if refuse:
            raise OverloadedError("no room", retry_after_s=0.5)
        return Reservation(request.request_id, name, [], 0, 30.0, local=True)

    return FakeActor(reserve=reserve, abort=lambda rid: True)


def router_with(config: RouterConfig, **decodes: FakeActor) -> Router:
    router = Router(config, None, None)
    for name, handle in decodes.items():
        router.register(InstanceInfo(name, "decode", "local", handle, 16, 4096))
    return router


def stream(params: SamplingParams = INPUT.params) -> RequestStream:
    return RequestStream("c.1", INPUT.prompt_token_ids, params, None)


def test_a_request_in_flight_on_two_instances_that_died_is_quarantined() -> None:
    router = router_with(RouterConfig(auth_disabled=True), d1=decode("d1"), d2=decode("d2"))

    async def run() -> RequestStream:
        s = stream()
        await router.attempts.launch(s, INPUT, router.chooser.choose(INPUT), 0)
        for _ in range(2):
            (attempt,) = router.attempts.live.values()
            assert attempt.decode is not None
            router.instance_lost(attempt.decode.instance_id)  # moved, then moved no more
            await asyncio.sleep(0.2)
        return s

    s = asyncio.run(run())
    with pytest.raises(RequestFailedError, match="not retried again"):
        asyncio.run(_drain(s))
    assert not router.attempts.live


async def _drain(s: RequestStream) -> None:
    async for _ in s.deltas():
        pass


def test_a_hedge_that_cannot_start_leaves_the_first_attempt_alone() -> None:
    first_decode, refusing = decode("d1"), decode("d2", refuse=True)
    config = RouterConfig(auth_disabled=True, hedge_after_s=0.01, retry_budget_ratio=0.0)
    router = router_with(config, d1=first_decode)

    async def run() -> None:
        s = stream()
        first = await router.attempts.launch(s, INPUT, router.chooser.choose(INPUT), 0)
        router.unregister("d1")  # the hedge can only go to the instance that refuses
        router.register(InstanceInfo("d2", "decode", "local", refusing, 16, 4096))
        await router.attempts.hedge(first, {})
        assert list(router.attempts.live) == [first.attempt_id] and not first.closed

    asyncio.run(run())
    assert not first_decode.called("abort")


def test_pages_reserved_for_a_client_that_left_meanwhile_are_freed() -> None:
    slow = decode("d1", delay_s=0.3)
    router = router_with(RouterConfig(auth_disabled=True), d1=slow)

    async def run() -> None:
        s = stream()
        task = asyncio.ensure_future(
            router.attempts.launch(s, INPUT, router.chooser.choose(INPUT), 0)
        )
        await asyncio.sleep(0.05)  # the reservation is being made
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # the reservation returns; its pages must go

    asyncio.run(run())
    assert [args[0] for args in slow.called("abort")] == ["c.1"]
    assert not router.attempts.live and router.tables()["instance_inflight"] == 0


def test_a_moved_request_whose_client_left_meanwhile_leaves_nothing_running() -> None:
    """The client leaves while the moved request's new reservation is being made."""
    slow = decode("d1", delay_s=0.3)
    router = router_with(RouterConfig(auth_disabled=True), d1=slow)

    async def run() -> None:
        s = stream()
        moving = asyncio.ensure_future(router.attempts._relaunch(s, INPUT))
        await asyncio.sleep(0.1)
        s.fail(RequestAbortedError("the client left"))
        await asyncio.wait_for(moving, 2.0)

    asyncio.run(run())
    assert not router.attempts.live and router.tables()["instance_inflight"] == 0
    assert [args[0] for args in slow.called("abort")] == ["c.1"]


def test_a_stream_with_no_token_for_its_idle_timeout_fails() -> None:
    s = RequestStream("c.1", [1, 2, 3], SamplingParams(), None, idle_timeout_s=0.05)
    with pytest.raises(StreamFailed, match=r"no token for 0\.05 s"):
        asyncio.run(_drain(s))


def test_a_drain_timeout_moves_a_request_and_aborts_it_there_without_counting_a_loss() -> None:
    d1, d2 = decode("d1"), decode("d2")
    router = router_with(RouterConfig(auth_disabled=True, max_migrations=3), d1=d1, d2=d2)

    async def run() -> RequestStream:
        s = stream()
        await router.attempts.launch(s, INPUT, router.chooser.choose(INPUT), 0)
        for _ in range(2):  # a lost instance's request is quarantined at the second move
            (attempt,) = router.attempts.live.values()
            assert attempt.decode is not None
            router.set_draining(attempt.decode.instance_id, True)
            assert router.drain_timed_out(attempt.decode.instance_id) == 1
            await asyncio.sleep(0.2)
            router.set_draining(attempt.decode.instance_id, False)
        return s

    s = asyncio.run(run())
    (attempt,) = router.attempts.live.values()
    assert not s.finished and s.instance_losses == 0 and s.migrations == 2
    assert attempt.attempt_id == "c.1#2" and attempt.decode is not None
    aborted = [args[0] for args in d1.called("abort") + d2.called("abort")]
    assert sorted(aborted) == ["c.1", "c.1#1"]  # each attempt aborted where it was left


def test_a_request_moved_off_a_region_drained_to_zero_waits_for_its_cold_start() -> None:
    router = router_with(RouterConfig(auth_disabled=True), d1=decode("d1"))
    asked: list[tuple[str, tuple[str, ...]]] = []
    router.cold.demand = lambda region, roles: asked.append((region, roles))

    async def run() -> RequestStream:
        s = stream()
        await router.attempts.launch(s, INPUT, router.chooser.choose(INPUT), 0)
        router.set_draining("d1", True)  # scaled to zero: the last decode drains
        assert router.drain_timed_out("d1") == 1
        await asyncio.sleep(0.2)
        assert asked == [("local", ("decode",))] and not router.attempts.live
        router.unregister("d1")
        router.register(InstanceInfo("d2", "decode", "local", decode("d2"), 16, 4096))
        await asyncio.sleep(0.2)
        return s

    s = asyncio.run(run())
    (attempt,) = router.attempts.live.values()
    assert not s.finished and attempt.decode is not None and attempt.decode.instance_id == "d2"
