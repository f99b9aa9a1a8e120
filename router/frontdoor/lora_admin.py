"""The HTTP endpoints that load and unload LoRA adapters at runtime (vLLM's names).

    POST /v1/load_lora_adapter    {"lora_name": str, "lora_path": str,
                                   "model"?: str, "instances"?: [str]}
    POST /v1/unload_lora_adapter  {"lora_name": str, "model"?: str, "instances"?: [str]}

Both need an admin API key (``admin: true`` in ``auth.api_keys``, or
``$PDSERVE_ADMIN_API_KEYS``): a client's key may not make the instances read a
path of the server's nor take away an adapter others use (403). The router loads the adapter on
every instance of the model (or the ones named), prefill and decode alike,
through :class:`~pdserve.router.lora_admin.LoraAdmin`; the answer lists where
it was loaded (and where it failed and why). Instances of the model started
later load it too, until it is unloaded. A malformed body is a 400 naming
the field; a bad adapter a 400 naming the adapter's field; a taken name, a
full instance or an adapter still in use a 409; an unknown name on unload a 404.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.request_keys import ADMITTED
from pdserve.router.router import Router

_LOAD = {"lora_name", "lora_path", "model", "instances"}
_UNLOAD = {"lora_name", "model", "instances"}


def add_lora_routes(
    app: web.Application, router: Router, keys: ApiKeys, max_body_bytes: int
) -> None:
    async def load(request: web.Request) -> web.Response:
        body = await _body(request, keys, max_body_bytes, _LOAD)
        path = _string(body, "lora_path")
        answer = await router.lora.load(_string(body, "lora_name"), path, *_scope(body))
        return web.json_response(answer)

    async def unload(request: web.Request) -> web.Response:
        body = await _body(request, keys, max_body_bytes, _UNLOAD)
        answer = await router.lora.unload(_string(body, "lora_name"), *_scope(body))
        return web.json_response(answer)

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)


async def _body(
    request: web.Request, keys: ApiKeys, limit: int, allowed: set[str]
) -> dict[str, Any]:
    request[ADMITTED] = True  # an admin call, not a completion the router refused
    keys.check_admin(request.headers.get("Authorization"), "load or unload adapters")
    raw = await request.content.read(limit + 1)
    if len(raw) > limit:
        raise InvalidArgumentError("body", f"larger than {limit} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidArgumentError("body", "not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    for name in body:
        if name not in allowed:
            raise InvalidArgumentError(name, f"unknown field; allowed: {sorted(allowed)}")
    return body


def _string(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(field, f"is required: a non-empty string, got {value!r}")
    return value


def _scope(body: dict[str, Any]) -> tuple[str | None, list[str] | None]:
    model, instances = body.get("model"), body.get("instances")
    if model is not None and not isinstance(model, str):
        raise InvalidArgumentError("model", f"must be a model name, got {model!r}")
    if instances is not None and (
        not isinstance(instances, list) or not all(isinstance(i, str) for i in instances)
    ):
        raise InvalidArgumentError(
            "instances", f"must be a list of instance ids, got {instances!r}"
        )
    return model, instances
