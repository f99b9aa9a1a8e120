"""The Batch API's cost to the router: RSS growth for a large upload, and /health
latency while a large batch runs (``python -m pdserve.bench.batch_api``).

The front door runs in a child process (a router with no instance: every line of the
batch is answered 404 at once, so the runner goes as fast as it can, the worst case for
the event loop); this process uploads from disk, polls ``/health`` every 10 ms while
the batch runs, and reads the child's RSS from ``/proc``.

    python -m pdserve.bench.batch_api --upload-mb 199 --batch-lines 50000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

KEY = "bench"


def _serve(folder: str, quota_mb: int, max_lines: int, port_out: Any) -> None:
    from aiohttp import web

    from pdserve.router.config import RouterConfig
    from pdserve.router.frontdoor.auth import ApiKeys
    from pdserve.router.frontdoor.http_api import HttpApi, start_http
    from pdserve.router.router import Router

    config = RouterConfig(
        model_name="tiny",
        api_keys=(KEY,),
        batch_quota_mb=quota_mb,
        batch_max_file_mb=quota_mb,
        batch_max_file_lines=max_lines,
    )
    api = HttpApi(
        Router(config, None, None, vocab_size=100), ApiKeys((KEY,), False), 1 << 20, Path(folder)
    )

    async def main() -> None:
        runner, port = await start_http(api, "127.0.0.1", 0)
        assert api.batches is not None
        api.batches.listening(f"http://127.0.0.1:{port}", False, False)
        port_out.send(port)
        await asyncio.Event().wait()
        await runner.cleanup()

    del web
    asyncio.run(main())


def _kib(pid: int, field: str) -> int:
    for text in Path(f"/proc/{pid}/status").read_text().splitlines():
        if text.startswith(field + ":"):
            return int(text.split()[1])
    raise KeyError(field)


def _write_lines(path: Path, count: int, line_bytes: int) -> None:
    pad = max(0, line_bytes - 120)
    with open(path, "w") as f:
        for i in range(count):
            body = {"model": "nosuch", "prompt": [1, 2], "max_tokens": 2, "user": "x" * pad}
            item = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(item) + "\n")


async def _upload(session: aiohttp.ClientSession, base: str, path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        form = aiohttp.FormData({"purpose": "batch"})
        form.add_field("file", f, filename=path.name)
        async with session.post(f"{base}/v1/files", data=form) as r:
            answer: dict[str, Any] = await r.json()
            assert r.status == 200, answer
            return answer


async def _measure(base: str, pid: int, big: Path, batch: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout
    ) as s:
        before = _kib(pid, "VmRSS")
        start = time.monotonic()
        uploaded = await _upload(s, base, big)
        out["upload_mib"] = round(uploaded["bytes"] / 2**20, 1)
        out["upload_s"] = round(time.monotonic() - start, 1)
        out["upload_rss_growth_mib"] = round((_kib(pid, "VmHWM") - before) / 1024, 1)
        async with s.delete(f"{base}/v1/files/{uploaded['id']}") as r:
            assert r.status == 200
        source = await _upload(s, base, batch)
        create = {"input_file_id": source["id"], "endpoint": "/v1/completions"}
        async with s.post(f"{base}/v1/batches", json=create) as r:
            job = await r.json()
        latencies, start = [], time.monotonic()
        while job["status"] == "in_progress":
            t0 = time.perf_counter()
            async with s.get(f"{base}/health") as r:
                await r.read()
            latencies.append(time.perf_counter() - t0)
            if len(latencies) % 50 == 0:
                async with s.get(f"{base}/v1/batches/{job['id']}") as r:
                    job = await r.json()
            await asyncio.sleep(0.01)
        latencies.sort()
        out["batch_lines"] = job["request_counts"]["total"]
        out["batch_status"] = job["status"]
        out["batch_s"] = round(time.monotonic() - start, 1)
        out["health_polls"] = len(latencies)
        for q in (0.5, 0.99):
            out[f"health_p{int(q * 100)}_ms"] = round(
                latencies[int(q * (len(latencies) - 1))] * 1e3, 2
            )
        out["health_max_ms"] = round(latencies[-1] * 1e3, 2)
        out["batch_rss_peak_mib"] = round(_kib(pid, "VmHWM") / 1024, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upload-mb", type=int, default=199, help="the large upload (MB)")
    p.add_argument("--quota-mb", type=int, default=200, help="the key's quota (MiB)")
    p.add_argument("--batch-lines", type=int, default=50_000, help="lines of the batch run")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        big, batch = Path(tmp) / "big.jsonl", Path(tmp) / "batch.jsonl"
        _write_lines(big, 50_000, args.upload_mb * 10**6 // 50_000)
        _write_lines(batch, args.batch_lines, 150)
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        lines = max(50_000, args.batch_lines)
        child = ctx.Process(
            target=_serve, args=(str(Path(tmp) / "store"), args.quota_mb, lines, theirs)
        )
        child.start()
        try:
            port = ours.recv()
            assert child.pid is not None
            result = asyncio.run(_measure(f"http://127.0.0.1:{port}", child.pid, big, batch))
        finally:
            child.terminate()
            child.join()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
