"""What the Batch API keeps per API key: its byte ledger, its index, its limits.

A key's files (uploads and batch outputs) are counted in one :class:`KeyLedger`:
every byte is reserved there *before* it is written (an upload's chunk, a
batch's result or error line), so concurrent uploads and batches of one key
cannot together pass its quota. The ledger is read from disk once, when the key
is first seen, and kept up to date by reservations and releases after that.

A key's :class:`KeyIndex` is a folder of empty files named after its file and
batch ids (``owners/<key digest>/<id>``): listings and counts read only it,
never another key's records.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdserve.core.private_files import open_private, private_dir
from pdserve.router.config import RouterConfig


@dataclass(frozen=True)
class BatchLimits:
    """The Batch API's limits, per upload and per key (from the ``router`` section)."""

    quota_bytes: int = 4096 << 20  # router.batch_quota_mb
    max_file_lines: int = 50_000  # router.batch_max_file_lines
    max_file_bytes: int = 200 << 20  # router.batch_max_file_mb
    max_line_bytes: int = 8192 << 10  # router.batch_max_line_kb
    max_files: int = 1000  # router.batch_max_files
    max_running: int = 8  # router.batch_max_running

    @classmethod
    def of(cls, config: RouterConfig) -> BatchLimits:
        return cls(
            quota_bytes=config.batch_quota_mb << 20,
            max_file_lines=config.batch_max_file_lines,
            max_file_bytes=config.batch_max_file_mb << 20,
            max_line_bytes=config.batch_max_line_kb << 10,
            max_files=config.batch_max_files,
            max_running=config.batch_max_running,
        )


class OutputBudget(Protocol):
    """Room for a batch's output: :meth:`reserve` before each write (False: no room,
    write nothing), :meth:`release` for bytes removed (a resumed output's dropped records).
    Called from the event loop and from worker threads."""

    def reserve(self, nbytes: int) -> bool: ...

    def release(self, nbytes: int) -> None: ...


class KeyLedger:
    """The bytes one key's files hold or have reserved, against its quota (thread-safe)."""

    def __init__(self, quota_bytes: int, used: int) -> None:
        self.quota_bytes = quota_bytes
        self._used = used
        self._refused = False  # a reservation did not fit since the last release
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` more if they fit the quota; False (nothing counted) if not."""
        with self._lock:
            if self._used + nbytes > self.quota_bytes:
                self._refused = True
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._used = max(0, self._used - nbytes)
            self._refused = False

    def full(self) -> bool:
        """At the quota: no byte left, or a write did not fit and nothing was freed since."""
        return self._used >= self.quota_bytes or self._refused


class KeyIndex:
    """The ids of one key's files and batches, one empty file each in its own folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def add(self, record_id: str) -> None:
        private_dir(self.folder)
        open_private(self.folder / record_id, "ab").close()

    def remove(self, record_id: str) -> None:
        (self.folder / record_id).unlink(missing_ok=True)

    def ids(self, prefix: str) -> list[str]:
        """This key's ids that start with ``prefix`` (``file-`` or ``batch_``)."""
        if not self.folder.is_dir():
            return []
        return [p.name for p in self.folder.iterdir() if p.name.startswith(prefix)]
