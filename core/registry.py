"""A model registry: immutable, content-hashed versions of checkpoints.

    <root>/<name>/<version>/      the checkpoint's files, as pushed
    <root>/<name>/<version>/manifest.json
        {"name", "version", "sha256": hash of the file hashes, "files": {file: sha256},
         "pushed_at", "source"}

``push`` copies a checkpoint folder in, hashing every file, and refuses a
version that exists (versions are immutable: a new checkpoint is a new
version). A model named ``registry:<name>@<version>`` (the cluster YAML's
``model``, ``LLM(...)``, ``--model``) resolves to that folder once every file
matches its recorded hash: a file changed, missing or added after the push is
an error naming the version and the file, never a silent load.

Every check hashes the bytes it reads: nothing is remembered by path, size or
modification time (a file changed with its size and mtime restored is caught).
The controller resolves a version and hands its content hash (``ModelConfig.sha256``)
to every rank it starts, scale-ups and replacements included; each rank checks the
files against that hash again before it loads them (:func:`verify` with
``expected``), so a version changed after the controller checked it, manifest
and all, is refused where it would be loaded.

The root is ``$PDSERVE_REGISTRY``, else ``<cache dir>/registry``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.core.errors import InvalidArgumentError, ModelNotFoundError

PREFIX = "registry:"
MANIFEST = "manifest.json"


def registry_root() -> Path:
    env = os.environ.get("PDSERVE_REGISTRY")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
    return cache / "registry"


def parse_ref(ref: str) -> tuple[str, str]:
    """``registry:name@version`` (the prefix optional) -> (name, version)."""
    body = ref.removeprefix(PREFIX)
    name, sep, version = body.partition("@")
    if not sep or not _valid(name) or not _valid(version):
        raise InvalidArgumentError(
            "model", f"{ref!r}: a registry model is registry:<name>@<version>"
        )
    return name, version


def _valid(part: str) -> bool:
    return bool(part) and part not in (".", "..") and all(c.isalnum() or c in "-_." for c in part)


def file_sha256(path: Path) -> str:
    """The sha256 of the bytes of ``path``, read now."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _content_hash(files: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()


def push(name: str, version: str, source: Path, root: Path | None = None) -> dict[str, Any]:
    """Copy the checkpoint in ``source`` in as ``name@version``; returns its manifest."""
    parse_ref(f"{name}@{version}")
    source = Path(source).expanduser()
    if not (source / "config.json").is_file():
        raise ModelNotFoundError("source", f"{source} is not a checkpoint folder (no config.json)")
    target = (root or registry_root()) / name / version
    if target.exists():
        raise InvalidArgumentError(
            "version", f"{name}@{version} exists; versions are immutable, push a new one"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
    try:
        files = {}
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(source).as_posix()
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, tmp / rel)
            files[rel] = file_sha256(tmp / rel)
        manifest = {
            "name": name,
            "version": version,
            "sha256": _content_hash(files),
            "files": files,
            "pushed_at": time.time(),
            "source": str(source),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.rename(target)  # a reader never sees a half-copied version
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def resolve(ref: str, root: Path | None = None) -> Path:
    """The folder of ``registry:name@version`` once its files match their hashes."""
    name, version = parse_ref(ref)
    base = (root or registry_root()) / name
    folder = base / version
    if not (folder / MANIFEST).is_file():
        known = (
            sorted(p.name for p in base.iterdir() if (p / MANIFEST).is_file())
            if base.is_dir()
            else []
        )
        raise ModelNotFoundError(
            "model", f"{name}@{version} is not in the registry at {base.parent} (versions: {known})"
        )
    verify(folder)
    return folder


def read_manifest(folder: Path) -> dict[str, Any]:
    """A version's manifest, or an error naming the file when it is not one (edited by
    hand, cut short): a broken manifest is never taken for a version."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidArgumentError("model", f"{path} is not a manifest: {e}") from None
    kinds = {
        "name": str,
        "version": str,
        "sha256": str,
        "files": dict,
        "pushed_at": float,
        "source": str,
    }
    if not isinstance(manifest, dict):
        raise InvalidArgumentError("model", f"{path} is not a manifest: not a JSON object")
    for key, kind in kinds.items():
        value = manifest.get(key)
        if not isinstance(value, int | float if kind is float else kind):
            raise InvalidArgumentError(
                "model", f"{path} is not a manifest: {key!r} missing or not a {kind.__name__}"
            )
    outside = [f for f in manifest["files"] if Path(f).is_absolute() or ".." in Path(f).parts]
    if outside:
        raise InvalidArgumentError("model", f"{path} names a file outside its folder: {outside[0]}")
    if (manifest["name"], manifest["version"]) != (folder.parent.name, folder.name):
        raise InvalidArgumentError(
            "model",
            f"{path} names {manifest['name']}@{manifest['version']}, "
            f"not the folder's {folder.parent.name}@{folder.name}",
        )
    return manifest


def content_hash(folder: Path) -> str:
    """The content hash a registry version's manifest records; "" for a folder that is
    not a version (no manifest, or one that is not a registry manifest)."""
    if not (folder / MANIFEST).is_file():
        return ""
    try:
        return str(read_manifest(folder)["sha256"])
    except InvalidArgumentError:
        return ""


def verify(folder: Path, expected: str | None = None) -> dict[str, Any]:
    """Check every file of a version against its manifest (hashing the bytes read now),
    and the manifest against ``expected`` (the content hash the version had when it was
    resolved) when given; returns the manifest."""
    manifest = read_manifest(folder)
    ref = f"{manifest['name']}@{manifest['version']}"
    if expected is not None and manifest["sha256"] != expected:
        got = manifest["sha256"][:16]
        raise InvalidArgumentError(
            "model",
            f"{ref}: its manifest changed since it was resolved (content hash {got}, "
            f"expected {expected[:16]}); refusing to load it",
        )
    files: dict[str, str] = manifest["files"]
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    extra = sorted(present - set(files) - {MANIFEST})
    if extra:
        raise InvalidArgumentError("model", f"{ref}: {extra[0]} was added after the push")
    for rel, want in files.items():
        path = folder / rel
        if not path.is_file():
            raise InvalidArgumentError("model", f"{ref}: {rel} is missing")
        if file_sha256(path) != want:
            raise InvalidArgumentError(
                "model",
                f"{ref}: {rel} does not match its hash (the version was changed since it "
                "was pushed); refusing to load it",
            )
    if _content_hash(files) != manifest["sha256"]:
        raise InvalidArgumentError("model", f"{ref}: the manifest's hash does not match its files")
    return manifest


def versions(root: Path | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Every version's manifest, by name then push time; and, for each manifest that is
    not one (:func:`read_manifest`), why."""
    base = root or registry_root()
    manifests, broken = [], []
    for m in sorted(base.glob(f"*/*/{MANIFEST}")):
        if m.is_file():
            try:
                manifests.append(read_manifest(m.parent))
            except InvalidArgumentError as e:
                broken.append(e.message)
    return sorted(manifests, key=lambda m: (m["name"], m["pushed_at"])), broken
