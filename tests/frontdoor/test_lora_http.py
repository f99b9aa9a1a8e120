"""The OpenAI ``model`` field picks a LoRA adapter; /v1/models lists them; unknown names are 404."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.http_api import HttpApi
from pdserve.router.router import Router

ADAPTERS = ("sql", "poems")


def _run(requests: list[tuple[str, str, dict[str, Any] | None]]) -> tuple[list, list]:
    """(status, json) of each request to a router with no instance, and the inputs it got."""
    config = RouterConfig(model_name="tiny", auth_disabled=True, lora_adapters=ADAPTERS)
    router = Router(config, None, None, vocab_size=100)
    seen: list[Any] = []
    real = router.stream

    def spy(inp: Any) -> Any:
        seen.append(inp)
        return real(inp)

    router.stream = spy  # type: ignore[method-assign]
    api = HttpApi(router, ApiKeys((), True), 1 << 20)

    async def go() -> list:
        async with TestClient(TestServer(api.app())) as client:
            out = []
            for method, path, body in requests:
                resp = await client.request(method, path, json=body)
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(go()), seen


def test_model_field_selects_the_adapter_and_models_lists_them() -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    results, seen = _run(
        [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {**body, "model": "sql"}),
            ("POST", "/v1/completions", {**body, "model": "tiny"}),
            ("POST", "/v1/completions", {**body, "model": "nope"}),
            ("POST", "/v1/chat/completions", {"model": "nope", "messages": []}),
        ]
    )
    (status, models), *_ = results
    assert status == 200
    assert [m["id"] for m in models["data"]] == ["tiny", "sql", "poems"]
    assert [m["parent"] for m in models["data"]] == [None, "tiny", "tiny"]
    # No instance is up: the request is admitted to the router, then refused for capacity.
    assert [inp.params.lora for inp in seen] == ["sql", None]
    for status, answer in results[3:]:
        assert status == 404
        message = answer["error"]["message"]
        assert "'nope'" in message and all(n in message for n in ("tiny", *ADAPTERS)), message


def test_malformed_adapter_admin_bodies_get_400_naming_the_field() -> None:
    results, _ = _run(
        [
            ("POST", "/v1/load_lora_adapter", {"lora_path": "/x"}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": 5, "lora_path": "/x"}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "a"}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "x": 1}),
            (
                "POST",
                "/v1/load_lora_adapter",
                {"lora_name": "a", "lora_path": "/x", "instances": "p"},
            ),
            ("POST", "/v1/unload_lora_adapter", {}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/x"}),
        ]
    )
    fields = ["lora_name", "lora_name", "lora_path", "x", "instances", "lora_name", "lora_name"]
    for (status, answer), field in zip(results, fields, strict=True):
        assert status == 400 and answer["error"]["param"] == field, answer
    # Well formed, but no instance holds "nope" / there is no instance to load on.
    results, _ = _run(
        [
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "nope"}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
        ]
    )
    assert [status for status, _ in results] == [404, 503], results
