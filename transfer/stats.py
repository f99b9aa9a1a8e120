"""Counters of KV transfers: what moved, how long it took, what failed, what expired."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class TransferStats:
    """Per connector and side; read by the metrics exporter."""

    connector: str
    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0

    @contextmanager
    def timed(self, nbytes: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failures += 1
            raise
        self.seconds += time.perf_counter() - start
        self.bytes += nbytes
        self.messages += 1

    def add(self, nbytes: int, seconds: float, messages: int = 1) -> None:
        """Count messages timed by the caller (a hot path: no context manager)."""
        self.seconds += seconds
        self.bytes += nbytes
        self.messages += messages

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


@dataclass
class LeaseStats:
    """Decode-side reservations and prefill-side holds, by how they ended."""

    reserved: int = 0
    committed: int = 0
    expired: int = 0
    aborted: int = 0
    peer_lost: int = 0
    refused: int = 0
    # Prefix pages from a peer's cache: reservations filled that way (decode
    # side), and exports sent (prefill side).
    peer_filled: int = 0
    exported: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
