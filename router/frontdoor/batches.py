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
files and batches; only a hash of the key is written down. The files a key
files (its uploads and its batches' outputs) may hold at most
``router.batch_quota_mb`` together: an upload over it is refused (a partial
upload is removed), a batch is not started while the key is at its quota, and a
running batch whose output reaches it sends no more lines and ends ``failed``
(the lines it ran keep their results). A key cannot fill the router's disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web

from pdserve.core.errors import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.batch_runner import URLS, BatchRunner

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 256 << 20
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # file-<hex>, batch_<hex>


class BatchJobs:
    def __init__(self, folder: Path, keys: ApiKeys, quota_bytes: int = 4096 << 20) -> None:
        self.folder = folder
        self.keys = keys
        self.quota_bytes = quota_bytes
        self.uploading: dict[str, int] = {}  # owner -> bytes of its uploads under way
        self.stored: dict[str, int] = {}  # owner -> bytes of its files, read from disk once
        self.base_url = ""  # this front door, set once it listens
        self.verify_tls = True
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.runners: dict[str, BatchRunner] = {}
        (folder / "files").mkdir(parents=True, exist_ok=True)
        (folder / "batches").mkdir(parents=True, exist_ok=True)

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

    def listening(self, base_url: str, tls: bool, mutual_tls: bool) -> None:
        """The front door listens at ``base_url``: batches may run (resumed ones first)."""
        self.base_url = "" if mutual_tls else base_url  # no client certificate of its own
        self.verify_tls = not tls
        for record in sorted(self.folder.glob("batches/*.json")):
            batch = json.loads(record.read_text())
            if batch["status"] in ("validating", "in_progress") and self.base_url:
                logger.info("resuming batch %s", batch["id"])
                self._start(batch, self._key_for(batch["owner"]))

    # -- files ---------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if not request.content_type.startswith("multipart/"):
            raise InvalidArgumentError("file", "upload a multipart form with purpose and file")
        file_id, purpose, name, size = f"file-{uuid.uuid4().hex}", None, "", 0
        path = self.folder / "files" / f"{file_id}.jsonl"
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    name, size = (
                        part.filename or "upload.jsonl",
                        await self._receive(part, path, owner),
                    )
            if purpose != "batch":
                raise InvalidArgumentError("purpose", f"must be 'batch', got {purpose!r}")
            if not size:
                raise InvalidArgumentError("file", "missing or empty")
        except BaseException:  # refused, or the client went away mid-upload: keep nothing
            path.unlink(missing_ok=True)
            raise
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                "filename": name, "purpose": "batch", "owner": owner}  # fmt: skip
        _write(self.folder / "files" / f"{file_id}.json", meta)
        self.stored[owner] = self._stored(owner) + size
        return web.json_response(_public(meta))

    async def _receive(self, part: BodyPartReader, path: Path, owner: str) -> int:
        """Write an upload's bytes; over the file limit or the key's quota: refused."""
        room = self.quota_bytes - self._stored(owner) - self.uploading.get(owner, 0)
        size = 0
        try:
            with open(path, "wb") as f:
                while chunk := await part.read_chunk():
                    size += len(chunk)
                    self.uploading[owner] = self.uploading.get(owner, 0) + len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise InvalidArgumentError(
                            "file", f"larger than {MAX_FILE_BYTES >> 20} MiB"
                        )
                    if size > room:
                        raise InvalidArgumentError("file", self._over_quota("would hold"))
                    f.write(chunk)
        finally:
            left = self.uploading.pop(owner, 0) - size
            if left > 0:
                self.uploading[owner] = left
        return size

    def _stored(self, owner: str) -> int:
        """Bytes of ``owner``'s files (uploads and batch outputs, running ones included):
        read from disk when first asked, then kept up to date as files are written."""
        if owner not in self.stored:
            files = self.folder / "files"
            sizes = ((files / f"{m['id']}.jsonl") for m in self._metas(owner))
            self.stored[owner] = sum(p.stat().st_size for p in sizes if p.is_file())
        return self.stored[owner]

    def _over_quota(self, verb: str) -> str:
        return (
            f"this key's files {verb} over {self.quota_bytes >> 20} MiB "
            "(router.batch_quota_mb): delete some with DELETE /v1/files/{id}"
        )

    def _metas(self, owner: str) -> Iterator[dict[str, Any]]:
        """The records of ``owner``'s files."""
        for path in self.folder.glob("files/*.json"):
            meta = json.loads(path.read_text())
            if meta["owner"] == owner:
                yield meta

    async def delete(self, request: web.Request) -> web.Response:
        meta = self._file(request.match_info["id"], request)
        for record in self.folder.glob("batches/*.json"):
            batch = json.loads(record.read_text())
            uses = meta["id"] in (batch["input_file_id"], batch["output_file_id"])
            if uses and batch["status"] in ("validating", "in_progress"):
                raise ConflictError(
                    "file_id", f"batch {batch['id']} is running on it: cancel it first"
                )
        for suffix in (".jsonl", ".json"):
            (self.folder / "files" / f"{meta['id']}{suffix}").unlink(missing_ok=True)
        self.stored.pop(meta["owner"], None)  # read again from disk when next needed
        return web.json_response({"id": meta["id"], "object": "file", "deleted": True})

    async def files(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        data = sorted((_public(m) for m in self._metas(owner)),
                      key=lambda m: (m["created_at"], m["id"]))  # fmt: skip
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
        if self._stored(owner) >= self.quota_bytes:
            raise ConflictError("input_file_id", self._over_quota("hold"))
        batch_id, out_id = f"batch_{uuid.uuid4().hex}", f"file-{uuid.uuid4().hex}"
        meta = {**_output_meta(out_id, batch_id), "owner": owner}
        _write(self.folder / "files" / f"{out_id}.json", meta)
        (self.folder / "files" / f"{out_id}.jsonl").touch()
        batch = {"id": batch_id, "object": "batch", "endpoint": body["endpoint"], "errors": None,
                 "input_file_id": source["id"], "completion_window": str(body.get("completion_window", "24h")),
                 "status": "in_progress", "output_file_id": out_id, "error_file_id": None,
                 "created_at": int(time.time()), "in_progress_at": int(time.time()),
                 "completed_at": None, "cancelled_at": None, "failed_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "metadata": body.get("metadata"), "owner": owner}  # fmt: skip
        self._save(batch)
        self._start(batch, request.headers.get("Authorization"))
        return web.json_response(self._view(batch))

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self._view(self._batch(request.match_info["id"], request)))

    async def list(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        records = sorted(self.folder.glob("batches/*.json"), key=lambda p: p.stat().st_mtime)
        batches = [json.loads(p.read_text()) for p in records]
        data = [self._view(b) for b in batches if b["owner"] == owner]
        return web.json_response({"object": "list", "data": data})

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
        owner = batch["owner"]

        def room(written: int) -> bool:
            self.stored[owner] = self._stored(owner) + written
            return self.stored[owner] < self.quota_bytes

        runner = BatchRunner(
            self.base_url, _key(authorization), verify_tls=self.verify_tls, room=room
        )
        self.runners[batch["id"]] = runner
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
            why = f"{e}: {self._over_quota('hold')}"
            batch["errors"] = {"object": "list", "data": [{"code": "quota", "message": why}]}
            self._finish(batch, "failed")
        except Exception as e:
            logger.exception("batch %s failed", batch["id"])
            batch["errors"] = {"object": "list", "data": [{"code": "failed", "message": str(e)}]}
            self._finish(batch, "failed")
        finally:
            self.tasks.pop(batch["id"], None)
            self.stored.pop(batch["owner"], None)  # a resumed output may have been trimmed

    def _finish(self, batch: dict[str, Any], status: str) -> None:
        batch.update(self._view(batch), status=status)
        batch[f"{status}_at"] = int(time.time())
        self.runners.pop(batch["id"], None)
        self._save(batch)
        out = self.folder / "files" / batch["output_file_id"]
        meta = json.loads(out.with_suffix(".json").read_text())
        _write(
            out.with_suffix(".json"), {**meta, "bytes": out.with_suffix(".jsonl").stat().st_size}
        )

    def _view(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch as clients see it, with live counts while it runs."""
        out = {k: v for k, v in batch.items() if k != "owner"}
        runner = self.runners.get(batch["id"])
        if runner is not None:
            s = runner.summary
            out["request_counts"] = {"total": s.lines, "completed": s.succeeded + s.skipped,
                                     "failed": s.failed}  # fmt: skip
        return out

    # -- records -------------------------------------------------------------------------------

    def _owner(self, request: web.Request) -> str:
        """A digest of the request's API key (its files and batches are its own)."""
        authorization = request.headers.get("Authorization")
        self.keys.check(authorization)
        return _digest(_key(authorization) or "")

    def _key_for(self, owner: str) -> str | None:
        """The Authorization header of a configured key with this digest (a resumed batch)."""
        for key in self.keys.keys:
            if _digest(key) == owner:
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


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def _public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "owner"}


def _output_meta(file_id: str, batch_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": 0, "created_at": int(time.time()),
            "filename": f"{batch_id}_output.jsonl", "purpose": "batch_output"}  # fmt: skip


def _key(authorization: str | None) -> str | None:
    """The key of ``Bearer <key>`` (None without one)."""
    return authorization.partition(" ")[2].strip() or None if authorization else None


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
