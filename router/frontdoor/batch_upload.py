"""An uploaded batch file, checked line by line as its bytes arrive.

:class:`UploadCheck` is fed the upload's bytes in order (from a worker thread:
parsing a line of megabytes must not hold the event loop) and raises
InvalidArgumentError("file", "line N: ...") at the first line that is not a
request line: JSON, one object per line, with a non-empty string ``custom_id``
used once, ``method`` POST, a ``url`` the batch endpoints serve and an object
``body``. Blank lines are skipped. It keeps the unfinished last line (at most
``max_line_bytes``) and an 8-byte digest of each custom_id, nothing else.
"""

from __future__ import annotations

import hashlib
from typing import NoReturn

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.frontdoor.batch_runner import parse_line


class UploadCheck:
    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes
        self.lines = 0  # request lines seen (blank ones not counted)
        self._number = 0  # the current line's number in the file, 1-based
        self._partial = bytearray()  # the line not yet ended by a newline
        self._seen: set[bytes] = set()  # digests of the custom_ids so far

    def feed(self, data: bytes) -> None:
        """Check every line ``data`` ends; keep the rest for the next call."""
        start = 0
        while (end := data.find(b"\n", start)) != -1:
            if self._partial:
                self._partial += data[start:end]
                self._line(bytes(self._partial))
                self._partial.clear()
            else:
                self._line(data[start:end])
            start = end + 1
        self._partial += data[start:]
        if len(self._partial) > self.max_line_bytes:
            self._refuse(self._number + 1, self._too_long())

    def end(self) -> None:
        """The upload is whole: check its last line, and that it has one at all."""
        if self._partial:
            self._line(bytes(self._partial))
            self._partial.clear()
        if not self.lines:
            raise InvalidArgumentError("file", "has no request lines")

    def _line(self, raw: bytes) -> None:
        self._number += 1
        n = self._number
        if len(raw) > self.max_line_bytes:
            self._refuse(n, self._too_long())
        if not raw.strip():
            return
        self.lines += 1
        if self.lines > self.max_lines:
            self._refuse(n, f"more than {self.max_lines} lines (router.batch_max_file_lines)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._refuse(n, f"not UTF-8 ({e.reason} at byte {e.start})")
        parsed = parse_line(n, text, set(), require_method=True)
        if isinstance(parsed, dict):  # an error record: say what it says
            self._refuse(n, str(parsed["error"]["message"]).removeprefix(f"line {n} "))
        digest = hashlib.blake2b(parsed.custom_id.encode("utf-8", "surrogatepass")).digest()[:8]
        if digest in self._seen:
            self._refuse(n, f"custom_id {parsed.custom_id[:64]!r} repeats an earlier line's")
        self._seen.add(digest)

    def _too_long(self) -> str:
        return f"longer than {self.max_line_bytes >> 10} KiB (router.batch_max_line_kb)"

    @staticmethod
    def _refuse(n: int, what: str) -> NoReturn:
        raise InvalidArgumentError("file", f"line {n}: {what}")
