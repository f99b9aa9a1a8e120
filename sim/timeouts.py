"""The load generator's ``--request-timeout``, in virtual time.

``pdserve bench serve`` gives up on a request still streaming ``timeout_s`` after it
sent it: the record fails (no tokens kept) and, with a limit on requests in flight,
the slot goes to the next waiting request. Its stream's end makes the router abort
the request wherever it is, which frees its pages. :class:`Deadlines` does the
same for the simulator. Every request gets the same timeout and is sent in time
order, so the deadlines come due in the order they were set: a queue, not a heap.
A request that ended first is skipped when its deadline comes up.

Where an expired request is, and what its abort frees:

- crossing to its region (its launch is queued): dropped when it lands;
- on its prefill instance (queued or prefilling): the prefill's blocks and the decode
  instance's reservation;
- its pages in transfer: the pages on both sides, at once (the hand-off, when it
  lands, finds no request and does nothing);
- on its decode instance: its blocks there.

A step already running keeps the request's row and drops its tokens, as an engine
step that an abort overtakes does (``Scheduler.update``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from pdserve.core.request import RequestStatus

if TYPE_CHECKING:
    from pdserve.sim.cluster import SimCluster, _Track
    from pdserve.sim.instance import SimInstance

ABORTED = RequestStatus.FINISHED_ABORTED


class Deadlines:
    def __init__(self, timeout_s: float | None) -> None:
        # None or inf: no request ever times out
        self.timeout_s = timeout_s if timeout_s is not None and math.isfinite(timeout_s) else None
        self._due: deque[tuple[float, int]] = deque()

    def sent(self, i: int, at: float) -> None:
        if self.timeout_s is not None:
            self._due.append((at + self.timeout_s, i))

    def next_at(self, done: np.ndarray) -> float:
        """When the next request still in flight times out (inf: none); ``done`` is the
        recorder's per-request flags, which the queue skips past."""
        due = self._due
        while due and done[due[0][1]]:
            due.popleft()
        return due[0][0] if due else float("inf")

    def expire(self, cluster: SimCluster) -> None:
        """The request at the head of the queue times out now."""
        _, i = self._due.popleft()
        rec = cluster.run_info.recorder
        track = cluster.tracks.pop(f"r{i}", None)
        if track is None:  # sent, its launch still queued: it lands ended (done) and stops
            cluster.inflight[cluster.regions[rec.region[i]]] -= 1
        else:
            _abort(cluster, track)
        rec.timed_out(i, cluster.clock.now())


def _abort(cluster: SimCluster, track: _Track) -> None:
    rid, prefill, decode = f"r{track.index}", track.prefill, track.decode
    cluster.inflight[track.region] -= 1
    decode.view.inflight -= 1
    if prefill is not None and rid in prefill.scheduler.held:  # its pages in transfer
        prefill.scheduler.release(rid)
        prefill.view.inflight -= 1
        _settle(cluster, prefill)
    elif prefill is not None and rid in prefill.scheduler.requests:  # not prefilled yet
        cluster.interrupt(prefill)
        prefill.scheduler.finish(rid, ABORTED)
        prefill.view.inflight -= 1
        prefill.view.pending_prompt_tokens -= track.prompt_len
        _settle(cluster, prefill)
    else:  # on its decode instance (the only one, or after the hand-off)
        cluster.interrupt(decode)
    decode.scheduler.finish(rid, ABORTED)  # its blocks there, or the reservation
    _settle(cluster, decode)


def _settle(cluster: SimCluster, inst: SimInstance) -> None:
    """An instance lost a request: the router hears of it, a draining instance left
    idle goes, and one with work left schedules its next step."""
    cluster.refresh(inst)
    if inst.draining and inst.idle:
        cluster.scaling.remove(inst)
    else:
        cluster.kick(inst)
