"""A front door whose port is taken refuses to start, naming the config field;
gRPC's default SO_REUSEPORT would have let two clusters share one port."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.grpc_service import start_grpc
from pdserve.router.frontdoor.http_api import HttpApi, start_http
from pdserve.router.router import Router


def _router() -> Router:
    return Router(RouterConfig(model_name="tiny", auth_disabled=True), None, None, vocab_size=100)


def test_a_second_grpc_door_on_a_taken_port_is_refused() -> None:
    async def go() -> None:
        router, keys = _router(), ApiKeys((), True)
        first, port = await start_grpc(router, keys, "127.0.0.1", 0)
        try:
            with pytest.raises(InvalidArgumentError, match=rf"server.grpc_port: .*:{port}: the"):
                await start_grpc(router, keys, "127.0.0.1", port)
        finally:
            await first.stop(None)

    asyncio.run(go())


def test_an_http_door_on_a_taken_port_is_refused() -> None:
    async def go() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            api = HttpApi(_router(), ApiKeys((), True), 1 << 20)
            with pytest.raises(
                InvalidArgumentError, match=rf"server.http_port: .*:{port}: the port is taken"
            ):
                await start_http(api, "127.0.0.1", port)

    asyncio.run(go())
