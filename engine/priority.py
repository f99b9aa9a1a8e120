"""Priority order of one engine's queues: who is admitted first, who is preempted.

A request's priority is ``SamplingParams.priority`` (higher: more important;
negative: batch work). The scheduler asks this module three things:

- ``WaitingQueue``: the order of admission. Highest priority first; within a
  priority, arrival order, except that a request put back (preempted, or done
  loading offloaded blocks) goes to the front of its priority, as it went to
  the front of the whole queue before priorities.
- ``victim``: which running request gives its blocks back when a running
  request needs one: the lowest priority, the newest among equals (the last in
  ``running``, which is what the scheduler chose before priorities).
- ``victims_for``: which running requests of strictly lower priority a waiting
  request may preempt to be admitted. Only strictly lower: a preempted request
  can never preempt back the one that displaced it, so there is no livelock.

With every priority equal, all three behave exactly as a plain FIFO queue with
"preempt the newest".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter

from pdserve.core.request import Request
from pdserve.engine.block_pool import KVBlock
from pdserve.engine.kv_cache_manager import KVCacheManager

priority: Callable[[Request], int] = attrgetter("sampling_params.priority")


class WaitingQueue:
    """Waiting requests, highest priority first, FIFO within a priority.

    Sorted by priority at all times; insertion scans from the end it enters by,
    so with equal priorities both pushes are O(1).
    """

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    @property
    def head(self) -> Request:
        """The next request to admit (the queue must not be empty)."""
        return self._queue[0]

    def push(self, request: Request) -> None:
        """A new arrival: behind every request of its priority or higher."""
        p = priority(request)
        i = len(self._queue)
        while i > 0 and priority(self._queue[i - 1]) < p:
            i -= 1
        self._queue.insert(i, request)

    def push_front(self, request: Request) -> None:
        """A request put back: ahead of every request of its priority or lower."""
        p = priority(request)
        i = 0
        while i < len(self._queue) and priority(self._queue[i]) > p:
            i += 1
        self._queue.insert(i, request)

    def popleft(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)


def by_priority(requests: Sequence[Request]) -> list[Request]:
    """``requests`` highest priority first, keeping their order among equals."""
    return sorted(requests, key=priority, reverse=True)


def victim(running: Sequence[Request]) -> Request:
    """The running request to preempt: the lowest priority, the newest among equals."""
    return min(reversed(running), key=priority)


def victims_for(
    request: Request,
    running: Sequence[Request],
    kv: KVCacheManager,
    prefix: Sequence[KVBlock],
    num_new: int,
) -> list[Request]:
    """Running requests of lower priority to preempt so that ``request`` fits.

    ``request`` lacks blocks for its ``prefix`` hit and ``num_new`` tokens past
    it. Victims come lowest priority first, newest first among equals, as many
    as cover the blocks it lacks; the caller may take only the first few (the
    rest are still there next step). Returns [] when all lower-priority running
    requests together could not cover it: preempting would only waste work.
    The count of blocks a victim frees leaves out the prefix it shares with
    ``request`` but not blocks shared with others, so it may overestimate.
    """
    p = priority(request)
    candidates = sorted((r for r in reversed(running) if priority(r) < p), key=priority)
    prefix_ids = {b.block_id for b in prefix}
    reclaimed = sum(1 for b in prefix if b.ref_cnt == 0)  # free now, but taken by the hit
    need = kv.blocks_for(len(prefix) * kv.block_size + num_new) - len(prefix)
    shortfall = need - (kv.num_free_blocks - reclaimed)
    out: list[Request] = []
    for candidate in candidates:
        if shortfall <= 0:
            break
        out.append(candidate)
        shortfall -= len(set(kv.block_table(candidate.request_id)) - prefix_ids)
    return out if shortfall <= 0 else []
