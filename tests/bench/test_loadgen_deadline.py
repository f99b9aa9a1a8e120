"""``--request-timeout inf`` means no deadline, for both clients.

gRPC takes an infinite timeout as a deadline already past (every request failed at
once with DEADLINE_EXCEEDED) and aiohttp cannot convert it (OverflowError, a
traceback). Against a port nobody listens on, a request without a deadline fails
for the reason it really fails: nothing is there.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.bench.loadgen import LoadOptions, open_client, run_load
from pdserve.bench.workload import RequestSpec


@pytest.mark.parametrize("scheme, why", [("grpc", "UNAVAILABLE"), ("http", "ClientConnectorError")])
def test_an_infinite_timeout_is_no_deadline(scheme: str, why: str) -> None:
    async def one() -> str | None:
        client = await open_client(f"{scheme}://127.0.0.1:1", model="m", timeout_s=math.inf)
        try:
            options = LoadOptions(request_timeout_s=math.inf, progress=False)
            spec = RequestSpec(0, 0.0, 4, prompt_token_ids=(5, 6, 7))
            (record,) = await run_load(client, [spec], options=options)
        finally:
            await client.close()
        assert not record.ok
        return record.error

    error = asyncio.run(one())
    assert error is not None and error.startswith(why), error
