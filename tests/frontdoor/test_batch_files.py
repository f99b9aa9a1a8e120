"""The Batch API's files over real HTTP (aiohttp's test server, a router with no
instance): each key's quota, deletion, and nothing kept of a refused or broken upload."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.http_api import HttpApi
from pdserve.router.router import Router

LINE = (
    json.dumps(
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": [1, 2], "max_tokens": 2},
        }
    )
    + "\n"
)


def _lines(size: int) -> bytes:
    """Request lines of distinct custom_ids, about ``size`` bytes in all."""
    count = size // len(LINE)
    return "".join(LINE.replace('"a"', f'"c{i:07}"', 1) for i in range(count)).encode()


def _api(folder: Path, quota_mb: int) -> HttpApi:
    config = RouterConfig(model_name="tiny", api_keys=("alice", "bob"), batch_quota_mb=quota_mb)
    router = Router(config, None, None, vocab_size=100)
    return HttpApi(router, ApiKeys(config.api_keys, False), 1 << 20, folder)


def _form(data: bytes) -> aiohttp.FormData:
    form = aiohttp.FormData({"purpose": "batch"})
    form.add_field("file", data, filename="in.jsonl")
    return form


async def _call(client: TestClient, method: str, path: str, key: str, **kw) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"}
    async with client.request(method, path, headers=headers, **kw) as r:
        return r.status, await r.json()


def _kept(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "files").iterdir())


def test_each_key_uploads_within_its_quota_and_deletes_its_files(tmp_path: Path) -> None:
    big = _lines(600 << 10)  # ~600 KiB: one fits a 1-MiB quota

    async def go() -> None:
        async with TestClient(TestServer(_api(tmp_path, 1).app())) as client:
            status, first = await _call(client, "POST", "/v1/files", "alice", data=_form(big))
            assert status == 200 and first["bytes"] == len(big)
            status, over = await _call(client, "POST", "/v1/files", "alice", data=_form(big))
            assert status == 400 and over["error"]["param"] == "file", over
            assert "batch_quota_mb" in over["error"]["message"]
            assert _kept(tmp_path) == [f"{first['id']}.json", f"{first['id']}.jsonl"]
            # another key's quota is its own; it cannot see nor delete alice's file
            status, _ = await _call(client, "POST", "/v1/files", "bob", data=_form(big))
            assert status == 200
            status, gone = await _call(client, "DELETE", f"/v1/files/{first['id']}", "bob")
            assert status == 404 and gone["error"]["type"] == "not_found_error"
            status, listed = await _call(client, "GET", "/v1/files", "alice")
            assert status == 200 and [f["id"] for f in listed["data"]] == [first["id"]]
            assert "owner" not in listed["data"][0]
            status, deleted = await _call(client, "DELETE", f"/v1/files/{first['id']}", "alice")
            assert (status, deleted) == (
                200,
                {"id": first["id"], "object": "file", "deleted": True},
            )
            status, _ = await _call(client, "GET", f"/v1/files/{first['id']}", "alice")
            assert status == 404
            status, _ = await _call(client, "POST", "/v1/files", "alice", data=_form(big))
            assert status == 200  # room again
            for bad in ("file-%00", "file.x", "x" * 200):  # an id that is not one: 404, not a 500
                status, answer = await _call(client, "GET", f"/v1/files/{bad}", "alice")
                assert status == 404 and answer["error"]["param"] == "file_id", (bad, answer)

    asyncio.run(go())


def test_an_upload_cut_off_midway_leaves_no_file(tmp_path: Path) -> None:
    async def go() -> None:
        async with TestServer(_api(tmp_path, 64).app()) as server:
            head = (
                '--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                '--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\n'
            )
            request = (
                f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
                f"Content-Type: multipart/form-data; boundary=b\r\n"
                f"Content-Length: 10000000\r\n\r\n{head}{_lines(len(LINE) * 5000).decode()}"
            )
            with socket.create_connection((server.host, server.port)) as s:
                s.sendall(request.encode())
                for _ in range(50):  # until the server has the file open and part written
                    if _kept(tmp_path):
                        break
                    await asyncio.sleep(0.1)
                assert len(_kept(tmp_path)) == 1
            for _ in range(50):  # the connection is gone: the partial file is removed
                if not _kept(tmp_path):
                    break
                await asyncio.sleep(0.1)
            assert _kept(tmp_path) == []

    asyncio.run(go())


def test_batch_outputs_count_toward_the_quota(tmp_path: Path) -> None:
    """A batch's output file is the key's too: it stops the batch when it reaches the
    quota (the lines run keep their results), and no batch starts past it."""
    line = json.loads(LINE)
    line["body"].update(model="nosuch", prompt="x " * 3994)  # a 404 each: a short record
    lines = [json.dumps({**line, "custom_id": f"c{i:03}"}) + "\n" for i in range(128)]
    data = "".join(lines).encode()
    assert (1 << 20) - 12_000 < len(data) < (1 << 20) - 8_000  # room for ~25 records
    api = _api(tmp_path, 1)

    async def go() -> None:
        async with TestServer(api.app()) as server, TestClient(server) as client:
            assert api.batches is not None
            api.batches.listening(f"http://{server.host}:{server.port}", False, False)
            _, upload = await _call(client, "POST", "/v1/files", "alice", data=_form(data))
            create = {"input_file_id": upload["id"], "endpoint": "/v1/completions"}
            status, batch = await _call(client, "POST", "/v1/batches", "alice", json=create)
            assert status == 200, batch
            for _ in range(200):
                _, batch = await _call(client, "GET", f"/v1/batches/{batch['id']}", "alice")
                if batch["status"] != "in_progress":
                    break
                await asyncio.sleep(0.05)
            assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "quota"
            why = batch["errors"]["data"][0]["message"]
            assert "lines not sent" in why and "batch_quota_mb" in why, why
            done = batch["request_counts"]["failed"]  # each a 404: the model does not exist
            assert 0 < done < 128 and batch["request_counts"]["completed"] == 0
            status, out = await _call(
                client, "GET", f"/v1/files/{batch['output_file_id']}", "alice"
            )
            # it stopped at the quota (less than one ~400-byte record short), never past it
            assert (1 << 20) - 1000 < len(data) + out["bytes"] <= 1 << 20
            status, refused = await _call(client, "POST", "/v1/batches", "alice", json=create)
            assert status == 409 and "batch_quota_mb" in refused["error"]["message"], refused
            status, _ = await _call(
                client, "DELETE", f"/v1/files/{batch['output_file_id']}", "alice"
            )
            assert status == 200
            status, again = await _call(client, "POST", "/v1/batches", "alice", json=create)
            assert status == 200, again  # room again
            await _call(client, "POST", f"/v1/batches/{again['id']}/cancel", "alice")

    asyncio.run(go())


def test_files_records_and_key_digests_are_private(tmp_path: Path) -> None:
    import hashlib
    import os
    import stat

    plain = hashlib.sha256(b"alice").hexdigest()
    legacy = tmp_path / "files" / "file-old.json"  # an older pdserve's record of alice's
    legacy.parent.mkdir(parents=True)
    legacy.write_text(
        json.dumps(
            {
                "id": "file-old",
                "object": "file",
                "bytes": 0,
                "created_at": 1,
                "filename": "old.jsonl",
                "purpose": "batch",
                "owner": plain,
            }
        )
    )
    os.chmod(legacy, 0o644)

    async def go() -> None:
        async with TestClient(TestServer(_api(tmp_path, 1).app())) as client:
            status, meta = await _call(
                client, "POST", "/v1/files", "alice", data=_form(LINE.encode())
            )
            assert status == 200, meta
            _, listed = await _call(client, "GET", "/v1/files", "alice")
            assert {f["id"] for f in listed["data"]} == {meta["id"], "file-old"}  # taken over
            _, other = await _call(client, "GET", "/v1/files", "bob")
            assert other["data"] == []

    asyncio.run(go())
    for path in [tmp_path, *tmp_path.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"
        assert plain not in path.name and (path.is_dir() or plain.encode() not in path.read_bytes())
