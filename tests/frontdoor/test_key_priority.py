"""A key's priority is its requests' default and their ceiling, on both doors: a
request may yield below it, and one asking for more gets the key's. The router
here has no instance (each request is then refused for load); what is checked is
the priority each request reached it with."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.grpc_service import start_grpc
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc
from pdserve.router.router import Router
from tests.frontdoor.test_lora_http import _run

# (key, priority asked, priority the router gets): batch's key is at -1; online's has none
CASES = [
    ("batch", None, -1),
    ("batch", -5, -5),
    ("batch", 0, -1),
    ("batch", 1000, -1),
    ("online", None, 0),
    ("online", 1000, 1000),
]


def _keys() -> ApiKeys:
    return ApiKeys(("batch", "online"), False, (("batch", -1),))


def test_http() -> None:
    got = []
    for key, asked, _ in CASES:
        body: dict[str, Any] = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
        if asked is not None:
            body["priority"] = asked
        ((status, _),), seen = _run([("POST", "/v1/completions", body)], _keys(), key)
        assert status == 429
        got.append(seen[0].params.priority)
    assert got == [want for *_, want in CASES]


def test_grpc() -> None:
    async def go() -> list[int]:
        router = Router(
            RouterConfig(model_name="tiny", api_keys=("batch", "online")),
            None,
            None,
            vocab_size=100,
        )
        seen: list[int] = []
        real = router.stream

        def spy(inp: Any) -> Any:
            seen.append(inp.params.priority)
            return real(inp)

        router.stream = spy  # type: ignore[method-assign]
        server, port = await start_grpc(router, _keys(), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.CompletionStub(channel)
                request = pb.CompletionRequest(model="tiny", prompt_token_ids=pb.TokenIds(ids=[1]))
                for key, asked, _ in CASES:
                    meta = [("authorization", f"Bearer {key}")]
                    if asked is not None:
                        meta.append(("x-pdserve-priority", str(asked)))
                    try:
                        await stub.Complete(request, metadata=meta, timeout=10)
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(None)
        return seen

    assert asyncio.run(go()) == [want for *_, want in CASES]
