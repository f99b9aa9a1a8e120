"""The gRPC front door: ``pdserve.v1.Completion`` and ``grpc.health.v1.Health`` on grpc.aio.

Errors leave through :func:`~pdserve.core.errors.wire_status` (the one table of
status codes); an overload adds trailing metadata ``retry-after`` (seconds).
A client that cancels a ``Generate`` stream cancels the handler, which aborts
the request on its instances.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.core.errors import OverloadedError, wire_status
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc
from pdserve.router.frontdoor.requests import completion_input, prompt_tokens, sampling_params
from pdserve.router.router import CompletionInput, Router
from pdserve.router.stream import StreamDelta, Usage

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Completion"
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens")


class CompletionService(pb_grpc.CompletionServicer):
    def __init__(self, router: Router, keys: ApiKeys, vocab_size: int) -> None:
        self.router = router
        self.keys = keys
        self.vocab_size = vocab_size

    async def Generate(
        self, request: pb.CompletionRequest, context: Any
    ) -> AsyncIterator[pb.CompletionChunk]:
        try:
            inp = self._admit(request, context)
            async with contextlib.aclosing(self.router.stream(inp)) as deltas:
                async for delta in deltas:
                    yield _chunk(inp.request_id, delta)
                    self.router.delivered(delta)
        except Exception as e:
            await _abort(context, e)

    async def Complete(self, request: pb.CompletionRequest, context: Any) -> pb.CompletionResponse:
        try:
            inp = self._admit(request, context)
            text, ids, reason, usage = [], [], "", Usage(0, 0)
            async with contextlib.aclosing(self.router.stream(inp)) as deltas:
                async for delta in deltas:
                    text.append(delta.text)
                    ids.extend(delta.token_ids)
                    if delta.finish_reason is not None:
                        reason, usage = delta.finish_reason, delta.usage or usage
            return pb.CompletionResponse(
                request_id=inp.request_id,
                text="".join(text),
                token_ids=ids,
                finish_reason=reason,
                usage=_usage(usage),
            )
        except Exception as e:
            await _abort(context, e)
            raise  # unreachable: abort raises

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Any
    ) -> pb.ListModelsResponse:
        try:
            self.keys.check(_metadata(context).get("authorization"))
        except Exception as e:
            await _abort(context, e)
        model = pb.Model(
            id=self.router.config.model_name,
            max_model_len=self.router.max_model_len,
            owned_by="pdserve",
        )
        return pb.ListModelsResponse(models=[model])

    def _admit(self, request: pb.CompletionRequest, context: Any) -> CompletionInput:
        try:
            return self._parse(request, context)
        except Exception as e:
            self.router.reject(e)
            raise

    def _parse(self, request: pb.CompletionRequest, context: Any) -> CompletionInput:
        meta = _metadata(context)
        self.keys.check(meta.get("authorization"))
        from pdserve.core.errors import InvalidArgumentError

        if request.model and request.model != self.router.config.model_name:
            raise InvalidArgumentError("model", f"unknown model {request.model!r}")
        which = request.WhichOneof("input")
        prompt: str | list[int] | None
        if which == "prompt":
            prompt = request.prompt
        elif which == "prompt_token_ids":
            prompt = list(request.prompt_token_ids.ids)
        else:
            prompt = None
        ids = prompt_tokens(
            self.router.tokenizer, prompt, self.router.max_model_len, self.vocab_size
        )
        params = _sampling(request.sampling if request.HasField("sampling") else None)
        region = request.region or meta.get("x-pdserve-region")
        return completion_input(ids, params, region, request.request_id or None)


def _sampling(s: pb.SamplingOptions | None) -> SamplingParams:
    if s is None:
        return sampling_params({})
    values: dict[str, Any] = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    if s.stop:
        values["stop"] = list(s.stop)
    if s.stop_token_ids:
        values["stop_token_ids"] = list(s.stop_token_ids)
    values["ignore_eos"] = s.ignore_eos
    return sampling_params(values)


def _metadata(context: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ())}


def _usage(u: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
    )


def _chunk(request_id: str, delta: StreamDelta) -> pb.CompletionChunk:
    chunk = pb.CompletionChunk(request_id=request_id, text=delta.text, token_ids=delta.token_ids)
    if delta.finish_reason is not None:
        chunk.finish_reason = delta.finish_reason
        if delta.usage is not None:
            chunk.usage.CopyFrom(_usage(delta.usage))
    return chunk


async def _abort(context: Any, error: BaseException) -> None:
    status = wire_status(error)
    if status.grpc_code == "INTERNAL":
        logger.exception("internal error serving a request", exc_info=error)
    if isinstance(error, OverloadedError):
        context.set_trailing_metadata((("retry-after", f"{error.retry_after_s:g}"),))
    await context.abort(getattr(grpc.StatusCode, status.grpc_code), status.message)


async def start_grpc(
    router: Router, keys: ApiKeys, vocab_size: int, host: str, port: int
) -> tuple[Any, int]:
    """Serve the completion and health services; returns (server, bound port)."""
    server = grpc.aio.server()
    pb_grpc.add_CompletionServicer_to_server(CompletionService(router, keys, vocab_size), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
