"""Batch jobs: a file of requests in the OpenAI Batch API format, run on a cluster.

    pdserve batch --input requests.jsonl --output results.jsonl --url http://host:8000

Each input line is ``{"custom_id": ..., "method": "POST", "url":
"/v1/completions" | "/v1/chat/completions", "body": {...}}``. Each output line
is ``{"id", "custom_id", "line", "response": {"status_code", "request_id",
"body"}, "error"}``, written as soon as its request ends, in the order they end.

- **Lower priority than online traffic**: every request carries ``priority``
  (default -1) unless its body sets one; the router admits negative priorities
  only within ``router.low_priority_share`` of a region's cap, and a refused
  request (429, or 503 while instances restart) is retried after the
  ``Retry-After`` the server sent, for up to ``--retry-for-s``.
- **Resumable**: lines already in the output file (by input line number) are
  skipped, so an interrupted job is continued by running the same command. A
  request in flight when the job stopped was cancelled with its connection, so
  no request runs twice to completion. A line whose record says the server could
  not be reached, or refused it for load (429, 503) until ``--retry-for-s`` ran
  out, is not final: the next run drops that record and sends the line again.
- **Bad lines do not fail the job**: a line that is not JSON, lacks a
  ``custom_id``, repeats one, or names another method or URL gets an output
  line with ``error`` set and is never sent; a request the server refuses
  (4xx) gets its status and error body.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from pdserve.core.errors import ConflictError

URLS = ("/v1/completions", "/v1/chat/completions")
RETRY_STATUSES = (429, 503)
# the error codes of records a later run sends again: the server never ran them
RETRY_CODES = frozenset(("unreachable", *(f"http_{s}" for s in RETRY_STATUSES)))


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchSummary:
    lines: int = 0
    skipped: int = 0  # already in the output file
    resent: int = 0  # records of an earlier run the server never ran, dropped and sent again
    sent: int = 0
    succeeded: int = 0
    failed: int = 0  # an error line, or a non-2xx answer
    retries: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def parse_input(path: Path) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The valid lines to send, and an output record for every line that is not."""
    good: list[BatchLine] = []
    bad: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            parsed = _parse_line(n, text, seen)
            if isinstance(parsed, BatchLine):
                seen.add(parsed.custom_id)
                good.append(parsed)
            else:
                bad.append(parsed)
    return good, bad


def _parse_line(n: int, text: str, seen: set[str]) -> BatchLine | dict[str, Any]:
    try:
        item = json.loads(text)
    except ValueError as e:
        return error_record(n, None, "invalid_json", f"line {n} is not JSON: {e}")
    if not isinstance(item, dict):
        return error_record(n, None, "invalid_request", f"line {n} is not a JSON object")
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return error_record(n, None, "invalid_request", "custom_id: must be a non-empty string")
    if cid in seen:
        return error_record(n, cid, "duplicate_custom_id", f"custom_id {cid!r} repeats a line")
    if item.get("method", "POST") != "POST" or item.get("url") not in URLS:
        message = f"url: must be POST to one of {URLS}, got {item.get('url')!r}"
        return error_record(n, cid, "invalid_url", message)
    if not isinstance(item.get("body"), dict):
        return error_record(n, cid, "invalid_request", "body: must be a JSON object")
    return BatchLine(n, cid, item["url"], item["body"])


def error_record(line: int, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "line": line,
        "response": None,
        "error": {"code": code, "message": message},
    }


def finished_lines(output: Path) -> set[int]:
    """Input line numbers that already have a final output record (a resumed job skips them)."""
    return {line for line, _, final in _records(output) if final}


def settle_output(output: Path) -> tuple[set[int], int]:
    """(finished lines, records dropped): the records of lines the server never ran
    (unreachable, or refused for load past the retry window) leave the file, which is
    rewritten whole (a crash leaves the old file or the new, never half of one)."""
    records = _records(output)
    stale = sum(1 for _, _, final in records if not final)
    if stale:
        tmp = output.with_name(output.name + ".settling")
        tmp.write_text("".join(text for _, text, final in records if final), encoding="utf-8")
        os.replace(tmp, output)
    return {line for line, _, final in records if final}, stale


def _records(output: Path) -> list[tuple[int, str, bool]]:
    """(input line, text, final) of each whole record in the output file."""
    if not output.exists():
        return []
    out = []
    with open(output, encoding="utf-8") as f:
        for text in f:
            try:
                record = json.loads(text)
                line = int(record["line"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by an interruption: run it again
            error = record.get("error")
            code = error.get("code") if isinstance(error, dict) else None
            out.append(
                (line, text if text.endswith("\n") else text + "\n", code not in RETRY_CODES)
            )
    return out


class BatchRunner:
    """Sends the lines with bounded concurrency and appends each result as it ends."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        concurrency: int = 8,
        priority: int = -1,
        retry_for_s: float = 600.0,
        timeout_s: float = 600.0,
        verify_tls: bool = True,
        room: Callable[[int], bool] | None = None,
    ) -> None:
        """``room``, where the output's size is limited (the front door's batches): called
        with each record's bytes as it is written, False once the limit is reached; no
        further line is then sent, and :meth:`run` raises ConflictError after the
        requests in flight are written (the lines not sent have no record)."""
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = concurrency
        self.priority = priority
        self.retry_for_s = retry_for_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.verify_tls = verify_tls  # False: a front door running its own batch over TLS
        self.summary = BatchSummary()
        self.room = room
        self.full = False  # the output reached its limit

    async def run(self, input_path: Path, output: Path, progress: bool = True) -> BatchSummary:
        good, bad = parse_input(input_path)
        done, self.summary.resent = settle_output(output)
        todo_bad = [r for r in bad if r["line"] not in done]
        todo = [line for line in good if line.line not in done]
        self.summary.lines = len(good) + len(bad)
        self.summary.skipped = self.summary.lines - len(todo) - len(todo_bad)
        bar = tqdm(total=self.summary.lines, initial=self.summary.skipped, disable=not progress)
        _end_last_line(output)
        with open(output, "a", encoding="utf-8") as out:
            for record in todo_bad:
                self._write(out, record, bar)
            gate = asyncio.Semaphore(self.concurrency)
            connector = aiohttp.TCPConnector(ssl=self.verify_tls)
            async with aiohttp.ClientSession(timeout=self.timeout, connector=connector) as session:

                async def one(line: BatchLine) -> None:
                    async with gate:
                        if not self.full:
                            self._write(out, await self._send(session, line), bar)

                await asyncio.gather(*(one(line) for line in todo))
        bar.close()
        if self.full:
            unsent = self.summary.lines - self.summary.skipped
            unsent -= self.summary.succeeded + self.summary.failed
            raise ConflictError("output", f"reached its size limit; {unsent} lines not sent")
        return self.summary

    def _write(self, out: Any, record: dict[str, Any], bar: tqdm) -> None:
        response = record["response"]
        ok = record["error"] is None and response is not None and response["status_code"] < 300
        if ok:
            self.summary.succeeded += 1
        else:
            self.summary.failed += 1
            code = record["error"]["code"] if record["error"] else "unknown"
            self.summary.errors[code] = self.summary.errors.get(code, 0) + 1
        text = json.dumps(record) + "\n"
        out.write(text)
        out.flush()
        bar.update(1)
        if self.room is not None and not self.room(len(text.encode())):
            self.full = True

    async def _send(self, session: aiohttp.ClientSession, line: BatchLine) -> dict[str, Any]:
        body = {**line.body, "stream": False}
        body.setdefault("priority", self.priority)
        deadline = time.monotonic() + self.retry_for_s
        self.summary.sent += 1
        while True:
            try:
                async with session.post(
                    self.base_url + line.url, json=body, headers=self.headers
                ) as resp:
                    payload = await _json(resp)
                    retry_after = float(resp.headers.get("Retry-After", "1"))
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status, payload, retry_after = 0, {"error": {"message": str(e)}}, 1.0
            if status in (*RETRY_STATUSES, 0) and time.monotonic() + retry_after < deadline:
                self.summary.retries += 1
                await asyncio.sleep(retry_after)
                continue
            return _record(line, status, payload)


def _end_last_line(path: Path) -> None:
    """A record cut short by an interruption gets its newline, so the next one starts clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


async def _json(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        got = await resp.json(content_type=None)
    except (ValueError, aiohttp.ContentTypeError):
        return {"error": {"message": (await resp.text())[:1000]}}
    return got if isinstance(got, dict) else {"value": got}


def _record(line: BatchLine, status: int, payload: dict[str, Any]) -> dict[str, Any]:
    error = None
    if not 200 <= status < 300:
        found = payload.get("error")
        detail: dict[str, Any] = found if isinstance(found, dict) else {}
        code = "unreachable" if status == 0 else f"http_{status}"
        error = {"code": code, "message": str(detail.get("message", payload))}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "line": line.line,
        "response": None
        if status == 0
        else {"status_code": status, "request_id": payload.get("id"), "body": payload},
        "error": error,
    }
