"""Weights loaded once per node and shared between the node's instances (CPU).

The first instance to load a (checkpoint, rank layout) writes its parameters,
laid out as this rank holds them (shards cut, projections fused), into one
file under ``$PDSERVE_WEIGHTS_CACHE`` (default ``weights/`` in pdserve's cache
folder, ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``),
with a manifest of every parameter's name, dtype, shape and offset. Each
instance, the first included, then maps the file copy-on-write and makes its
parameters views of it:

    checkpoint --(first instance: read, cut, fuse)--> weights file + manifest
    weights file --(mmap, every instance)--> parameters (pages held once per node)

So a node reads the checkpoint once, the page cache holds one copy of the
weights however many instances serve them, and an instance whose layout is in
the cache skips reading and cutting the checkpoint. Parameters are never
written while serving; LoRA adapters, bf16 packing and quantization build new
tensors, private to each process (a written page would be copied for its
process only).

The file's name is a hash of the checkpoint's content, the rank's coordinates
and layer range, and every parameter's name, dtype and shape: a changed
checkpoint or layout gets a file of its own, and a manifest that does not match
is rewritten. The content is a registry version's content hash (which the
loading rank has just checked the files against, :mod:`.loader`); a plain
checkpoint folder, which has none, stands for its files' paths, sizes and
modification times.

The folder is made 0700 and every file in it 0600 (they hold weights). A folder
that is not private (another user's) is not used, nor a file in it that is not
this user's alone: the rank then loads the checkpoint itself. Writing a file removes those of
checkpoints that were deleted or changed since (each file records its sources).
Writers hold a file lock, so instances starting together write it once; the
lock is per file, so the ranks of one instance write theirs at once, and each
file's parts are published whole (written aside, then renamed) for a rank pruning
meanwhile to read: a record it cannot read is left alone, never taken for a
checkpoint that is gone. ``PDSERVE_SHARE_WEIGHTS=0`` turns
it off; parameters on a GPU are never shared (each device holds its own).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdserve.core.env import env_switch
from pdserve.core.private_files import cache_dir as pdserve_cache_dir
from pdserve.core.private_files import (
    is_private_dir,
    is_private_file,
    make_private,
    open_private,
    private_dir,
    write_private,
)

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes: every parameter starts on a cache line
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def cache_dir() -> Path:
    """``$PDSERVE_WEIGHTS_CACHE``, else ``weights`` in pdserve's cache folder."""
    env = os.environ.get("PDSERVE_WEIGHTS_CACHE")
    return Path(env) if env else pdserve_cache_dir() / "weights"


def shareable(model: nn.Module) -> bool:
    if not env_switch("PDSERVE_SHARE_WEIGHTS"):
        return False
    params = list(model.parameters())
    return bool(params) and all(p.device.type == "cpu" and str(p.dtype) in _DTYPES for p in params)


def load_shared(
    model: nn.Module, files: list[Path], rank: str, load: Callable[[], None], content: str = ""
) -> bool:
    """Fill ``model``'s parameters from the node's weights file, writing it with ``load``
    first when it is missing; True if the parameters now map the shared file.

    ``files``: the checkpoint's files; ``rank``: this rank's coordinates and layer range;
    ``content``: the checkpoint's verified content hash ("" if it has none).
    """
    if not shareable(model) or not _private_cache():
        load()
        return False
    manifest = _manifest(model)
    path = cache_dir() / f"{_key(files, rank, manifest, content)}.bin"
    with _locked(path.with_suffix(".lock")):
        if not _matches(path, manifest):
            load()
            _write(model, path, manifest)
            _publish(path.with_suffix(".src"), json.dumps(_stats(files)))
            _prune(path.parent)
    _map(model, path, manifest)
    return True


def _manifest(model: nn.Module) -> list[dict[str, Any]]:
    out, offset = [], 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        out.append(
            {
                "name": name,
                "dtype": str(p.dtype),
                "shape": list(p.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return out


def _private_cache() -> bool:
    folder = cache_dir()
    try:
        make_private(private_dir(folder))  # files an older pdserve wrote 0644 narrowed too
    except OSError as e:
        logger.warning("weights cache %s unusable (%s): loading without it", folder, e)
        return False
    if not is_private_dir(folder):
        logger.warning("weights cache %s is not private to this user: loading without it", folder)
        return False
    return True


def _key(files: list[Path], rank: str, manifest: list[dict[str, Any]], content: str) -> str:
    h = hashlib.sha256(rank.encode())
    if content:
        h.update(f"content:{content}".encode())
    else:
        for f in files:
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(manifest).encode())
    return h.hexdigest()[:32]


def _stats(files: list[Path]) -> dict[str, list[int]]:
    return {str(f.resolve()): [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def _prune(folder: Path) -> None:
    """Remove the files of checkpoints that are gone or changed since they were written."""
    for src in folder.glob("*.src"):
        try:
            recorded = json.loads(src.read_text())
        except (OSError, ValueError):
            continue  # pruned meanwhile by another rank, or not a record of ours
        try:
            current = _stats([Path(f) for f in recorded])
        except OSError:
            current = {}  # a source file is gone
        if current != recorded:
            for suffix in (".bin", ".json", ".src"):
                src.with_suffix(suffix).unlink(missing_ok=True)


def _matches(path: Path, manifest: list[dict[str, Any]]) -> bool:
    meta = path.with_suffix(".json")
    if not (is_private_file(path) and is_private_file(meta)):
        return False
    try:
        return bool(json.loads(meta.read_text()) == manifest)
    except ValueError:
        return False


def _write(model: nn.Module, path: Path, manifest: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    params = dict(model.named_parameters())
    with open_private(tmp, "wb") as f:
        for entry in manifest:
            f.seek(entry["offset"])
            data = params[entry["name"]].detach().contiguous().view(torch.uint8)
            data.numpy().tofile(f)
        f.truncate(_total(manifest))
    tmp.replace(path)
    _publish(path.with_suffix(".json"), json.dumps(manifest))


def _publish(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all, for a reader at any moment."""
    write_private(path, text)


@torch.no_grad()
def _map(model: nn.Module, path: Path, manifest: list[dict[str, Any]]) -> None:
    storage = torch.from_file(str(path), shared=False, size=_total(manifest), dtype=torch.uint8)
    params = dict(model.named_parameters())
    for entry in manifest:
        raw = storage[entry["offset"] : entry["offset"] + entry["nbytes"]]
        params[entry["name"]].data = raw.view(_DTYPES[entry["dtype"]]).view(entry["shape"])


def _total(manifest: list[dict[str, Any]]) -> int:
    last = manifest[-1] if manifest else {"offset": 0, "nbytes": 0}
    return max(int(last["offset"]) + int(last["nbytes"]), 1)


@contextmanager
def _locked(path: Path) -> Any:
    with open_private(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
