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


def _run(
    requests: list[tuple[str, str, dict[str, Any] | None]],
    keys: ApiKeys | None = None,
    key: str | None = None,
) -> tuple[list, list]:
    """(status, json) of each request to a router with no instance, and the inputs it got
    (``keys``: the router's, default none needed; ``key``: the one the client sends)."""
    config = RouterConfig(model_name="tiny", auth_disabled=True, lora_adapters=ADAPTERS)
    router = Router(config, None, None, vocab_size=100)
    seen: list[Any] = []
    real = router.stream

    def spy(inp: Any) -> Any:
        seen.append(inp)
        return real(inp)

    router.stream = spy  # type: ignore[method-assign]
    api = HttpApi(router, keys or ApiKeys((), True), 1 << 20)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def go() -> list:
        async with TestClient(TestServer(api.app())) as client:
            out = []
            for method, path, body in requests:
                resp = await client.request(method, path, json=body, headers=headers)
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


def test_only_an_admin_key_loads_or_unloads_adapters(monkeypatch) -> None:
    # A client's key may not make the instances read a server path, nor unload an
    # adapter other clients use; an admin key's call reaches the router.
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEYS", "ops-env")
    keys = ApiKeys(("client",), False, admins=("ops",))
    calls = [
        ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"}),
    ]
    for key, statuses in (
        ("client", [403, 403]),
        (None, [401, 401]),
        ("ops", [503, 404]),
        ("ops-env", [503, 404]),
    ):
        results, _ = _run(calls, keys, key)
        assert [status for status, _ in results] == statuses, (key, results)
    results, _ = _run(calls[:1], keys, "client")
    error = results[0][1]["error"]
    assert error["type"] == "permission_error" and error["code"] == "permission_denied"
    assert "needs an admin key" in error["message"]
    # an admin key is an API key too; a client key still sends requests (with no
    # instance the router refuses it as overloaded, not for its key)
    assert keys.check("Bearer ops-env") is None
    completion = ("POST", "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert _run([completion], keys, "client")[0][0][0] == 429
