"""Invariants of a scheduler's queues and KV blocks, checked by tests and idle checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.core.request import RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler


def check_queues(s: Scheduler) -> None:
    """The scheduler's queues and block tables agree; raises AssertionError otherwise."""
    s.kv.check_integrity()
    assert not s.loading, "tier loads outlive their step"
    queued = {r.request_id for r in s.waiting} | {r.request_id for r in s.running}
    assert queued | set(s.reserved) == set(s.requests), "a request is lost or in no queue"
    assert len(s.waiting) + len(s.running) + len(s.reserved) == len(s.requests), (
        "a request is queued twice"
    )
    assert not set(s.held) & set(s.requests), "a held request is still queued"
    for rid in list(s.reserved) + list(s.held):
        assert s.kv.holds(rid), f"{rid} is reserved or held without blocks"
    for r in s.running:
        assert r.status is RequestStatus.RUNNING, r
        assert s.kv.holds(r.request_id) or r.num_computed_tokens == 0
        assert len(s.kv.block_table(r.request_id)) * s.kv.block_size >= r.num_computed_tokens
    for r in s.waiting:
        assert not s.kv.holds(r.request_id), f"waiting {r} holds blocks"
