"""The load generator's limit on requests in flight (``--max-concurrency``), in virtual time.

``pdserve bench serve`` sends each request at its arrival time unless
``max_concurrency`` of its requests are already in flight; then it waits for one
of them to end (first come, first sent) and its TTFT counts from when it is sent.
:class:`SendGate` does the same for the simulator: an arrival past the limit
waits, and each request that ends (finished or failed) sends the oldest waiting
one at that instant, as a ``send`` event.
"""

from __future__ import annotations

from collections import deque

from pdserve.sim.clock import EventQueue, VirtualClock
from pdserve.sim.results import Recorder


class SendGate:
    def __init__(
        self, limit: int | None, queue: EventQueue, clock: VirtualClock, recorder: Recorder
    ) -> None:
        self.limit = limit  # None: an open loop, every request sent when it arrives
        self.queue, self.clock, self.recorder = queue, clock, recorder
        self.in_flight = 0  # sent and not ended, a queued send included
        self.waiting: deque[int] = deque()
        recorder.on_end = self.release

    def admit(self, i: int) -> bool:
        """Request ``i`` arrives: True to send it now, False when it waits."""
        if self.limit is not None and self.in_flight >= self.limit:
            self.waiting.append(i)
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        """A request ended: the oldest waiting one is sent now."""
        self.in_flight -= 1
        if self.waiting:
            i, now = self.waiting.popleft(), self.clock.now()
            self.in_flight += 1
            self.recorder.sent_at(i, now)
            self.queue.push(now, "send", i)
