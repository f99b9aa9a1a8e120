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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from tqdm import tqdm

from pdserve.core.errors import ConflictError
from pdserve.core.private_files import open_private

if TYPE_CHECKING:
    from pdserve.router.frontdoor.batch_store import OutputBudget

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
    """The valid lines to send, and an output record for every line that is not
    (the whole file in memory: the runner itself reads it with :class:`LineSource`)."""
    good: list[BatchLine] = []
    bad: list[dict[str, Any]] = []
    with LineSource(path) as source:
        while chunk := source.take(1024):
            for item in chunk:
                (good if isinstance(item, BatchLine) else bad).append(item)  # type: ignore[arg-type]
    return good, bad


class LineSource:
    """An input file read a chunk of lines at a time (call :meth:`take` off the event
    loop): a :class:`BatchLine` or an error record for each line that is not blank."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
        self._number = 0
        self._seen: set[str] = set()

    def take(self, count: int) -> list[BatchLine | dict[str, Any]]:
        out: list[BatchLine | dict[str, Any]] = []
        while len(out) < count and (text := self._file.readline()):
            self._number += 1
            if not text.strip():
                continue
            parsed = parse_line(self._number, text, self._seen)
            if isinstance(parsed, BatchLine):
                self._seen.add(parsed.custom_id)
            out.append(parsed)
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LineSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_lines(path: Path) -> int:
    """Lines that are not blank (run off the event loop)."""
    with open(path, "rb") as f:
        return sum(1 for text in f if text.strip())


def parse_line(
    n: int, text: str, seen: set[str], require_method: bool = False
) -> BatchLine | dict[str, Any]:
    """Line ``n`` as a request, or an error record saying what is wrong with it
    (``require_method``: a line without ``method`` is wrong too, as in an upload)."""
    try:
        item = json.loads(text)
    except ValueError as e:
        return error_record(n, None, "invalid_json", f"line {n} is not JSON: {e}")
    except RecursionError:
        return error_record(n, None, "invalid_json", f"line {n} is JSON nested too deeply")
    if not isinstance(item, dict):
        return error_record(n, None, "invalid_request", f"line {n} is not a JSON object")
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return error_record(n, None, "invalid_request", "custom_id: must be a non-empty string")
    if cid in seen:
        return error_record(n, cid, "duplicate_custom_id", f"custom_id {cid!r} repeats a line")
    method = item.get("method", None if require_method else "POST")
    if method != "POST" or item.get("url") not in URLS:
        message = (
            f"method and url: must be POST to one of {URLS}, "
            f"got {str(method)[:16]!r} {str(item.get('url'))[:64]!r}"
        )
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


def settle_output(output: Path) -> tuple[set[int], int, int]:
    """(finished lines, records dropped, bytes dropped): the records of lines the server
    never ran (unreachable, or refused for load past the retry window) leave the file,
    which is then rewritten whole (a crash leaves the old file or the new, never half of
    one). Reads the file as a stream; run it off the event loop."""
    done: set[int] = set()
    stale = stale_bytes = 0
    for line, text, final in _records(output):
        if final:
            done.add(line)
        else:
            stale += 1
            stale_bytes += len(text.encode())
    if stale:
        tmp = output.with_name(output.name + ".settling")
        with open_private(tmp, "w", encoding="utf-8") as f:
            f.writelines(text for _, text, final in _records(output) if final)
        os.replace(tmp, output)
    return done, stale, stale_bytes


def _records(output: Path) -> Iterator[tuple[int, str, bool]]:
    """(input line, text, final) of each whole record in the output file, as read."""
    if not output.exists():
        return
    with open(output, encoding="utf-8", errors="replace") as f:
        for text in f:
            try:
                record = json.loads(text)
                line = int(record["line"])
            except (ValueError, KeyError, TypeError, RecursionError):
                continue  # a line cut short by an interruption: run it again
            error = record.get("error")
            code = error.get("code") if isinstance(error, dict) else None
            yield line, text if text.endswith("\n") else text + "\n", code not in RETRY_CODES


class BatchRunner:
    """Sends the lines with bounded concurrency and appends each result as it ends.

    The input is read a chunk of lines at a time and every file operation runs in a
    worker thread, so neither a large input nor a slow disk holds the event loop;
    memory is the chunk, the requests in flight and the set of finished line numbers."""

    CHUNK_LINES = 256  # input lines read per trip to a worker thread

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        concurrency: int = 8,
        priority: int = -1,
        retry_for_s: float = 600.0,
        timeout_s: float = 600.0,
        verify_tls: bool = True,
        budget: OutputBudget | None = None,
    ) -> None:
        """``budget``, where the output's size is limited (the front door's batches): each
        record's bytes are reserved there before it is written; once one does not fit,
        nothing more is written nor sent, and :meth:`run` raises ConflictError after the
        requests in flight end (the lines not written have no record)."""
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = concurrency
        self.priority = priority
        self.retry_for_s = retry_for_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.verify_tls = verify_tls  # False: a front door running its own batch over TLS
        self.summary = BatchSummary()
        self.budget = budget
        self.full = False  # the output reached its limit
        self._writing = asyncio.Lock()  # one write at a time, in a worker thread

    async def run(self, input_path: Path, output: Path, progress: bool = True) -> BatchSummary:
        done, self.summary.resent, dropped = await asyncio.to_thread(settle_output, output)
        if self.budget is not None and dropped:
            self.budget.release(dropped)
        self.summary.lines = await asyncio.to_thread(count_lines, input_path)
        bar = tqdm(total=self.summary.lines, disable=not progress)
        await asyncio.to_thread(_end_last_line, output)
        source = await asyncio.to_thread(LineSource, input_path)
        out = await asyncio.to_thread(open_private, output, "ab")
        try:
            await self._send_all(source, done, out, bar)
        finally:
            await asyncio.to_thread(out.close)
            await asyncio.to_thread(source.close)
            bar.close()
        if self.full:
            unsent = self.summary.lines - self.summary.skipped
            unsent -= self.summary.succeeded + self.summary.failed
            raise ConflictError("output", f"reached its size limit; {unsent} lines not sent")
        return self.summary

    async def _send_all(self, source: LineSource, done: set[int], out: Any, bar: tqdm) -> None:
        gate = asyncio.Semaphore(self.concurrency)
        flying: set[asyncio.Task[None]] = set()
        connector = aiohttp.TCPConnector(ssl=self.verify_tls)
        async with aiohttp.ClientSession(timeout=self.timeout, connector=connector) as session:

            async def one(line: BatchLine) -> None:
                try:
                    record = await self._send(session, line)
                    await self._write(out, [record], bar)
                finally:
                    gate.release()

            try:
                while not self.full and (
                    chunk := await asyncio.to_thread(source.take, self.CHUNK_LINES)
                ):
                    todo = [item for item in chunk if _line_of(item) not in done]
                    self.summary.skipped += len(chunk) - len(todo)
                    bar.update(len(chunk) - len(todo))
                    await self._write(out, [r for r in todo if isinstance(r, dict)], bar)
                    for line in todo:
                        if not isinstance(line, BatchLine):
                            continue
                        await gate.acquire()
                        if self.full:
                            gate.release()
                            break
                        task = asyncio.ensure_future(one(line))
                        flying.add(task)
                        task.add_done_callback(flying.discard)
                if flying:
                    await asyncio.gather(*flying)
            finally:
                for task in flying:
                    task.cancel()

    async def _write(self, out: Any, records: list[dict[str, Any]], bar: tqdm) -> None:
        """Append ``records`` whose bytes the budget has room for; at the first that does
        not fit, stop (``full``): it and those after it are not written nor counted."""
        data = []
        for record in records:
            text = (json.dumps(record) + "\n").encode()
            if self.full or (self.budget is not None and not self.budget.reserve(len(text))):
                self.full = True
                break
            data.append(text)
            self._count(record)
        if not data:
            return
        async with self._writing:
            await asyncio.to_thread(_append, out, b"".join(data))
        bar.update(len(data))

    def _count(self, record: dict[str, Any]) -> None:
        response = record["response"]
        ok = record["error"] is None and response is not None and response["status_code"] < 300
        if ok:
            self.summary.succeeded += 1
        else:
            self.summary.failed += 1
            code = record["error"]["code"] if record["error"] else "unknown"
            self.summary.errors[code] = self.summary.errors.get(code, 0) + 1

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


def _line_of(item: BatchLine | dict[str, Any]) -> int:
    return item.line if isinstance(item, BatchLine) else int(item["line"])


def _append(out: Any, data: bytes) -> None:
    out.write(data)
    out.flush()


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
