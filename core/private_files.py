"""Files only this user can read: request data, keys and weights on disk.

Every file pdserve writes that holds request data, key records or weights is
created 0600 (never wider for a moment: the mode is given to ``open``, not set
after, and is fixed with ``fchmod`` against the umask or an older file), in a
folder made 0700. A folder that exists and is ours is narrowed to 0700; one of
another user is left as it is (``is_private_dir`` says whether to trust it).

    private_dir(path)             make path (0700) or narrow it; returns path
    open_private(path, "wb")      a file object on a 0600 file, truncated ("a", "x" too)
    write_private(path, data)     path holds data whole or not at all (aside, then renamed)
    make_private(folder)          a folder written earlier narrowed: 0700, its files 0600
    is_private_dir(path)          ours and not group- or world-writable
    cache_dir()                   where pdserve caches what it makes ($PDSERVE_CACHE_DIR)
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

FILE_MODE = 0o600
DIR_MODE = 0o700


def cache_dir() -> Path:
    """Where pdserve caches what it makes (built-in models, compiled kernels, shared
    weights): ``$PDSERVE_CACHE_DIR``, else ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def private_dir(path: str | Path) -> Path:
    """``path`` (and missing parents) made 0700; an existing folder of ours narrowed to
    0700. Parents that exist are left alone (``~`` or a shared mount)."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        folder.mkdir(mode=DIR_MODE, exist_ok=True)  # another process may make it meanwhile
    st = path.stat()
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != DIR_MODE:
        path.chmod(DIR_MODE)
    return path


def make_private(folder: str | Path) -> Path:
    """``folder`` narrowed to 0700 and every file under it to 0600 (those of this user;
    folders under it to 0700); for a folder written before its files were private."""
    folder = Path(folder)
    me = os.geteuid()
    for path in (folder, *folder.rglob("*")):
        try:
            st = path.lstat()
            if st.st_uid != me or stat.S_ISLNK(st.st_mode):
                continue
            mode = DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE
            if stat.S_IMODE(st.st_mode) != mode:
                path.chmod(mode)
        except FileNotFoundError:
            continue  # renamed or removed meanwhile by another process
    return folder


def is_private_dir(path: str | Path) -> bool:
    """Whether ``path`` is a real folder (not a link) of this user that no one else may
    write to."""
    return _ours(path, stat.S_ISDIR)


def is_private_file(path: str | Path) -> bool:
    """Whether ``path`` is a regular file (not a link) of this user that no one else may
    write to."""
    return _ours(path, stat.S_ISREG)


def _ours(path: str | Path, kind: Callable[[int], bool]) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        kind(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def open_private(path: str | Path, mode: str = "wb", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` for writing, on a file created 0600 (an existing one is made
    0600 before anything is written). ``mode``: "w", "a" or "x" (must not exist), each
    with or without "b"."""
    if mode.rstrip("b") not in ("w", "a", "x"):
        raise ValueError(f"open_private writes: mode {mode!r} is not w, a or x (+b)")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= {"a": os.O_APPEND, "w": os.O_TRUNC, "x": os.O_EXCL}[mode[0]]
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | Path, data: bytes | str) -> None:
    """``path`` holds ``data`` (0600) whole or not at all, for a reader at any moment."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600 already; said here, not assumed
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
