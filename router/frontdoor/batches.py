"""The OpenAI Batch API on the HTTP front door: upload a file, run it as a batch, fetch results.

    POST /v1/files                  multipart: purpose=batch, file=<requests.jsonl>
    GET  /v1/files                  this key's files (uploads and batch outputs)
    GET  /v1/files/{id}             the file object
    GET  /v1/files/{id}/content     its bytes (a batch's output file: one line per request)
    DELETE /v1/files/{id}           deleted (not while a running batch reads or writes it)
    POST /v1/batches                {"input_file_id", "endpoint", "completion_window"}
    GET  /v1/batches[/{id}]         status and request_counts (total, completed, failed)
    POST /v1/batches/{id}/cancel

A batch runs on the router's event loop as a client of this same front door,
with the :class:`~pdserve.router.frontdoor.batch_runner.BatchRunner` behind
``pdserve batch``: its requests carry the submitter's API key and priority -1
unless a line sets one (below online traffic), refused ones are retried after
their Retry-After, a bad line gets an error line instead of failing the batch,
and each line's result is appended to the output file as it ends (successes and
errors in one file: ``error_file_id`` stays null).

Files and batch records live under ``router.batch_dir``. A batch that was
running when the router stopped is resumed when it starts again: lines already
in its output are skipped, and a request that was in flight was cancelled with
its connection, so none runs twice to completion. A key sees only its own
files and batches (listed from its own index, ``owners/<digest>/``); only a hash
of the key is written down. The files a key files (its uploads and its batches'
outputs) may hold at most ``router.batch_quota_mb`` together, counted in one
ledger per key (:mod:`~pdserve.router.frontdoor.batch_store`) where every byte is
reserved before it is written: an upload over it is refused (a partial upload is
removed), a batch is not started while the key is at its quota, and a running
batch whose next record does not fit sends no more lines and ends ``failed`` (the
lines it ran keep their results). A key cannot fill the router's disk.

An upload is checked line by line as it streams in
(:mod:`~pdserve.router.frontdoor.batch_upload`) and refused at its first bad
line; a key keeps at most ``router.batch_max_files`` files and runs at most
``router.batch_max_running`` batches. Resuming at start-up runs in a task: a
record that cannot be resumed is marked ``failed`` with the reason, and a batch
already resumed ``MAX_RESUMES`` times is failed rather than run again, so no
batch can keep the router from starting.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web

from pdserve.core.errors import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from pdserve.core.net import host_port
from pdserve.core.private_files import make_private, open_private, private_dir, write_private
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.batch_runner import URLS, BatchRunner
from pdserve.router.frontdoor.batch_store import BatchLimits, KeyIndex, KeyLedger
from pdserve.router.frontdoor.batch_upload import UploadCheck

logger = logging.getLogger(__name__)

_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # file-<hex>, batch_<hex>
UPLOAD_SLICE = 1 << 20  # bytes of an upload checked and written per trip to a worker thread
MAX_RESUMES = 3  # start-ups a batch may be resumed at; the next finds it failed instead


def front_door_url(scheme: str, host: str, port: int) -> str:
    """The URL a front door's own batches reach it at (a wildcard host: loopback;
    an IPv6 address in brackets)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"{scheme}://{host_port(host, port)}"


class BatchJobs:
    def __init__(self, folder: Path, keys: ApiKeys, limits: BatchLimits | None = None) -> None:
        self.folder = folder
        self.keys = keys
        self.limits = limits or BatchLimits()
        self.ledgers: dict[str, KeyLedger] = {}  # owner -> its bytes, read from disk once
        self.uploads: dict[str, int] = {}  # owner -> its uploads under way
        self.base_url = ""  # this front door, set once it listens
        self.verify_tls = True
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.runners: dict[str, BatchRunner] = {}
        self.running: dict[str, dict[str, Any]] = {}  # batch id -> its record, while it runs
        # request data and key digests: 0700 folders of 0600 files (older ones narrowed)
        private_dir(folder / "files")
        private_dir(folder / "batches")
        make_private(folder)
        self.secret, new_secret = _secret(folder)
        if new_secret:
            _rekey(folder, self.secret, keys.keys)
        if not (folder / "owners").is_dir():  # records written before there were indexes
            _index_all(folder)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.files)
        app.router.add_get("/v1/files/{id}", self.file)
        app.router.add_get("/v1/files/{id}/content", self.content)
        app.router.add_delete("/v1/files/{id}", self.delete)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{id}", self.get)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    def listening(self, base_url: str, tls: bool, mutual_tls: bool) -> asyncio.Task[None]:
        """The front door listens at ``base_url``: batches may run, those that were running
        when the router stopped first (resumed in a task: a batch that cannot be is marked
        failed with the reason; nothing here can stop the router starting)."""
        self.base_url = "" if mutual_tls else base_url  # no client certificate of its own
        self.verify_tls = not tls
        return asyncio.ensure_future(self._resume_all())

    async def _resume_all(self) -> None:
        if not self.base_url:
            return
        records = await asyncio.to_thread(_running_records, self.folder)
        for record in records:
            try:
                self._resume(record)
            except Exception as e:  # a record this router cannot run: say so, go on
                logger.exception("batch record %s could not be resumed", record.name)
                with contextlib.suppress(Exception):
                    batch = json.loads(record.read_text())
                    self._fail(batch, "resume", f"could not be resumed at start-up: {e!r}")

    def _resume(self, record: Path) -> None:
        batch = json.loads(record.read_text())
        for field in ("id", "owner", "input_file_id", "output_file_id"):
            if not isinstance(batch.get(field), str):
                raise ValueError(f"the record has no {field}")
        batch["resumes"] = int(batch.get("resumes", 0)) + 1
        if batch["resumes"] > MAX_RESUMES:  # the router stopped each time it ran: not again
            why = f"the router stopped {MAX_RESUMES} times while it ran; not resumed again"
            self._fail(batch, "resume", why)
            return
        self._save(batch)  # counted before it runs: a crash while it runs still counts
        logger.info("resuming batch %s", batch["id"])
        self._start(batch, self._key_for(batch["owner"]))

    # -- files ---------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if not request.content_type.startswith("multipart/"):
            raise InvalidArgumentError("file", "upload a multipart form with purpose and file")
        self._check_file_count(owner, 1)
        file_id, purpose, name, size = f"file-{uuid.uuid4().hex}", None, "", 0
        path = self.folder / "files" / f"{file_id}.jsonl"
        self.uploads[owner] = self.uploads.get(owner, 0) + 1
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await part.read_chunk(1024)).decode(errors="replace").strip()
                elif part.name == "file" and not size:
                    name, size = (
                        part.filename or "upload.jsonl",
                        await self._receive(part, path, owner),
                    )
            if purpose != "batch":
                raise InvalidArgumentError("purpose", f"must be 'batch', got {purpose!r}")
            if not size:
                raise InvalidArgumentError("file", "missing or empty")
        except BaseException:  # refused, or the client went away mid-upload: keep nothing
            await asyncio.to_thread(path.unlink, True)
            self._ledger(owner).release(size)
            raise
        finally:
            self.uploads[owner] -= 1
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": name[:256],
            "purpose": "batch",
            "owner": owner,
        }
        await asyncio.to_thread(self._add_file, meta)
        return web.json_response(_public(meta))

    async def _receive(self, part: BodyPartReader, path: Path, owner: str) -> int:
        """Check and write an upload's bytes, each reserved in the key's ledger before it is
        written: over a limit, its quota, or at a bad line: refused (the caller releases)."""
        check = UploadCheck(self.limits.max_file_lines, self.limits.max_line_bytes)
        ledger, size, pending = self._ledger(owner), 0, bytearray()
        out = await asyncio.to_thread(open_private, path, "wb")
        try:
            while chunk := await part.read_chunk(1 << 16):
                if size + len(chunk) > self.limits.max_file_bytes:
                    raise InvalidArgumentError("file", self._too_big())
                if not ledger.reserve(len(chunk)):
                    raise InvalidArgumentError("file", self._over_quota("would hold"))
                size += len(chunk)
                pending += chunk
                if len(pending) >= UPLOAD_SLICE:
                    await asyncio.to_thread(_check_and_write, check, out, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(_check_and_write, check, out, bytes(pending))
            await asyncio.to_thread(check.end)
        except BaseException:
            ledger.release(size)
            raise
        finally:
            await asyncio.to_thread(out.close)
        return size

    def _add_file(self, meta: dict[str, Any]) -> None:
        _write(self.folder / "files" / f"{meta['id']}.json", meta)
        self._index(meta["owner"]).add(meta["id"])

    def _ledger(self, owner: str) -> KeyLedger:
        """``owner``'s ledger: the bytes of its files (uploads and batch outputs, running
        ones included), read from disk when first asked, then kept by reservations."""
        if owner not in self.ledgers:
            files = self.folder / "files"
            paths = (files / f"{i}.jsonl" for i in self._index(owner).ids("file-"))
            used = sum(p.stat().st_size for p in paths if p.is_file())
            self.ledgers[owner] = KeyLedger(self.limits.quota_bytes, used)
        return self.ledgers[owner]

    def _index(self, owner: str) -> KeyIndex:
        return KeyIndex(self.folder / "owners" / owner)

    def _check_file_count(self, owner: str, more: int) -> None:
        count = len(self._index(owner).ids("file-")) + self.uploads.get(owner, 0)
        if count + more > self.limits.max_files:
            raise ConflictError(
                "router.batch_max_files",
                f"this key keeps {count} files, at most {self.limits.max_files} "
                "(router.batch_max_files): delete some with DELETE /v1/files/{id}",
            )

    def _too_big(self) -> str:
        return f"larger than {self.limits.max_file_bytes >> 20} MiB (router.batch_max_file_mb)"

    def _over_quota(self, verb: str) -> str:
        return (
            f"this key's files {verb} over {self.limits.quota_bytes >> 20} MiB "
            "(router.batch_quota_mb): delete some with DELETE /v1/files/{id}"
        )

    def _metas(self, owner: str) -> list[dict[str, Any]]:
        """The records of ``owner``'s files (its index, then those records only)."""
        files = self.folder / "files"
        metas = []
        for file_id in self._index(owner).ids("file-"):
            with contextlib.suppress(OSError, ValueError):
                metas.append(json.loads((files / f"{file_id}.json").read_text()))
        return metas

    async def delete(self, request: web.Request) -> web.Response:
        meta = self._file(request.match_info["id"], request)
        for batch in self.running.values():
            if meta["id"] in (batch["input_file_id"], batch["output_file_id"]):
                raise ConflictError(
                    "file_id", f"batch {batch['id']} is running on it: cancel it first"
                )
        freed = await asyncio.to_thread(self._remove_file, meta)
        self._ledger(meta["owner"]).release(freed)
        return web.json_response({"id": meta["id"], "object": "file", "deleted": True})

    def _remove_file(self, meta: dict[str, Any]) -> int:
        """Remove a file's bytes, record and index entry; the bytes it held."""
        data = self.folder / "files" / f"{meta['id']}.jsonl"
        size = data.stat().st_size if data.is_file() else 0
        data.unlink(missing_ok=True)
        (self.folder / "files" / f"{meta['id']}.json").unlink(missing_ok=True)
        self._index(meta["owner"]).remove(meta["id"])
        return size

    async def files(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        metas = await asyncio.to_thread(self._metas, owner)
        data = sorted((_public(m) for m in metas), key=lambda m: (m["created_at"], m["id"]))
        return web.json_response({"object": "list", "data": data})

    async def file(self, request: web.Request) -> web.Response:
        return web.json_response(_public(self._file(request.match_info["id"], request)))

    async def content(self, request: web.Request) -> web.FileResponse:
        meta = self._file(request.match_info["id"], request)
        return web.FileResponse(self.folder / "files" / f"{meta['id']}.jsonl")

    # -- batches -------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if not self.base_url:
            raise UnsupportedError(
                "batches: not with client-certificate TLS; run pdserve batch against the server"
            )
        try:
            body = await request.json()
        except ValueError as e:
            raise InvalidArgumentError("body", f"not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise InvalidArgumentError("body", "must be a JSON object")
        if body.get("endpoint") not in URLS:
            raise InvalidArgumentError("endpoint", f"must be one of {URLS}")
        source = self._file(str(body.get("input_file_id")), request, "input_file_id")
        if source.get("purpose") != "batch":
            raise InvalidArgumentError("input_file_id", "must be an uploaded file (purpose batch)")
        self._check_room_for_batch(owner)
        batch_id, out_id = f"batch_{uuid.uuid4().hex}", f"file-{uuid.uuid4().hex}"
        meta = {**_output_meta(out_id, batch_id), "owner": owner}
        batch = {
            "id": batch_id,
            "object": "batch",
            "endpoint": body["endpoint"],
            "errors": None,
            "input_file_id": source["id"],
            "completion_window": str(body.get("completion_window", "24h"))[:16],
            "status": "in_progress",
            "output_file_id": out_id,
            "error_file_id": None,
            "created_at": int(time.time()),
            "in_progress_at": int(time.time()),
            "completed_at": None,
            "cancelled_at": None,
            "failed_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": _metadata(body.get("metadata")),
            "owner": owner,
        }
        await asyncio.to_thread(self._add_batch, batch, meta)
        self._start(batch, request.headers.get("Authorization"))
        return web.json_response(self._view(batch))

    def _check_room_for_batch(self, owner: str) -> None:
        """Refuse a batch the key's running-batch limit, file limit or quota has no room for."""
        running = sum(1 for b in self.running.values() if b["owner"] == owner)
        if running >= self.limits.max_running:
            raise ConflictError(
                "router.batch_max_running",
                f"this key runs {running} batches, at most {self.limits.max_running} "
                "(router.batch_max_running): wait for one to end or cancel one",
            )
        self._check_file_count(owner, 1)  # its output file
        if self._ledger(owner).full():
            raise ConflictError("input_file_id", self._over_quota("hold"))

    def _add_batch(self, batch: dict[str, Any], output: dict[str, Any]) -> None:
        """Write a new batch's record and its (empty) output file's, and index both."""
        _write(self.folder / "files" / f"{output['id']}.json", output)
        open_private(self.folder / "files" / f"{output['id']}.jsonl", "ab").close()
        self._index(batch["owner"]).add(output["id"])
        self._save(batch)
        self._index(batch["owner"]).add(batch["id"])

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self._view(self._batch(request.match_info["id"], request)))

    async def list(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        batches = await asyncio.to_thread(self._batches, owner)
        batches.sort(key=lambda b: (b["created_at"], b["id"]))
        return web.json_response({"object": "list", "data": [self._view(b) for b in batches]})

    def _batches(self, owner: str) -> builtins.list[dict[str, Any]]:
        """The records of ``owner``'s batches (its index, then those records only)."""
        out = []
        for batch_id in self._index(owner).ids("batch_"):
            if batch_id in self.running:
                out.append(self.running[batch_id])
                continue
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads((self.folder / "batches" / f"{batch_id}.json").read_text()))
        return out

    async def cancel(self, request: web.Request) -> web.Response:
        batch = self._batch(request.match_info["id"], request)
        task = self.tasks.get(batch["id"])
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        elif batch["status"] == "in_progress":  # its task did not survive a restart
            self._finish(batch, "cancelled")
        return web.json_response(self._view(self._batch(batch["id"], request)))

    # -- running -------------------------------------------------------------------------------

    def _start(self, batch: dict[str, Any], authorization: str | None) -> None:
        runner = BatchRunner(
            self.base_url,
            _key(authorization),
            verify_tls=self.verify_tls,
            budget=self._ledger(batch["owner"]),
        )
        self.runners[batch["id"]] = runner
        self.running[batch["id"]] = batch
        self.tasks[batch["id"]] = asyncio.ensure_future(self._run(batch, runner))

    async def _run(self, batch: dict[str, Any], runner: BatchRunner) -> None:
        files = self.folder / "files"
        try:
            await runner.run(
                files / f"{batch['input_file_id']}.jsonl",
                files / f"{batch['output_file_id']}.jsonl",
                progress=False,
            )
            self._finish(batch, "completed")
        except asyncio.CancelledError:
            self._finish(batch, "cancelled")
            raise
        except ConflictError as e:  # its output reached the key's quota
            logger.warning("batch %s stopped: %s", batch["id"], e)
            self._fail(batch, "quota", f"{e}: {self._over_quota('hold')}")
        except Exception as e:
            logger.exception("batch %s failed", batch["id"])
            self._fail(batch, "failed", str(e) or repr(e))
        finally:
            self.tasks.pop(batch["id"], None)
            self.running.pop(batch["id"], None)

    def _fail(self, batch: dict[str, Any], code: str, why: str) -> None:
        batch["errors"] = {"object": "list", "data": [{"code": code, "message": why}]}
        self._finish(batch, "failed")

    def _finish(self, batch: dict[str, Any], status: str) -> None:
        batch.update(self._view(batch), status=status)
        batch[f"{status}_at"] = int(time.time())
        self.runners.pop(batch["id"], None)
        self._save(batch)
        out = self.folder / "files" / str(batch.get("output_file_id"))
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads(out.with_suffix(".json").read_text())
            size = out.with_suffix(".jsonl").stat().st_size
            _write(out.with_suffix(".json"), {**meta, "bytes": size})

    def _view(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch as clients see it, with live counts while it runs."""
        out = {k: v for k, v in batch.items() if k != "owner"}
        runner = self.runners.get(batch["id"])
        if runner is not None:
            s = runner.summary
            out["request_counts"] = {
                "total": s.lines,
                "completed": s.succeeded + s.skipped,
                "failed": s.failed,
            }
        return out

    # -- records -------------------------------------------------------------------------------

    def _owner(self, request: web.Request) -> str:
        """A digest of the request's API key (its files and batches are its own)."""
        authorization = request.headers.get("Authorization")
        self.keys.check(authorization)
        return _digest(self.secret, _key(authorization) or "")

    def _key_for(self, owner: str) -> str | None:
        """The Authorization header of a configured key with this digest (a resumed batch)."""
        for key in self.keys.keys:
            if _digest(self.secret, key) == owner:
                return f"Bearer {key}"
        return None

    def _file(self, file_id: str, request: web.Request, field: str = "file_id") -> dict[str, Any]:
        return self._record("files", file_id, request, field)

    def _batch(self, batch_id: str, request: web.Request) -> dict[str, Any]:
        return self._record("batches", batch_id, request, "batch_id")

    def _record(self, kind: str, name: str, request: web.Request, field: str) -> dict[str, Any]:
        owner = self._owner(request)
        path = self.folder / kind / f"{name}.json"
        if not _ID.fullmatch(name) or not path.is_file():
            raise NotFoundError(field, f"no such {kind[:-1]}: {name[:128]!r}")
        record: dict[str, Any] = json.loads(path.read_text())
        if record["owner"] != owner:
            raise NotFoundError(field, f"no such {kind[:-1]}: {name[:128]!r}")
        return record

    def _save(self, batch: dict[str, Any]) -> None:
        _write(self.folder / "batches" / f"{batch['id']}.json", batch)


def _check_and_write(check: UploadCheck, out: Any, data: bytes) -> None:
    """Check an upload's next bytes, then write them (in a worker thread)."""
    check.feed(data)
    out.write(data)


def _running_records(folder: Path) -> list[Path]:
    """The records of batches that were running when the router stopped (start-up only)."""
    found = []
    for record in sorted(folder.glob("batches/*.json")):
        try:
            status = json.loads(record.read_text()).get("status")
        except (OSError, ValueError, AttributeError):
            logger.warning("batch record %s is unreadable; left as it is", record)
            continue
        if status in ("validating", "in_progress"):
            found.append(record)
    return found


def _index_all(folder: Path) -> None:
    """Build every key's index from the records (once: a folder from before indexes)."""
    for kind in ("files", "batches"):
        for record in folder.glob(f"{kind}/*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                KeyIndex(folder / "owners" / json.loads(record.read_text())["owner"]).add(
                    record.stem
                )
    private_dir(folder / "owners")


def _metadata(value: Any) -> Any:
    """A batch's ``metadata`` as OpenAI bounds it: at most 16 short string pairs."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16:
        raise InvalidArgumentError("metadata", "must be an object of at most 16 pairs")
    for k, v in value.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise InvalidArgumentError(
                "metadata", "keys of at most 64 characters, string values of at most 512"
            )
    return value


def _write(path: Path, record: dict[str, Any]) -> None:
    write_private(path, json.dumps(record))


def _public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "owner"}


def _output_meta(file_id: str, batch_id: str) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": 0,
        "created_at": int(time.time()),
        "filename": f"{batch_id}_output.jsonl",
        "purpose": "batch_output",
    }


def _key(authorization: str | None) -> str | None:
    """The key of ``Bearer <key>`` (None without one)."""
    return authorization.partition(" ")[2].strip() or None if authorization else None


def _digest(secret: bytes, key: str) -> str:
    """A key's owner name on disk: keyed by the folder's secret, so the records and
    index folders reveal nothing a guessed key could be checked against offline."""
    return hmac.new(secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def _secret(folder: Path) -> tuple[bytes, bool]:
    """The folder's digest key (0600, made once), and whether it was made now."""
    path = folder / "owner.key"
    try:
        with open_private(path, "xb") as f:
            f.write(os.urandom(32))
        made = True
    except FileExistsError:
        made = False
    return path.read_bytes(), made


def _rekey(folder: Path, secret: bytes, keys: Iterable[str]) -> None:
    """Records an older pdserve owned by a key's unkeyed sha256 move to its keyed digest
    (with their index); those of keys no longer configured stay unreachable, as before."""
    renamed = {
        hashlib.sha256(k.encode("utf-8", "surrogatepass")).hexdigest(): _digest(secret, k)
        for k in keys
    }
    for record in [*folder.glob("files/*.json"), *folder.glob("batches/*.json")]:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            meta = json.loads(record.read_text())
            if (new := renamed.get(meta["owner"])) is not None:
                _write(record, {**meta, "owner": new})
    for old, new in renamed.items():
        if (folder / "owners" / old).is_dir() and not (folder / "owners" / new).exists():
            (folder / "owners" / old).rename(folder / "owners" / new)
