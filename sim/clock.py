"""Time for the simulator, and the seams the live system and the simulator share.

:class:`Clock` is what a component asks for the time; :class:`MonotonicClock` is
the live one, :class:`VirtualClock` the simulator's (it moves only when the
event loop says so). :class:`EventQueue` orders the simulator's events.
The planner seam is :class:`pdserve.cluster.planner.PlannerPolicy`: the
simulator runs the same planner objects the controller runs, on virtual time.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Simulated seconds; moved forward by the event loop, never backward."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance_to(self, t: float) -> None:
        if t < self._t - 1e-12:
            raise ValueError(f"virtual time cannot go back from {self._t} to {t}")
        self._t = max(t, self._t)


class EventQueue:
    """Events ``(time, kind, payload)`` in time order; ties in insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()

    def push(self, at: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def pop(self) -> tuple[float, str, Any]:
        at, _, kind, payload = heapq.heappop(self._heap)
        return at, kind, payload

    def __len__(self) -> int:
        return len(self._heap)
