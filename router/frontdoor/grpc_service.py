"""The gRPC front door: ``pdserve.v1.Completion`` and ``grpc.health.v1.Health`` on grpc.aio.

Errors leave through :func:`~pdserve.core.errors.wire_status` (the one table of
status codes); an overload adds trailing metadata ``retry-after`` (seconds).
A client that cancels a ``Generate`` stream cancels the handler, which aborts
the request on its instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.core.errors import InvalidArgumentError, OverloadedError, wire_status
from pdserve.core.net import host_port
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import TlsConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc
from pdserve.router.frontdoor.requests import (
    capped_priority,
    completion_input,
    fit_context,
    off_loop,
    prompt_tokens,
    sampling_params,
    with_cache_salt,
    with_priority,
)
from pdserve.router.frontdoor.tls import grpc_credentials
from pdserve.router.router import CompletionInput, Router
from pdserve.router.stream import StreamDelta, Usage

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Completion"
_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_tokens",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "json_schema",
)


class CompletionService(pb_grpc.CompletionServicer):
    def __init__(self, router: Router, keys: ApiKeys) -> None:
        self.router = router
        self.keys = keys

    async def Generate(
        self, request: pb.CompletionRequest | Malformed, context: Any
    ) -> AsyncIterator[pb.CompletionChunk]:
        try:
            inp = await self._admit(request, context)
            async with contextlib.aclosing(self.router.stream(inp)) as deltas:
                async for delta in deltas:
                    yield _chunk(inp, delta)
                    self.router.delivered(delta)
        except Exception as e:
            await _abort(context, e)

    async def Complete(
        self, request: pb.CompletionRequest | Malformed, context: Any
    ) -> pb.CompletionResponse:
        try:
            inp = await self._admit(request, context)
            text, ids, reason, usage = [], [], "", Usage(0, 0)
            logprobs: list[pb.TokenLogprob] = []
            async with contextlib.aclosing(self.router.stream(inp)) as deltas:
                async for delta in deltas:
                    text.append(delta.text)
                    ids.extend(delta.token_ids)
                    logprobs += _logprobs(delta)
                    if delta.finish_reason is not None:
                        reason, usage = delta.finish_reason, delta.usage or usage
            return pb.CompletionResponse(
                request_id=inp.request_id,
                text="".join(text),
                token_ids=ids,
                finish_reason=reason,
                usage=_usage(usage),
                model=inp.served_as,
                logprobs=logprobs,
            )
        except Exception as e:
            await _abort(context, e)
            raise  # unreachable: abort raises

    async def ListModels(
        self, request: pb.ListModelsRequest | Malformed, context: Any
    ) -> pb.ListModelsResponse:
        try:
            self.keys.check(_metadata(context).get("authorization"))
            if isinstance(request, Malformed):
                raise InvalidArgumentError(
                    "request", f"not a valid ListModelsRequest: {request.error}"
                )
        except Exception as e:
            await _abort(context, e)
        models = [
            pb.Model(id=name, max_model_len=self.router.max_model_len, owned_by="pdserve")
            for name in self.router.catalog.names()
        ]
        return pb.ListModelsResponse(models=models)

    async def _admit(
        self, request: pb.CompletionRequest | Malformed, context: Any
    ) -> CompletionInput:
        size = 0 if isinstance(request, Malformed) else len(request.prompt)
        try:
            return await off_loop(size, self._parse, request, context)
        except Exception as e:
            self.router.reject(e)
            raise

    def _parse(self, request: pb.CompletionRequest | Malformed, context: Any) -> CompletionInput:
        meta = _metadata(context)
        caller = self.keys.caller(meta.get("authorization"))
        key_priority = caller.priority
        if isinstance(request, Malformed):
            raise InvalidArgumentError("request", f"not a valid CompletionRequest: {request.error}")
        version, lora = self.router.resolve(request.model or self.router.config.model_name)
        max_len = self.router.max_model_len_of(version.key)
        which = request.WhichOneof("input")
        prompt: str | list[int] | None
        if which == "prompt":
            prompt = request.prompt
        elif which == "prompt_token_ids":
            prompt = list(request.prompt_token_ids.ids)
        else:
            prompt = None
        ids = prompt_tokens(version.tokenizer, prompt, max_len, version.vocab_size)
        sampling = request.sampling if request.HasField("sampling") else None
        params = _sampling(sampling, version.vocab_size)
        asked = sampling is not None and sampling.HasField("max_tokens")
        params = fit_context(params, len(ids), max_len, asked)
        params = dataclasses.replace(params, lora=lora)
        salt = request.cache_salt if request.HasField("cache_salt") else None
        params = with_cache_salt(params, caller.tenant, salt)
        if "x-pdserve-priority" in meta:
            params = with_priority(params, meta["x-pdserve-priority"])
        elif key_priority is not None:
            params = dataclasses.replace(params, priority=key_priority)
        params = capped_priority(params, key_priority)
        region = request.region or meta.get("x-pdserve-region")
        return completion_input(ids, params, region, request.request_id or None, version)


def _sampling(s: pb.SamplingOptions | None, vocab_size: int) -> SamplingParams:
    if s is None:
        return sampling_params({})
    values: dict[str, Any] = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    if s.stop:
        values["stop"] = list(s.stop)
    if s.stop_token_ids:
        values["stop_token_ids"] = list(s.stop_token_ids)
    values["ignore_eos"] = s.ignore_eos
    if s.logit_bias:
        values["logit_bias"] = dict(s.logit_bias)
    return sampling_params(values, vocab_size)


def _metadata(context: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ())}


def _usage(u: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
    )


def _chunk(inp: CompletionInput, delta: StreamDelta) -> pb.CompletionChunk:
    chunk = pb.CompletionChunk(
        request_id=inp.request_id,
        text=delta.text,
        token_ids=delta.token_ids,
        model=inp.served_as,
        logprobs=_logprobs(delta),
    )
    if delta.finish_reason is not None:
        chunk.finish_reason = delta.finish_reason
        if delta.usage is not None:
            chunk.usage.CopyFrom(_usage(delta.usage))
    return chunk


def _logprobs(delta: StreamDelta) -> list[pb.TokenLogprob]:
    """The delta's tokens' logprobs (none unless the request asked; NaN where an
    instance sent none for a token)."""
    if delta.logprobs is None:
        return []
    return [
        pb.TokenLogprob(token_id=token, logprob=math.nan)
        if entry is None
        else pb.TokenLogprob(
            token_id=token,
            logprob=entry[0],
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry[1]],
        )
        for token, entry in zip(delta.token_ids, delta.logprobs, strict=True)
    ]


async def _abort(context: Any, error: BaseException) -> None:
    status = wire_status(error)
    if status.grpc_code == "INTERNAL":
        logger.exception("internal error serving a request", exc_info=error)
    if isinstance(error, OverloadedError):
        context.set_trailing_metadata((("retry-after", f"{error.retry_after_s:g}"),))
    await context.abort(getattr(grpc.StatusCode, status.grpc_code), status.message)


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse; the handler answers INVALID_ARGUMENT."""

    error: str


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def load(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(f"{type(e).__name__}: {e}"[:200])

    return load


def add_completion_service(servicer: CompletionService, server: Any) -> None:
    """Register the service with deserializers that turn bad bytes into :class:`Malformed`
    (the generated registration would answer them with UNKNOWN)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_tolerant(pb.CompletionRequest.FromString),
            response_serializer=pb.CompletionChunk.SerializeToString,
        ),
        "Complete": grpc.unary_unary_rpc_method_handler(
            servicer.Complete,
            request_deserializer=_tolerant(pb.CompletionRequest.FromString),
            response_serializer=pb.CompletionResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=_tolerant(pb.ListModelsRequest.FromString),
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


async def start_grpc(
    router: Router,
    keys: ApiKeys,
    host: str,
    port: int,
    tls: TlsConfig | None = None,
) -> tuple[Any, int]:
    """Serve the completion and health services (over TLS if given); returns (server, port)."""
    # Without SO_REUSEPORT: gRPC sets it by default, and a second cluster given the
    # same port would then share it, each taking part of the other's requests.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_completion_service(CompletionService(router, keys), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = host_port(host, port)
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, grpc_credentials(tls))
    except RuntimeError:  # grpc says only "Failed to bind"
        raise InvalidArgumentError(
            "server.grpc_port",
            f"cannot listen on {address}: the port is taken or the host is not this "
            "machine's (0: any free port)",
        ) from None
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
