"""The OpenAI-compatible HTTP front door (aiohttp).

    POST /v1/completions        text or token-id prompt; SSE when "stream": true
    POST /v1/chat/completions   messages rendered by the model's chat template
    GET  /v1/models
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (lora_admin.py)
    GET  /health                liveness (no key): the front door answers
    GET  /ready                 readiness (no key): 200 once a prefill and a decode
                                instance take requests, else 503

Responses carry ``usage``; a streamed response sends it in a last chunk when
``stream_options.include_usage`` is set. Errors have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) and their status from
:func:`~pdserve.core.errors.wire_status`; 429 adds ``Retry-After``. A client
that disconnects mid-stream aborts its request. ``model`` names the served model
(the base) or one of its LoRA adapters; ``/v1/models`` lists them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from pdserve.core.errors import InvalidArgumentError, OverloadedError, UnsupportedError, wire_status
from pdserve.router.config import TlsConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.batch_store import BatchLimits
from pdserve.router.frontdoor.batches import BatchJobs
from pdserve.router.frontdoor.choices import choice_count, fan_out, merged, total_usage
from pdserve.router.frontdoor.dashboard import add_routes
from pdserve.router.frontdoor.echo import Echo, echoed
from pdserve.router.frontdoor.logprobs import ChoiceLogprobs, asked_logprobs, token_text
from pdserve.router.frontdoor.lora_admin import add_lora_routes
from pdserve.router.frontdoor.messages import template_message
from pdserve.router.frontdoor.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_fields,
    response_schema,
)
from pdserve.router.frontdoor.request_keys import ADMITTED, BODY_BYTES, KEY_PRIORITY, KEY_TENANT
from pdserve.router.frontdoor.requests import (
    SAMPLING_FIELDS,
    capped_priority,
    completion_input,
    fit_context,
    off_loop,
    openai_models,
    prompt_tokens,
    sampling_params,
    with_cache_salt,
)
from pdserve.router.frontdoor.sse import DONE, ResponseShape, event
from pdserve.router.frontdoor.tls import ssl_context
from pdserve.router.frontdoor.tools import ToolChoice, tool_choice
from pdserve.router.models import Served
from pdserve.router.router import CompletionInput, Router
from pdserve.router.stream import StreamDelta, Usage

logger = logging.getLogger(__name__)
Deltas = AsyncGenerator[tuple[int, StreamDelta], None]  # (choice index, delta)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class HttpApi:
    def __init__(
        self,
        router: Router,
        keys: ApiKeys,
        max_body_bytes: int,
        batch_dir: Path | None = None,
    ) -> None:
        self.router = router
        self.keys = keys
        limits = BatchLimits.of(router.config)
        self.batches = BatchJobs(batch_dir, keys, limits) if batch_dir is not None else None
        self.max_body_bytes = max_body_bytes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes * 2, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        add_routes(app, self.router, self.keys)
        add_lora_routes(app, self.router, self.keys, self.max_body_bytes)  # runtime LoRA loads
        if self.batches is not None:
            self.batches.add_routes(app)
        return app

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as e:
            if request.path.startswith("/v1/") and not request.get(ADMITTED):
                self.router.reject(e)
            return error_response(e)

    async def _body(self, request: web.Request, allowed: set[str]) -> dict[str, Any]:
        caller = self.keys.caller(request.headers.get("Authorization"))
        request[KEY_PRIORITY], request[KEY_TENANT] = caller.priority, caller.tenant
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise InvalidArgumentError("body", f"larger than {self.max_body_bytes} bytes")
        raw = await request.read()
        request[BODY_BYTES] = len(raw)
        if len(raw) > self.max_body_bytes:
            raise InvalidArgumentError("body", f"larger than {self.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise InvalidArgumentError("body", f"not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidArgumentError("body", "JSON nested too deeply") from None
        if not isinstance(body, dict):
            raise InvalidArgumentError("body", "must be a JSON object")
        check_fields(body, allowed)
        if body.get("model") is None:
            served = self.router.catalog.names()
            raise InvalidArgumentError("model", f"is required; this server serves {served}")
        return body

    def _input(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompt: Any,
        chat: bool,
        served: Served,
        tools: ToolChoice | None = None,
    ) -> CompletionInput:
        field = "messages" if chat else "prompt"
        version, lora = served
        max_len = self.router.max_model_len_of(version.key)
        ids = prompt_tokens(
            version.tokenizer,
            prompt,
            max_len,
            version.vocab_size,
            field,
            add_special_tokens=not chat,
        )
        values = {k: body.get(k) for k in SAMPLING_FIELDS if k != "logprobs"}
        values["logprobs"] = asked_logprobs(body, chat)
        values["json_schema"] = response_schema(body.get("response_format"))
        if tools is not None and (schema := tools.schema()) is not None:
            if values["json_schema"] is not None:
                raise InvalidArgumentError("tool_choice", "cannot be combined with response_format")
            values["json_schema"] = schema
        if values["max_tokens"] is None and body.get("max_completion_tokens") is not None:
            values["max_tokens"] = body["max_completion_tokens"]
        if values["priority"] is None:
            values["priority"] = request.get(KEY_PRIORITY)
        params = sampling_params(values, version.vocab_size)
        params = capped_priority(params, request.get(KEY_PRIORITY))
        asked = values["max_tokens"] is not None
        params = fit_context(params, len(ids), max_len, asked)
        if echoed(body, chat) and params.logprobs is not None:  # the prompt's logprobs too
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
        params = dataclasses.replace(params, lora=lora)
        params = with_cache_salt(params, request.get(KEY_TENANT), body.get("cache_salt"))
        region = body.get("region") or request.headers.get("X-PDServe-Region")
        return completion_input(ids, params, region, body.get("request_id"), version)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, COMPLETION_FIELDS)
        served = self.router.resolve(body["model"])  # 404 for an unknown name
        inp = await off_loop(
            request[BODY_BYTES], self._input, request, body, body.get("prompt"), False, served
        )
        return await self._respond(request, body, inp, False, served)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, CHAT_FIELDS)
        served = self.router.resolve(body["model"])  # 404 for an unknown name
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgumentError("messages", "must be a non-empty list")
        if served[0].tokenizer is None:
            raise InvalidArgumentError("messages", "the model has no tokenizer")
        inp, tools = await off_loop(
            request[BODY_BYTES], self._chat_input, request, body, messages, served
        )
        return await self._respond(request, body, inp, True, served, tools)

    def _chat_input(
        self, request: web.Request, body: dict[str, Any], messages: list[Any], served: Served
    ) -> tuple[CompletionInput, ToolChoice | None]:
        tokenizer = served[0].tokenizer
        assert tokenizer is not None
        tools = tool_choice(body)
        shaped = [template_message(m, i) for i, m in enumerate(messages)]
        prompt = tokenizer.apply_chat_template(shaped, tools=list(tools.tools) if tools else None)
        return self._input(request, body, prompt, True, served, tools), tools

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: the front door answers (no key needed; it tells nothing)."""
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: at least one prefill and one decode instance take requests."""
        counts = self.router.ready()
        ok = counts["prefill"] > 0 and counts["decode"] > 0
        body = {"status": "ready" if ok else "not ready", "instances": counts}
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        self.keys.check(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": openai_models(self.router)})

    async def _respond(
        self,
        request: web.Request,
        body: dict[str, Any],
        inp: CompletionInput,
        chat: bool,
        served: Served,
        tools: ToolChoice | None = None,
    ) -> web.StreamResponse:
        n = choice_count(body.get("n"))
        request[ADMITTED] = True  # from here the router counts the outcome
        model = inp.params.lora or inp.served_as.rpartition("@")[0] or self.router.config.model_name
        shape = ResponseShape(inp.request_id, model, chat, inp.served_as, tools)
        logprobs = None  # the choices' logprobs objects, when asked for
        if inp.params.logprobs is not None:
            logprobs = ChoiceLogprobs(chat, token_text(served[0].tokenizer), n)
        deltas = merged(fan_out(inp, n), self.router.stream)
        echo = None
        if echoed(body, chat):
            echo = Echo(body.get("prompt"), inp.prompt_token_ids, served[0].tokenizer)
        if not body.get("stream"):
            return await self._whole(deltas, n, shape, logprobs, echo)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await self._stream(request, deltas, n, shape, (logprobs, echo), include_usage)

    async def _whole(
        self,
        deltas: Deltas,
        n: int,
        shape: ResponseShape,
        logprobs: ChoiceLogprobs | None,
        echo: Echo | None,
    ) -> web.Response:
        texts: list[list[str]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        usages = [Usage(0, 0)] * n
        async with contextlib.aclosing(deltas):
            async for i, delta in deltas:
                for d in _with_echo(echo, i, delta):
                    texts[i].append(d.text)
                    if logprobs is not None:
                        logprobs.add(i, d.token_ids, d.logprobs or [])
                reasons[i] = delta.finish_reason or reasons[i]
                usages[i] = delta.usage or usages[i]
        choices = [
            ("".join(t), r, logprobs.whole(i) if logprobs else None)
            for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ]
        return web.json_response(shape.whole(choices, total_usage(usages)))

    async def _stream(
        self,
        request: web.Request,
        deltas: Deltas,
        n: int,
        shape: ResponseShape,
        extras: tuple[ChoiceLogprobs | None, Echo | None],
        include_usage: bool,
    ) -> web.StreamResponse:
        logprobs, echo = extras
        usages: list[Usage | None] = [None] * n
        response: web.StreamResponse | None = None
        try:
            async with contextlib.aclosing(deltas):
                async for i, delta in deltas:
                    if response is None:  # errors before the first token are plain HTTP errors
                        response = web.StreamResponse(
                            headers={
                                "Content-Type": "text/event-stream",
                                "Cache-Control": "no-cache",
                            }
                        )
                        await response.prepare(request)
                    usages[i] = delta.usage or usages[i]
                    data = b""  # one write per delta (with the echoed prompt before the first)
                    for d in _with_echo(echo, i, delta):
                        lp = None
                        if logprobs is not None:
                            lp = logprobs.chunk(i, d.token_ids, d.logprobs or [])
                        data += shape.chunk_event(d, i, lp)
                    if include_usage and all(usages) and delta.finish_reason is not None:
                        data += shape.usage_event(total_usage([u for u in usages if u]))
                    await response.write(data)
                    self.router.delivered(delta)
        except (ConnectionResetError, OSError):
            raise  # the client left: the stream was closed, which aborted the request
        except Exception as e:
            if response is None:
                raise
            status = wire_status(e)  # mid-stream: the status line is gone; say it in the stream
            error = {"error": {"message": status.message, "code": status.grpc_code.lower()}}
            await response.write(event(error))
        assert response is not None
        await response.write_eof(DONE)
        return response


def _with_echo(echo: Echo | None, index: int, delta: StreamDelta) -> list[StreamDelta]:
    """The delta, after choice ``index``'s echoed prompt when it is the choice's first."""
    first = echo.first(index, delta) if echo is not None else None
    return [delta] if first is None else [first, delta]


def error_response(error: BaseException) -> web.Response:
    status = wire_status(error)
    if status.http_status == 500:
        logger.exception("internal error serving a request", exc_info=error)
    body = {
        "error": {
            "message": status.message,
            "type": _ERROR_TYPES.get(status.http_status, "server_error"),
            "param": getattr(error, "field", None),
            "code": status.grpc_code.lower(),
        }
    }
    headers = (
        {"Retry-After": f"{error.retry_after_s:g}"} if isinstance(error, OverloadedError) else None
    )
    if isinstance(error, UnsupportedError):
        body["error"]["type"] = "invalid_request_error"
    return web.json_response(body, status=status.http_status, headers=headers)


async def start_http(
    api: HttpApi, host: str, port: int, tls: TlsConfig | None = None
) -> tuple[web.AppRunner, int]:
    """Serve the app (over TLS if given); returns (runner, bound port)."""
    runner = web.AppRunner(api.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context(tls) if tls else None)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        why = {
            errno.EADDRINUSE: "the port is taken",
            errno.EADDRNOTAVAIL: "the host is not this machine's",
        }.get(e.errno or 0, e.strerror)
        field = "server.host" if e.errno == errno.EADDRNOTAVAIL else "server.http_port"
        raise InvalidArgumentError(
            field, f"cannot listen on {host}:{port}: {why} (port 0: any free port)"
        ) from None
    server: Any = site._server
    sockets = server.sockets if server is not None else []
    return runner, sockets[0].getsockname()[1] if sockets else port


__all__ = ["HttpApi", "error_response", "start_http"]
