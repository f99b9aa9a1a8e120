"""API keys: an empty, blank or repeated key is refused when the config loads; both
front doors compare a presented key after the same normalisation and give a key's
requests the same prefix-cache tenant."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.cluster.config import parse_config
from pdserve.core.errors import AuthenticationError, InvalidArgumentError
from pdserve.deploy.cli import main
from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.grpc_service import start_grpc
from pdserve.router.frontdoor.http_api import HttpApi
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc
from pdserve.router.router import Router

CONFIG = """\
model: builtin:tiny
regions:
  - name: east
    prefill: {count: 1}
    decode: {count: 1}
auth:
  api_keys:
"""


@pytest.mark.parametrize(
    ("entries", "where", "what"),
    [
        (['""'], r"auth\.api_keys\[0\]", "must be a non-empty key"),
        (["good", '"   "'], r"auth\.api_keys\[1\]", "must be a non-empty key"),
        (["good", "{key: '', admin: true}"], r"auth\.api_keys\[1\]", "must be a non-empty key"),
        (["a", "b", "' a'"], r"auth\.api_keys\[2\]", r"repeats the key of auth\.api_keys\[0\]"),
        (["a", "{key: a, admin: true}"], r"auth\.api_keys\[1\]", "repeats"),
    ],
    ids=["empty", "blank", "empty-admin", "repeated", "repeated-admin"],
)
def test_a_bad_key_is_refused_naming_it_and_its_line(entries, where, what) -> None:
    text = CONFIG + "".join(f"    - {e}\n" for e in entries)
    line = 8 + len(entries) - 1  # the last entry is the bad one
    with pytest.raises(InvalidArgumentError, match=rf"^<config>:{line}: {where}: {what}"):
        parse_config(text)


def test_serve_exits_2_with_one_line_on_an_empty_key(tmp_path, capsys, monkeypatch) -> None:
    def no_cluster(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a config with an empty key started a cluster")

    monkeypatch.setattr("pdserve.cluster.serve.serve", no_cluster)
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG + '    - ""\n')  # "${API_KEY}" after envsubst with it unset
    assert main(["serve", "--config", str(config), "--ray-address", "local"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "auth.api_keys[0]: must be a non-empty key" in err, err


def test_keys_built_in_code_are_checked_too() -> None:
    with pytest.raises(InvalidArgumentError, match=r"auth\.api_keys\[1\]"):
        RouterConfig(api_keys=("a", ""))
    with pytest.raises(InvalidArgumentError, match=r"auth\.api_key_admins\[0\]"):
        RouterConfig(api_keys=("a",), api_key_admins=(" ",))
    with pytest.raises(InvalidArgumentError, match=r"auth\.api_keys\[0\]"):
        ApiKeys(("",), False)
    with pytest.raises(InvalidArgumentError, match=r"auth\.api_key_admins\[0\]"):
        ApiKeys(("a",), False, admins=("\u00a0",))


def test_bearer_and_a_non_breaking_space_is_no_key() -> None:
    keys = ApiKeys(("k",), False)
    for given in ("Bearer \u00a0", "Bearer  ", "Bearer \t", "Bearer"):
        with pytest.raises(AuthenticationError, match="malformed"):
            keys.check(given)
    assert keys.check("Bearer \u00a0k ") is None  # the key, once normalised


# (authorization, accepted): the same on both doors. Keys: "k1", " k2 " (normalised).
PRESENTED = [
    ("Bearer k1", True),
    ("Bearer  k1", True),
    ("Bearer k1 ", True),
    ("bearer k2", True),
    ("Bearer k3", False),
    ("Bearer ", False),
    ("Bearer k1k1", False),
    ("k1", False),
    ("Basic k1", False),
    ("Bearer k", False),
]


def _keys() -> ApiKeys:
    return ApiKeys(
        ("k1", " k2 ", "k3-team", "k4-team"),
        False,
        tenants=(("k3-team", "team"), ("k4-team", "team")),
    )


def _router() -> tuple[Router, list[Any]]:
    router = Router(RouterConfig(model_name="tiny", api_keys=("k1",)), None, None, vocab_size=100)
    seen: list[Any] = []
    real = router.stream

    def spy(inp: Any) -> Any:
        seen.append(inp.params.cache_salt)
        return real(inp)

    router.stream = spy  # type: ignore[method-assign]
    return router, seen


def _http(calls: list[tuple[str, str | None]]) -> tuple[list[bool], list[str | None]]:
    """(accepted, per call) and the cache salts the router got, over HTTP."""
    router, seen = _router()
    api = HttpApi(router, _keys(), 1 << 20)

    async def go() -> list[bool]:
        out = []
        async with TestClient(TestServer(api.app())) as client:
            for authorization, salt in calls:
                body: dict[str, Any] = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
                if salt is not None:
                    body["cache_salt"] = salt
                headers = {"Authorization": authorization}
                resp = await client.post("/v1/completions", json=body, headers=headers)
                assert resp.status in (401, 429), await resp.text()  # no instance: 429
                out.append(resp.status == 429)
        return out

    return asyncio.run(go()), seen


def _grpc(calls: list[tuple[str, str | None]]) -> tuple[list[bool], list[str | None]]:
    """The same over gRPC."""
    router, seen = _router()

    async def go() -> list[bool]:
        server, port = await start_grpc(router, _keys(), "127.0.0.1", 0)
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.CompletionStub(channel)
                for authorization, salt in calls:
                    request = pb.CompletionRequest(
                        model="tiny", prompt_token_ids=pb.TokenIds(ids=[1, 2]), cache_salt=salt
                    )
                    meta = [("authorization", authorization)]
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Complete(request, metadata=meta, timeout=10)
                    codes = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)
                    assert e.value.code() in codes, e.value
                    out.append(e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
        finally:
            await server.stop(None)
        return out

    return asyncio.run(go()), seen


def test_both_doors_accept_the_same_keys_and_give_them_the_same_tenants() -> None:
    calls: list[tuple[str, str | None]] = [(a, None) for a, _ in PRESENTED]
    # Tenants: k1; k1 again; k2; the team's two keys; k1 with a salt of its own.
    calls += [
        ("Bearer k1", None),
        ("Bearer k1", None),
        ("Bearer k2", None),
        ("Bearer k3-team", None),
        ("Bearer k4-team", None),
        ("Bearer k1", "s"),
    ]
    http, http_salts = _http(calls)
    rpc, rpc_salts = _grpc(calls)
    assert http[: len(PRESENTED)] == [ok for _, ok in PRESENTED]
    assert rpc == http and rpc_salts == http_salts
    k1, k1_again, k2, team_a, team_b, k1_salted = http_salts[-6:]
    assert k1 == k1_again and team_a == team_b
    assert len({k1, k2, team_a, k1_salted}) == 4 and None not in http_salts
    assert not any(k in s for s in http_salts if s for k in ("k1", "k2", "team"))


def test_with_auth_off_everyone_shares_unless_a_request_names_a_salt() -> None:
    off = ApiKeys((), True)
    assert off.caller(None).tenant is None
    router, seen = _router()
    api = HttpApi(router, off, 1 << 20)

    async def go() -> None:
        async with TestClient(TestServer(api.app())) as client:
            for body in ({}, {"cache_salt": "x"}, {"cache_salt": ""}):
                body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2, **body}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status == (400 if body.get("cache_salt") == "" else 429)

    asyncio.run(go())
    assert seen[0] is None and seen[1] is not None and len(seen) == 2
