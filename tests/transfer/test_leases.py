"""The decode side's lease table: TTL expiry, revocation, and the leases of a lost peer."""

from __future__ import annotations

import time

from pdserve.transfer.handoff import LeaseTable


def test_a_lease_expires_at_its_deadline_not_before() -> None:
    table = LeaseTable()
    before = time.monotonic()
    lease = table.add("r1", "p0", ttl_s=5.0)
    assert before + 5.0 <= lease.deadline <= time.monotonic() + 5.0
    assert table.expired(now=lease.deadline - 0.01) == []
    assert table.expired(now=lease.deadline) == [lease]
    assert table.expired() == []  # by the real clock it has seconds left


def test_a_zero_ttl_lease_is_expired_at_once() -> None:
    table = LeaseTable()
    lease = table.add("r1", None, ttl_s=0.0)
    assert table.expired() == [lease]


def test_take_hands_over_a_valid_lease_once() -> None:
    table = LeaseTable()
    lease = table.add("r1", "p0", ttl_s=5.0)
    assert table.take("r1") is lease
    assert table.take("r1") is None
    assert table.take("never-reserved") is None
    assert table.leases == {}


def test_a_lease_being_revoked_cannot_be_taken_or_expire_twice() -> None:
    table = LeaseTable()
    lease = table.add("r1", "p0", ttl_s=0.0)
    lease.revoking = True
    assert table.take("r1") is None
    assert table.expired() == []
    assert table.leases == {"r1": lease}  # freed by whoever revokes it, not by take


def test_leases_of_a_lost_prefill_are_all_found_revoking_or_not() -> None:
    table = LeaseTable()
    a = table.add("a", "p0", ttl_s=5.0)
    table.add("b", "p1", ttl_s=5.0)
    c = table.add("c", "p0", ttl_s=5.0)
    table.add("d", None, ttl_s=5.0)
    c.revoking = True
    assert table.of_prefill("p0") == [a, c]
    assert table.of_prefill("gone") == []


def test_adding_a_request_again_replaces_its_lease() -> None:
    table = LeaseTable()
    table.add("r1", "p0", ttl_s=0.0)
    fresh = table.add("r1", "p1", ttl_s=5.0)
    assert table.leases == {"r1": fresh}
    assert table.expired() == []
