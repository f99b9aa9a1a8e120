"""Building the CPU C kernels: compiled with the system C compiler on first use.

Each kernel source next to its Python module (``cpu_kernel.c`` for paged decode
attention, ``cpu_ops.c`` for the fused layer ops) may include the helpers they
share (``cpu_math.h``, beside this module). It is compiled once per source,
header, flags and CPU model (about a second), cached under the built-in models'
cache folder, and loaded with :mod:`ctypes`. Without a compiler, or when the build
fails, :func:`compile_library` returns None and the caller falls back to torch.

A library is code run in every rank, so one is loaded only when it is trusted::

    kernels/<stem>_<key>.so          the library (0600)
    kernels/<stem>_<key>.so.sha256   the sha256 of its bytes, recorded when built (0600)

The folder, the library and its record must belong to this user and be writable
by no one else, and the bytes loaded (through the very file descriptor that was
hashed) must match the record; otherwise the library is rebuilt. A cache folder
that is not private (another user's, or group- or world-writable) is not used:
the library is then built in a private temporary folder for this process, and
that is logged.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from pdserve.core.private_files import cache_dir, is_private_dir, private_dir, write_private
from pdserve.kernels.cpu_features import cpu_model

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_HEADER = Path(__file__).with_name("cpu_math.h")
RECORD = ".sha256"  # suffix of a library's recorded hash


@functools.cache
def compile_library(source: Path, stem: str) -> ctypes.CDLL | None:
    """``source`` compiled into a shared library named after ``stem``; None if it cannot be."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the C kernels of %s are unavailable", source.name)
        return None
    text = source.read_bytes() + _HEADER.read_bytes()
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + cpu_model().encode()).hexdigest()[:16]
    name = f"{stem}_{key}.so"
    folder = private_dir(cache_dir()) / "kernels"
    if not folder.exists():
        private_dir(folder)
    if is_private_dir(folder):
        lib = load_trusted(folder, name)
        if lib is not None:
            return lib
        digest = _build(compiler, source, folder / name)
        return None if digest is None else load_trusted(folder, name, digest)
    logger.warning(
        "kernel folder %s is not private to this user (another's, or writable by others): "
        "building %s in a private folder for this process",
        folder,
        name,
    )
    scratch = Path(tempfile.mkdtemp(prefix="pdserve-kernels-"))  # 0700
    try:
        digest = _build(compiler, source, scratch / name)
        return None if digest is None else load_trusted(scratch, name, digest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # a loaded library stays mapped


def _build(compiler: str, source: Path, target: Path) -> str | None:
    """Compile ``source`` into ``target`` (0600) beside its recorded hash; the hash, or
    None if the build failed."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, f"-I{_HEADER.parent}", str(source), "-o", tmp, "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        logger.warning("building %s failed:\n%s", source.name, proc.stderr)
        return None
    os.chmod(tmp, 0o600)  # the linker may have made it anew, with the umask's mode
    with open(tmp, "rb") as f:
        digest = _sha256(f.fileno())
    write_private(target.with_name(target.name + RECORD), digest)
    os.replace(tmp, target)
    return digest


def load_trusted(folder: Path, name: str, digest: str | None = None) -> ctypes.CDLL | None:
    """The library ``folder/name``, or None unless the folder and the file are this
    user's and writable by no one else and the file's bytes hash to ``digest`` (None:
    the hash recorded beside it when it was built)."""
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not _ours(os.fstat(dfd)):
            return None
        if digest is None:
            recorded = _read_ours(dfd, name + RECORD)
            if recorded is None:
                return None
            digest = recorded.decode().strip()
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)
    if not _ours(os.fstat(fd)) or _sha256(fd) != digest:
        logger.warning("kernel library %s is not ours or not the one built", folder / name)
        os.close(fd)
        return None
    # Loaded through the descriptor just hashed, not the path. The descriptor stays open
    # while the library is loaded (the process): the loader takes a name it has seen for
    # the library it loaded under it, so the number must not name another one later.
    try:
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError as e:  # e.g. a folder on a noexec mount: the torch kernels serve
        os.close(fd)
        logger.warning("cannot load kernel library %s: %s", folder / name, e)
        return None


def _sha256(fd: int) -> str:
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _read_ours(dfd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(256) if _ours(os.fstat(fd)) else None


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def declare(
    lib: ctypes.CDLL, name: str, argtypes: list[type[ctypes._SimpleCData]]
) -> ctypes._NamedFuncPointer:
    """``lib.name`` returning a C int, taking ``argtypes``."""
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn
