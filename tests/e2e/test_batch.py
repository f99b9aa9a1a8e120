"""``pdserve batch`` against a real cluster: results per line, errors per line, resumable."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.batch import BatchRunner
from tests.e2e.tiny_cluster import KEY, Cluster

COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 3, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = Cluster({"local": (1, 1)})
    yield c
    c.shutdown()


def _line(cid: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _input(tmp_path):
    lines = [_line(f"c{i}", {**COMPLETION, "max_tokens": 2 + i}) for i in range(5)]
    lines += [
        _line("chat", CHAT, "/v1/chat/completions"),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": COMPLETION}),
        _line("c0", COMPLETION),  # a repeated custom_id
        _line("embed", COMPLETION, "/v1/embeddings"),
        _line("cold", {**COMPLETION, "temperature": -1}),  # the server refuses it
        "",
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(cluster, src, out):
    doors = cluster._bootstrap[1]
    runner = BatchRunner(f"http://{doors.host}:{doors.http_port}", KEY, concurrency=3)
    return asyncio.run(runner.run(src, out, progress=False))


def _records(out) -> dict[int, dict]:
    records = {}
    for text in out.read_text().splitlines():
        try:
            record = json.loads(text)
        except ValueError:
            continue
        assert record["line"] not in records, f"line {record['line']} answered twice"
        records[record["line"]] = record
    return records


def test_every_line_gets_one_result_and_bad_lines_do_not_fail_the_job(cluster, tmp_path):
    src, out = _input(tmp_path), tmp_path / "out.jsonl"
    summary = _run(cluster, src, out)
    assert (summary.lines, summary.succeeded, summary.failed) == (11, 6, 5)
    records = _records(out)
    assert sorted(records) == list(range(1, 12))
    for n in range(1, 6):
        response = records[n]["response"]
        assert records[n]["custom_id"] == f"c{n - 1}" and records[n]["error"] is None
        assert response["status_code"] == 200
        assert response["body"]["usage"]["completion_tokens"] == n + 1
    assert records[6]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    codes = {n: records[n]["error"]["code"] for n in range(7, 12)}
    assert codes == {
        7: "invalid_json",
        8: "invalid_request",
        9: "duplicate_custom_id",
        10: "invalid_url",
        11: "http_400",
    }
    assert "temperature" in records[11]["error"]["message"]
    assert _run(cluster, src, out).skipped == 11, "a finished job resumes to nothing"


def test_an_interrupted_job_resumes_without_running_a_line_twice(cluster, tmp_path):
    src, out = _input(tmp_path), tmp_path / "out.jsonl"
    _run(cluster, src, out)
    kept = out.read_text().splitlines()[:4]
    out.write_text("\n".join(kept) + '\n{"id": "batch_req_cut", "custom_')  # cut mid-record
    summary = _run(cluster, src, out)
    assert summary.skipped == 4
    sendable = {1, 2, 3, 4, 5, 6, 11}  # the lines that reach the server
    assert summary.sent == len(sendable - _lines(kept))
    records = _records(out)
    assert sorted(records) == list(range(1, 12))


def test_lines_the_server_never_ran_are_sent_again_on_the_next_run(cluster, tmp_path):
    # a run while the cluster was down (nothing listens on port 1): every sendable line
    # is recorded "unreachable"; the next run against the cluster drops those records
    # and sends the lines, and the lines the first run settled stay as they were
    src, out = _input(tmp_path), tmp_path / "out.jsonl"
    down = BatchRunner("http://127.0.0.1:1", KEY, concurrency=3, retry_for_s=0)
    first = asyncio.run(down.run(src, out, progress=False))
    assert first.errors["unreachable"] == 7 and first.sent == 7
    settled = {n: r for n, r in _records(out).items() if r["error"]["code"] != "unreachable"}
    summary = _run(cluster, src, out)
    assert (summary.resent, summary.sent, summary.skipped) == (7, 7, 4)
    records = _records(out)  # one record a line
    assert sorted(records) == list(range(1, 12))
    assert all(records[n]["response"]["status_code"] == 200 for n in range(1, 7))
    assert all(records[n] == r for n, r in settled.items())
    assert _run(cluster, src, out).skipped == 11


def _lines(texts: list[str]) -> set[int]:
    return {json.loads(t)["line"] for t in texts}


async def _server_batch(base: str, src, cancel: bool = False) -> tuple[dict, str, list[dict]]:
    """Upload ``src``, run it with POST /v1/batches, wait for it; (batch, output, refusals)."""
    import aiohttp

    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=auth) as s:
        refusals = []
        for bad in ({"purpose": "fine-tune"}, {"input_file_id": "file-nope"}):
            form = aiohttp.FormData({"purpose": bad.get("purpose", "batch")})
            form.add_field("file", src.read_bytes(), filename="in.jsonl")
            if "purpose" in bad:
                async with s.post(f"{base}/v1/files", data=form) as r:
                    refusals.append({"status": r.status, **await r.json()})
            else:
                body = {**bad, "endpoint": "/v1/completions", "completion_window": "24h"}
                async with s.post(f"{base}/v1/batches", json=body) as r:
                    refusals.append({"status": r.status, **await r.json()})
        form = aiohttp.FormData({"purpose": "batch"})
        form.add_field("file", src.read_bytes(), filename="in.jsonl")
        async with s.post(f"{base}/v1/files", data=form) as r:
            uploaded = await r.json()
        body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions"}
        async with s.post(f"{base}/v1/batches", json=body) as r:
            batch = await r.json()
        if cancel:
            async with s.post(f"{base}/v1/batches/{batch['id']}/cancel") as r:
                batch = await r.json()
        while batch["status"] == "in_progress":
            await asyncio.sleep(0.2)
            async with s.get(f"{base}/v1/batches/{batch['id']}") as r:
                batch = await r.json()
        async with s.get(f"{base}/v1/files/{batch['output_file_id']}/content") as r:
            output = await r.text()
        async with (
            aiohttp.ClientSession() as anonymous,
            anonymous.get(f"{base}/v1/batches/{batch['id']}") as r,
        ):
            refusals.append({"status": r.status})
    return batch, output, refusals


def _valid_input(tmp_path):
    """The lines of :func:`_input` an upload accepts (the server still refuses the last)."""
    lines = [_line(f"c{i}", {**COMPLETION, "max_tokens": 2 + i}) for i in range(5)]
    lines += [
        _line("chat", CHAT, "/v1/chat/completions"),
        _line("cold", {**COMPLETION, "temperature": -1}),
    ]
    path = tmp_path / "valid.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_post_v1_batches_runs_an_uploaded_file_on_the_server(cluster, tmp_path):
    doors = cluster._bootstrap[1]
    base = f"http://{doors.host}:{doors.http_port}"
    batch, output, refusals = asyncio.run(_server_batch(base, _valid_input(tmp_path)))
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 7, "completed": 6, "failed": 1}
    records = {r["line"]: r for r in map(json.loads, output.splitlines())}
    assert sorted(records) == list(range(1, 8))
    assert records[3]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert records[7]["error"]["code"] == "http_400"
    assert [r["status"] for r in refusals] == [400, 404, 401]
    assert "purpose" in refusals[0]["error"]["message"]
    assert "file-nope" in refusals[1]["error"]["message"]


def test_a_cancelled_batch_stops_and_keeps_what_finished(cluster, tmp_path):
    doors = cluster._bootstrap[1]
    base = f"http://{doors.host}:{doors.http_port}"
    batch, output, _ = asyncio.run(_server_batch(base, _valid_input(tmp_path), cancel=True))
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert len(output.splitlines()) <= 7
