"""A key's priority is its requests' default and their ceiling, on both doors: a
request may yield below it but not rise above it. A request that passes meets a
router with no instance (refused for load); one that asks too much never does."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.grpc_service import start_grpc
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc
from pdserve.router.router import Router
from tests.frontdoor.test_lora_http import _run


def _keys() -> ApiKeys:
    return ApiKeys(("batch", "online"), False, (("batch", -1),))


@pytest.mark.parametrize(
    ("key", "priority", "status"),
    [("batch", None, 429), ("batch", -1, 429), ("batch", -5, 429), ("batch", 0, 403),
     ("batch", 1000, 403), ("online", 1000, 429)],
)  # fmt: skip
def test_http(key: str, priority: int | None, status: int) -> None:
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
    if priority is not None:
        body["priority"] = priority
    ((got, answer),), _ = _run([("POST", "/v1/completions", body)], _keys(), key)
    assert got == status, answer
    if status == 403:
        assert "may send priority -1 at most" in answer["error"]["message"]


def test_grpc() -> None:
    async def go() -> list[grpc.StatusCode]:
        router = Router(RouterConfig(model_name="tiny", api_keys=("batch", "online")), None, None,
                        vocab_size=100)  # fmt: skip
        server, port = await start_grpc(router, _keys(), "127.0.0.1", 0)
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.CompletionStub(channel)
                request = pb.CompletionRequest(model="tiny", prompt_token_ids=pb.TokenIds(ids=[1]))
                for key, priority in (("batch", None), ("batch", "-3"), ("batch", "2"),
                                      ("online", "2")):  # fmt: skip
                    meta = [("authorization", f"Bearer {key}")]
                    if priority is not None:
                        meta.append(("x-pdserve-priority", priority))
                    try:
                        await stub.Complete(request, metadata=meta, timeout=10)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
        finally:
            await server.stop(None)
        return codes

    exhausted, denied = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED
    assert asyncio.run(go()) == [exhausted, exhausted, denied, exhausted]
