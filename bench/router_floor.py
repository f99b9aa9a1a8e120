"""The floor a front door's library sets under the router's door delay.

A bare server of the library (grpc.aio for gRPC, aiohttp for HTTP/SSE), no
router: ``concurrency`` streams are woken together every 10 ms (as one token
batch from decode wakes them) and each writes one chunk the size of a token
delta; the time from the wake-up to the write having returned is what the
library alone costs. Clients run in another process (pinned to the other
cores when the server is pinned), with the same client libraries as the load.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

STEP_S = 0.01  # between two wake-ups, as between two decode steps
_SSE_CHUNK = {
    "id": "cmpl-r",
    "object": "text_completion",
    "created": 0,
    "model": "tiny",
    "system_fingerprint": None,
    "choices": [{"index": 0, "text": "ab", "finish_reason": None, "logprobs": None}],
}


def percentile(values: list[float], p: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(p * len(data)))]


class _Waker:
    """Streams park on a future each step; the driver wakes all of them at once."""

    def __init__(self, concurrency: int, steps: int) -> None:
        self.concurrency, self.steps = concurrency, steps
        self.waiters: list[asyncio.Future[float]] = []
        self.parked = asyncio.Event()  # every stream waits for the next step
        self.delays: list[float] = []

    async def next_step(self) -> float:
        """Park until the driver wakes this step; returns when it did."""
        woken = asyncio.get_running_loop().create_future()
        self.waiters.append(woken)
        if len(self.waiters) == self.concurrency:
            self.parked.set()
        return await woken

    async def drive(self) -> None:
        for _ in range(self.steps):
            await self.parked.wait()
            self.parked.clear()
            woken, self.waiters = self.waiters, []
            now = time.monotonic()
            for future in woken:
                future.set_result(now)
            await asyncio.sleep(STEP_S)


async def _grpc_server(waker: _Waker) -> tuple[Any, int]:
    import grpc

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb

    async def generate(request: Any, context: Any) -> Any:
        for _ in range(waker.steps):
            ready_at = await waker.next_step()
            yield pb.CompletionChunk(request_id="r", text="ab", token_ids=[1], model="tiny")
            waker.delays.append(time.monotonic() - ready_at)

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        generate,
        request_deserializer=pb.CompletionRequest.FromString,
        response_serializer=pb.CompletionChunk.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.v1.Completion", {"Generate": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _http_server(waker: _Waker) -> tuple[Any, int]:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for _ in range(waker.steps):
            ready_at = await waker.next_step()
            await response.write(b"data: " + json.dumps(_SSE_CHUNK).encode() + b"\n\n")
            waker.delays.append(time.monotonic() - ready_at)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server: Any = site._server
    return runner, server.sockets[0].getsockname()[1]


def _grpc_clients(port: int, concurrency: int) -> None:
    import grpc

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    stub = pb_grpc.CompletionStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def one() -> None:
        for _ in stub.Generate(pb.CompletionRequest(prompt="x")):
            pass

    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _http_clients(port: int, concurrency: int) -> None:
    import aiohttp

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one() -> None:
                url = f"http://127.0.0.1:{port}/v1/completions"
                async with session.post(url, json={"prompt": "x", "stream": True}) as resp:
                    async for _ in resp.content:
                        pass

            await asyncio.gather(*(one() for _ in range(concurrency)))

    asyncio.run(main())


def _clients(protocol: str, port: int, concurrency: int, cpus: set[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    (_grpc_clients if protocol == "grpc" else _http_clients)(port, concurrency)


async def _serve_floor(
    protocol: str, concurrency: int, steps: int, others: set[int] | None
) -> list[float]:
    waker = _Waker(concurrency, steps)
    start: Callable[[_Waker], Any] = _grpc_server if protocol == "grpc" else _http_server
    server, port = await start(waker)
    ctx = multiprocessing.get_context("spawn")
    clients = ctx.Process(target=_clients, args=(protocol, port, concurrency, others))
    clients.start()
    await waker.drive()
    await asyncio.to_thread(clients.join)
    if protocol == "grpc":
        await server.stop(None)
    else:
        await server.cleanup()
    return waker.delays


def library_floor(
    protocol: str, concurrency: int, steps: int, router_cpu: int | None
) -> dict[str, float]:
    """p50/p99 (µs) from a wake-up to the chunk written, on the bare ``protocol`` server
    (``router_cpu``: the server on that core, the clients on the others)."""
    mine = os.sched_getaffinity(0)
    others = None if router_cpu is None else mine - {router_cpu}
    if router_cpu is not None:
        os.sched_setaffinity(0, {router_cpu})
    try:
        delays = asyncio.run(_serve_floor(protocol, concurrency, steps, others))
    finally:
        os.sched_setaffinity(0, mine)
    return {
        "p50": round(percentile(delays, 0.5) * 1e6, 1),
        "p99": round(percentile(delays, 0.99) * 1e6, 1),
    }
