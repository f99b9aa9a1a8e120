"""The Batch API's bounds over real HTTP (aiohttp's server and client, a router with no
instance): uploads checked line by line, one quota per key that nothing overshoots,
per-key counts, listings from the key's own index, resumes that cannot stop the router,
and an IPv6 front door."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.batch import BatchRunner
from pdserve.core.errors import ConflictError
from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.batch_store import KeyLedger
from pdserve.router.frontdoor.batches import _digest, front_door_url
from pdserve.router.frontdoor.http_api import HttpApi
from pdserve.router.router import Router

BODY = {"model": "nosuch", "prompt": [1, 2], "max_tokens": 2}  # a 404 each: no instance needed


def line(cid: str, **fields) -> str:
    item = {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": BODY}
    return json.dumps({**item, **fields}) + "\n"


def lines(count: int, pad: int = 0) -> bytes:
    body = {**BODY, "user": "x" * pad}
    return "".join(line(f"c{i:07}", body=body) for i in range(count)).encode()


def api(folder: Path, **config) -> HttpApi:
    settings = {"model_name": "tiny", "api_keys": ("alice", "bob"), **config}
    router = Router(RouterConfig(**settings), None, None, vocab_size=100)
    return HttpApi(router, ApiKeys(settings["api_keys"], False), 1 << 20, folder)


def form(data: bytes) -> aiohttp.FormData:
    f = aiohttp.FormData({"purpose": "batch"})
    f.add_field("file", data, filename="in.jsonl")
    return f


async def call(client: TestClient, method: str, path: str, key: str = "alice", headers=None, **kw):
    headers = {"Authorization": f"Bearer {key}", **(headers or {})}
    async with client.request(method, path, headers=headers, **kw) as r:
        return r.status, await r.json()


def kept(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "files").iterdir())


def stored(folder: Path) -> int:
    return sum(p.stat().st_size for p in (folder / "files").glob("*.jsonl"))


@pytest.mark.parametrize(
    ("data", "param", "says"),
    [
        (b"x\n" * 1000, "file", "line 1: is not JSON"),
        (line("a").encode() + line("b").encode() + b'{"custom_id": "c"}\n', "file", "line 3: "),
        (line("a").encode() + b"\n" + line("a").encode(), "file", "line 3: custom_id 'a' repeats"),
        (line("a", method=None).encode(), "file", "line 1: method and url"),
        (line("a", url="/v1/embeddings").encode(), "file", "line 1: method and url"),
        (line("a", body=[1]).encode(), "file", "line 1: body"),
        (line("a").encode() + b'"\xff\xfe"\n', "file", "line 2: not UTF-8"),
        (lines(6), "file", "line 6: more than 5 lines (router.batch_max_file_lines)"),
        (lines(3, pad=900_000), "file", "larger than 2 MiB (router.batch_max_file_mb)"),
        (line("a", body={**BODY, "user": "x" * 1_100_000}).encode(), "file", "batch_max_line_kb"),
        (b"\n\n", "file", "has no request lines"),
    ],
)
def test_an_upload_is_refused_at_its_first_bad_line(tmp_path: Path, data, param, says) -> None:
    config = {"batch_max_file_lines": 5, "batch_max_file_mb": 2, "batch_max_line_kb": 1024}

    async def go() -> None:
        async with TestClient(TestServer(api(tmp_path, **config).app())) as client:
            status, answer = await call(client, "POST", "/v1/files", data=form(data))
            assert status == 400 and answer["error"]["param"] == param, answer
            assert says in answer["error"]["message"], answer
            assert kept(tmp_path) == []
            status, good = await call(client, "POST", "/v1/files", data=form(lines(5)))
            assert status == 200 and good["bytes"] == len(lines(5)), good

    asyncio.run(go())


async def slowly(data: bytes) -> AsyncIterator[bytes]:
    """A multipart upload of ``data`` sent in pieces, so that uploads overlap."""
    yield (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\n'
    )
    for start in range(0, len(data), 32 << 10):
        await asyncio.sleep(0.01)
        yield data[start : start + (32 << 10)]
    yield b"\r\n--b--\r\n"


def test_parallel_uploads_never_store_past_the_quota(tmp_path: Path) -> None:
    data = lines(1500, pad=300)  # ~580 KiB: one fits a 1-MiB quota, two do not
    assert 500 << 10 < len(data) < 1 << 20

    async def go() -> None:
        async with TestClient(TestServer(api(tmp_path, batch_quota_mb=1).app())) as client:
            headers = {"Content-Type": "multipart/form-data; boundary=b"}
            answers = await asyncio.gather(
                *(
                    call(client, "POST", "/v1/files", data=slowly(data), headers=headers)
                    for _ in range(8)
                )
            )
            statuses = sorted(status for status, _ in answers)
            assert statuses == [200] + [400] * 7, answers
            assert stored(tmp_path) <= 1 << 20

    asyncio.run(go())


def test_error_lines_count_toward_the_quota_and_stop_the_batch(tmp_path: Path) -> None:
    """A junk input (as ``pdserve batch`` may be given, or a file stored before uploads were
    checked) writes an error line per line: each one's bytes are reserved first, and the
    run stops at the quota without passing it."""
    junk, out = tmp_path / "junk.jsonl", tmp_path / "out.jsonl"
    junk.write_bytes(b"x\n" * 100_000)
    ledger = KeyLedger(1 << 20, junk.stat().st_size)  # 200 KB of input in a 1-MiB quota
    runner = BatchRunner("http://127.0.0.1:1", None, budget=ledger)
    with pytest.raises(ConflictError, match="size limit"):
        asyncio.run(runner.run(junk, out, progress=False))
    assert junk.stat().st_size + out.stat().st_size <= 1 << 20
    assert ledger.used == junk.stat().st_size + out.stat().st_size
    assert (1 << 20) - ledger.used < 300  # it stopped less than a record short


def test_each_key_has_its_file_and_running_batch_limits(tmp_path: Path) -> None:
    hang = socket.socket()  # a "front door" that accepts and never answers: batches keep running
    hang.bind(("127.0.0.1", 0))
    hang.listen(64)
    server_api = api(tmp_path, batch_max_files=3, batch_max_running=1)

    async def go() -> None:
        async with TestClient(TestServer(server_api.app())) as client:
            assert server_api.batches is not None
            await server_api.batches.listening(
                f"http://127.0.0.1:{hang.getsockname()[1]}", False, False
            )
            _, first = await call(client, "POST", "/v1/files", data=form(lines(2)))
            _, second = await call(client, "POST", "/v1/files", data=form(lines(2)))
            create = {"input_file_id": first["id"], "endpoint": "/v1/completions"}
            status, running = await call(client, "POST", "/v1/batches", json=create)
            assert status == 200, running  # its output is the key's third file
            status, refused = await call(client, "POST", "/v1/files", data=form(lines(2)))
            assert status == 409 and refused["error"]["param"] == "router.batch_max_files"
            await call(client, "DELETE", f"/v1/files/{second['id']}")
            create = {"input_file_id": first["id"], "endpoint": "/v1/completions"}
            status, refused = await call(client, "POST", "/v1/batches", json=create)
            assert status == 409 and refused["error"]["param"] == "router.batch_max_running"
            assert "at most 1" in refused["error"]["message"]
            status, _ = await call(client, "POST", "/v1/files", "bob", data=form(lines(2)))
            assert status == 200  # bob's limits are his own
            await call(client, "POST", f"/v1/batches/{running['id']}/cancel")
            status, again = await call(client, "POST", "/v1/batches", json=create)
            assert status == 200, again
            await call(client, "POST", f"/v1/batches/{again['id']}/cancel")

    try:
        asyncio.run(go())
    finally:
        hang.close()


def test_listings_read_only_the_callers_own_records(tmp_path: Path) -> None:
    """Another key's records are never read to list this key's (a broken one of bob's
    does not stop alice listing hers)."""
    server_api = api(tmp_path)

    async def go() -> None:
        async with TestServer(server_api.app()) as server, TestClient(server) as client:
            assert server_api.batches is not None
            await server_api.batches.listening(f"http://{server.host}:{server.port}", False, False)
            _, mine = await call(client, "POST", "/v1/files", data=form(lines(2)))
            _, his = await call(client, "POST", "/v1/files", "bob", data=form(lines(2)))
            create = {"input_file_id": mine["id"], "endpoint": "/v1/completions"}
            _, batch = await call(client, "POST", "/v1/batches", json=create)
            create = {"input_file_id": his["id"], "endpoint": "/v1/completions"}
            _, his_batch = await call(client, "POST", "/v1/batches", "bob", json=create)
            for _ in range(100):
                _, b = await call(client, "GET", f"/v1/batches/{his_batch['id']}", "bob")
                if b["status"] != "in_progress":
                    break
                await asyncio.sleep(0.05)
            (tmp_path / "files" / f"{his['id']}.json").write_text("{broken")
            (tmp_path / "batches" / f"{his_batch['id']}.json").write_text("{broken")
            status, files = await call(client, "GET", "/v1/files")
            assert status == 200, files
            assert sorted(f["id"] for f in files["data"]) == sorted(
                [mine["id"], batch["output_file_id"]]
            )
            status, batches = await call(client, "GET", "/v1/batches")
            assert status == 200 and [b["id"] for b in batches["data"]] == [batch["id"]]

    asyncio.run(go())


def test_a_batch_that_cannot_resume_is_failed_and_the_router_still_starts(tmp_path: Path) -> None:
    server_api = api(tmp_path)
    assert server_api.batches is not None
    (tmp_path / "batches" / "batch_garbage.json").write_text("{not a record")
    looping = {
        "id": "batch_loop",
        "object": "batch",
        "endpoint": "/v1/completions",
        "input_file_id": "file-gone",
        "output_file_id": "file-out",
        "status": "in_progress",
        "errors": None,
        "created_at": 1,
        "resumes": 3,
        "owner": _digest(server_api.batches.secret, "alice"),
    }
    broken = {**looping, "id": "batch_broken", "resumes": 0}
    del broken["output_file_id"]
    for record in (looping, broken):
        (tmp_path / "batches" / f"{record['id']}.json").write_text(json.dumps(record))
        (tmp_path / "owners" / record["owner"]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "owners" / record["owner"] / record["id"]).touch()

    async def go() -> None:
        async with TestServer(server_api.app()) as server, TestClient(server) as client:
            assert server_api.batches is not None
            await server_api.batches.listening(f"http://{server.host}:{server.port}", False, False)
            async with client.get("/health") as r:
                assert r.status == 200
            status, batch = await call(client, "GET", "/v1/batches/batch_loop")
            assert status == 200 and batch["status"] == "failed", batch
            assert batch["errors"]["data"][0]["code"] == "resume"
            assert "stopped 3 times" in batch["errors"]["data"][0]["message"]
            status, batch = await call(client, "GET", "/v1/batches/batch_broken")
            assert status == 200 and batch["status"] == "failed", batch
            assert "output_file_id" in batch["errors"]["data"][0]["message"]

    asyncio.run(go())


def test_an_ipv6_front_door_runs_its_own_batches(tmp_path: Path) -> None:
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server_api = api(tmp_path)
    assert front_door_url("http", "::", 80) == "http://[::1]:80"
    assert front_door_url("https", "0.0.0.0", 80) == "https://127.0.0.1:80"

    async def go() -> None:
        async with TestServer(server_api.app(), host="::1") as server, TestClient(server) as client:
            assert server_api.batches is not None
            await server_api.batches.listening(
                front_door_url("http", "::1", server.port), False, False
            )
            _, upload = await call(client, "POST", "/v1/files", data=form(lines(3)))
            create = {"input_file_id": upload["id"], "endpoint": "/v1/completions"}
            _, batch = await call(client, "POST", "/v1/batches", json=create)
            deadline = time.monotonic() + 20
            while batch["status"] == "in_progress" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                _, batch = await call(client, "GET", f"/v1/batches/{batch['id']}")
            assert batch["status"] == "completed", batch
            async with client.get(
                f"/v1/files/{batch['output_file_id']}/content",
                headers={"Authorization": "Bearer alice"},
            ) as r:
                records = [json.loads(t) for t in (await r.text()).splitlines()]
            assert [r["error"]["code"] for r in records] == ["http_404"] * 3  # it reached itself

    asyncio.run(go())
