"""The load generator: sends a workload to a serving endpoint on its schedule.

Open loop: request ``i`` is sent ``arrival_s`` after the run starts, whatever
the server is doing, unless ``max_concurrency`` requests are already in flight,
in which case it waits for a slot (its record keeps both the scheduled and the
actual send time). Warm-up requests go first, all at once within the
concurrency limit, and are not recorded.

A client streams one request and calls ``on_chunk(tokens)`` as each chunk
arrives (``None`` when the protocol does not say how many tokens a chunk holds);
it returns the output length the server reported, if it did, and raises
:class:`RequestFailed` with the server's message on an error. Clients:

- :class:`GrpcClient`: ``pdserve.v1.Completion/Generate`` over ``grpc.aio``;
- :class:`HttpClient`: OpenAI ``POST /v1/completions`` with ``"stream": true`` (SSE).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.bench.report import RequestRecord, make_record
from pdserve.bench.workload import RequestSpec
from pdserve.core.errors import InvalidArgumentError

OnChunk = Callable[[int | None], None]


class RequestFailed(Exception):
    """The server refused or failed a request; the message says how."""


class Client(Protocol):
    async def generate(self, spec: RequestSpec, on_chunk: OnChunk) -> int | None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class LoadOptions:
    """How the load is applied.

    Attributes:
        max_concurrency: most requests in flight (None: no limit, a pure open loop).
        request_timeout_s: a request still streaming after this long fails (inf: never).
        progress: show a tqdm progress bar.
    """

    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidArgumentError(
                "max_concurrency", f"must be >= 1, got {self.max_concurrency}"
            )
        if not self.request_timeout_s > 0:
            raise InvalidArgumentError(
                "request_timeout", f"must be > 0, got {self.request_timeout_s}"
            )


def no_deadline(timeout_s: float) -> float | None:
    """``timeout_s``, or None (no deadline) for an infinite one."""
    return timeout_s if math.isfinite(timeout_s) else None


class GrpcClient:
    def __init__(
        self, address: str, api_key: str | None, model: str, temperature: float, timeout_s: float
    ) -> None:
        import grpc

        from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
        from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

        self._grpc, self._pb = grpc, pb
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.CompletionStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.model = model
        self.temperature = temperature
        self.timeout_s = no_deadline(timeout_s)  # gRPC takes an infinite one as already past

    async def model_name(self) -> str:
        try:
            reply = await self.stub.ListModels(
                self._pb.ListModelsRequest(), metadata=self.metadata, timeout=30
            )
        except self._grpc.aio.AioRpcError as e:
            raise RequestFailed(f"{e.code().name}: {e.details()}") from None
        return str(reply.models[0].id)

    async def generate(self, spec: RequestSpec, on_chunk: OnChunk) -> int | None:
        pb = self._pb
        request = pb.CompletionRequest(
            model=self.model,
            sampling=pb.SamplingOptions(
                max_tokens=spec.max_tokens, temperature=self.temperature, ignore_eos=True
            ),
        )
        if spec.prompt_token_ids is not None:
            request.prompt_token_ids.CopyFrom(pb.TokenIds(ids=spec.prompt_token_ids))
        else:
            request.prompt = spec.prompt_text or ""
        reported: int | None = None
        try:
            call = self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout_s)
            async for chunk in call:
                on_chunk(len(chunk.token_ids))
                if chunk.finish_reason and chunk.HasField("usage"):
                    reported = chunk.usage.completion_tokens
        except self._grpc.aio.AioRpcError as e:
            raise RequestFailed(f"{e.code().name}: {e.details()}") from None
        return reported

    async def close(self) -> None:
        await self.channel.close()


class HttpClient:
    """OpenAI completions over SSE. Chunks carry text, not token ids, so their token
    counts are unknown; the usage in the last chunk gives the total."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        model: str,
        temperature: float,
        timeout_s: float,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        """``extra_body``: fields every request carries (e.g. ``{"priority": -1}``)."""
        import aiohttp

        self._aiohttp = aiohttp
        self.extra_body = dict(extra_body or {})
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=no_deadline(timeout_s)),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.model = model
        self.temperature = temperature

    async def model_name(self) -> str:
        try:
            async with self.session.get(f"{self.base_url}/v1/models", headers=self.headers) as r:
                text = await r.text()
                if r.status != 200:
                    raise RequestFailed(f"HTTP {r.status}: {_error_message(text)}")
                return str(json.loads(text)["data"][0]["id"])
        except (self._aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
            raise RequestFailed(f"{type(e).__name__}: {e}") from None

    async def generate(self, spec: RequestSpec, on_chunk: OnChunk) -> int | None:
        body = {
            "model": self.model,
            "prompt": list(spec.prompt_token_ids)
            if spec.prompt_token_ids is not None
            else spec.prompt_text,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        reported: int | None = None
        url = f"{self.base_url}/v1/completions"
        try:
            async with self.session.post(url, json=body, headers=self.headers) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    raise RequestFailed(f"HTTP {resp.status}: {_error_message(text)}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    payload = json.loads(data)
                    if "error" in payload:
                        raise RequestFailed(_error_message(payload))
                    if payload.get("choices"):
                        on_chunk(None)
                    if payload.get("usage"):
                        reported = int(payload["usage"]["completion_tokens"])
        except (self._aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise RequestFailed(f"{type(e).__name__}: {e}") from None
        return reported

    async def close(self) -> None:
        await self.session.close()


def _error_message(body: Any) -> str:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body[:200]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)[:200]


async def open_client(
    target: str,
    api_key: str | None = None,
    model: str | None = None,
    temperature: float = 0.0,
    timeout_s: float = 600.0,
) -> GrpcClient | HttpClient:
    """A client for ``grpc://HOST:PORT`` or ``http://HOST:PORT``; asks the server for
    its model name when none is given."""
    if target.startswith("grpc://"):
        client: GrpcClient | HttpClient = GrpcClient(
            target.removeprefix("grpc://"), api_key, model or "", temperature, timeout_s
        )
    elif target.startswith(("http://", "https://")):
        client = HttpClient(target, api_key, model or "", temperature, timeout_s)
    else:
        raise InvalidArgumentError(
            "target", f"must be grpc://HOST:PORT or http://HOST:PORT, got {target!r}"
        )
    if not model:
        try:
            client.model = await client.model_name()
        except RequestFailed as e:
            await client.close()
            raise InvalidArgumentError(
                "target", f"{target} did not name its model ({e}); is pdserve serving there?"
            ) from None
    return client


async def run_load(
    client: Client,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec] = (),
    options: LoadOptions | None = None,
    label: str = "",
) -> list[RequestRecord]:
    """Send ``warmup`` (unrecorded), then ``specs`` on their schedule; one record each."""
    from tqdm import tqdm

    options = options or LoadOptions()
    slots = asyncio.Semaphore(options.max_concurrency or max(1, len(specs) + len(warmup)))
    if warmup:
        await asyncio.gather(*(_one(client, spec, slots, time.perf_counter()) for spec in warmup))
    bar = tqdm(total=len(specs), desc=label or "requests", unit="req", disable=not options.progress)
    start = time.perf_counter()

    async def scheduled(spec: RequestSpec) -> RequestRecord:
        delay = start + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = await _one(client, spec, slots, start)
        bar.update(1)
        return record

    try:
        return list(await asyncio.gather(*(scheduled(spec) for spec in specs)))
    finally:
        bar.close()


async def _one(
    client: Client, spec: RequestSpec, slots: asyncio.Semaphore, start: float
) -> RequestRecord:
    async with slots:
        times: list[float] = []
        counts: list[int | None] = []
        sent = time.perf_counter()

        def on_chunk(tokens: int | None) -> None:
            times.append(time.perf_counter() - sent)
            counts.append(tokens)

        try:
            reported = await client.generate(spec, on_chunk)
        except Exception as e:  # one broken stream is a failed request, not a failed run
            error = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
            return RequestRecord(
                spec.index,
                spec.arrival_s,
                sent - start,
                spec.prompt_len,
                spec.max_tokens,
                ok=False,
                error=error,
                e2e_s=time.perf_counter() - sent,
            )
        e2e = time.perf_counter() - sent
        return make_record(
            spec.index,
            spec.arrival_s,
            sent - start,
            spec.prompt_len,
            spec.max_tokens,
            times,
            counts,
            e2e,
            reported,
        )
