"""Host memory of a KV cache kept in a file (the shm connector's): reserved and mapped
up front.

A sparse file under ``/dev/shm`` costs nothing until a page is first written, and
then costs the kernel a page allocation and a fault in the middle of an engine
step: on the 2-core VM of ``docs/results/simulator.md``, ~0.28 ms for each 512 KiB written
for the first time against ~0.02 ms once mapped: most of why a 256-token prefill
step ran 1.5x its profile while the pool was new. When the
file system is full, the first write to a missing page kills the process with
SIGBUS, at whatever step reaches it.

:func:`reserve_file` allocates every block of the file when the cache is created
(``posix_fallocate``; a full file system is then a clear error at start-up), and
:func:`populate` maps every page of a mapping into the process's page tables
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+; it writes nothing, so a sender
may populate its mapping of a receiver's live cache). Where the kernel or file
system lacks either, pages fault in lazily as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from pathlib import Path

import torch

from pdserve.core.errors import TransferError

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
PAGE = os.sysconf("SC_PAGE_SIZE")

_LIBC = ctypes.CDLL(None, use_errno=True)
_MADVISE = _LIBC.madvise
_MADVISE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADVISE.restype = ctypes.c_int


def reserve_file(path: Path, num_bytes: int) -> None:
    """Create ``path`` with ``num_bytes`` of zeros, every block allocated now.

    Raises :class:`TransferError` naming the directory, the size asked for and the
    room left when its file system cannot hold the file.
    """
    # 0600 from the start, and made so if the file was there: it holds request KV.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG):
            os.ftruncate(fd, num_bytes)  # no fallocate here: a sparse file, as before
            return
        path.unlink(missing_ok=True)
        free = _free_bytes(path.parent)
        raise TransferError(
            f"no room for the KV cache in {path.parent}: {num_bytes / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free (give that file system more room, e.g. docker "
            "--shm-size, or lower cache.kv_cache_memory_bytes / cache.num_blocks)"
        ) from None
    finally:
        os.close(fd)


def populate(tensor: torch.Tensor) -> bool:
    """Map every page under ``tensor`` (a view of a file mapping) without writing to
    it; False where the kernel cannot (the pages then fault in on first use)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return True
    start = tensor.data_ptr() // PAGE * PAGE
    end = tensor.data_ptr() + nbytes
    if _MADVISE(start, end - start, MADV_POPULATE_WRITE) == 0:
        return True
    logger.info(
        "madvise(MADV_POPULATE_WRITE) failed (%s): KV pages will fault in on first use",
        os.strerror(ctypes.get_errno()),
    )
    return False


def _free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize
