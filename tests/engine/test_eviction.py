"""The order in which each eviction policy hands out blocks, and the tiers' index."""

from __future__ import annotations

import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.eviction import (
    IdleEviction,
    KVBlock,
    LRUEviction,
    PriorityEviction,
    make_policy,
)
from pdserve.engine.kv_tiers import KVTiers


def _block(i: int, cached: bool = True, priority: int = 0, last_used: float = 0.0) -> KVBlock:
    return KVBlock(
        i, block_hash=bytes([i]) if cached else None, priority=priority, last_used=last_used
    )


def _drain(policy) -> list[int]:
    return [policy.pop().block_id for _ in range(len(policy))]


def test_lru_hands_out_plain_blocks_first_then_cached_oldest_first():
    policy = LRUEviction()
    for block in (_block(1), _block(2, cached=False), _block(3), _block(4, cached=False)):
        policy.add(block)
    policy.remove(_block(1))
    assert _drain(policy) == [2, 4, 3]


def test_idle_orders_like_lru_and_expires_blocks_unused_for_its_limit():
    policy = IdleEviction(idle_s=10.0)
    for i, used in ((1, 0.0), (2, 5.0), (3, 12.0)):
        policy.add(_block(i, last_used=used))
    policy.add(_block(4, cached=False, last_used=0.0))
    assert [b.block_id for b in policy.expired(now=16.0)] == [1, 2]
    assert [b.block_id for b in policy.expired(now=9.0)] == []
    assert LRUEviction().expired(now=1e9) == []
    assert _drain(policy) == [4, 1, 2, 3]


def test_priority_evicts_the_lowest_priority_first_and_lru_within_one():
    policy = PriorityEviction()
    for i, prio in ((1, 5), (2, 0), (3, 5), (4, -1), (5, 0)):
        policy.add(_block(i, priority=prio))
    policy.add(_block(6, cached=False, priority=9))
    policy.remove(_block(2, priority=0))
    assert len(policy) == 5 and _block(3) in policy and _block(2) not in policy
    assert _drain(policy) == [6, 4, 5, 1, 3]


def test_the_pool_keeps_the_highest_priority_that_held_a_block():
    pool = BlockPool(3, eviction="priority")
    low, high = pool.allocate(2)
    pool.cache(low, b"low")
    pool.cache(high, b"high")
    pool.touch([high])  # a second holder
    pool.free([high], priority=7)
    pool.free([high], priority=1)
    pool.free([low], priority=2)
    victims = pool.allocate(3)
    assert [b.block_id for b in victims] == [2, low.block_id, high.block_id]
    assert all(b.priority == 0 for b in victims), "a block handed out starts over"


def test_unknown_policies_are_refused_naming_the_field():
    with pytest.raises(InvalidArgumentError, match="host_tier_eviction"):
        make_policy("mru", field="host_tier_eviction")
    with pytest.raises(InvalidArgumentError, match="eviction"):
        BlockPool(4, eviction="fifo")


def _store(tiers: KVTiers, block: int, name: bytes) -> None:
    tiers.cached(block, name, 0)


def test_tiers_write_through_to_host_demote_to_disk_and_drop_last():
    tiers = KVTiers(host_slots=2, disk_slots=2)
    for i, name in enumerate((b"a", b"b", b"c")):
        _store(tiers, i, name)
    ops = tiers.take_ops()
    assert [(w.kind, w.block_hash) for w in ops.writes] == [
        ("store", b"a"),
        ("store", b"b"),
        ("demote", b"a"),  # the host is full: its oldest goes down before the slot is reused
        ("store", b"c"),
    ]
    for i, name in enumerate((b"d", b"e"), start=3):
        _store(tiers, i, name)
    kinds = [(w.kind, w.block_hash) for w in tiers.take_ops().writes]
    assert kinds == [
        ("demote", b"b"),
        ("store", b"d"),
        ("drop", b"a"),  # the disk is full too: its oldest file goes
        ("demote", b"c"),
        ("store", b"e"),
    ]
    assert [h.tier for h in tiers.find([b"d", b"c", b"b", b"a"])] == ["host", "disk", "disk"]
    tiers.check_integrity()


def test_a_failed_load_forgets_the_block_and_the_rest_stays():
    tiers = KVTiers(host_slots=0, disk_slots=4)
    for i, name in enumerate((b"a", b"b")):
        _store(tiers, i, name)
    assert [w.kind for w in tiers.take_ops().writes] == ["save", "save"]
    hits = tiers.find([b"a", b"b"])
    tiers.load(hits, [7, 8])
    ops = tiers.take_ops()
    assert [(x.tier, x.block_hash, x.block) for x in ops.loads] == [
        ("disk", b"a", 7),
        ("disk", b"b", 8),
    ]
    tiers.loads_done(ops.loads, [True, False])
    assert [h.block_hash for h in tiers.find([b"a", b"b"])] == [b"a"]
    assert tiers.counters.failed_loads == 1
    assert [w.kind for w in tiers.take_ops().writes] == ["drop"], "the bad file is deleted"
    tiers.check_integrity()


def test_idle_host_blocks_go_down_to_disk_without_pressure():
    now = [0.0]
    tiers = KVTiers(4, 4, host_eviction="idle", idle_s=30.0, clock=lambda: now[0])
    _store(tiers, 0, b"old")
    tiers.take_ops()
    now[0] = 20.0
    _store(tiers, 1, b"new")
    tiers.take_ops()
    now[0] = 40.0
    writes = tiers.take_ops().writes
    assert [(w.kind, w.block_hash) for w in writes] == [("demote", b"old")]
    assert [h.tier for h in tiers.find([b"old"])] == ["disk"]
    assert [h.tier for h in tiers.find([b"new"])] == ["host"]


def test_router_events_count_a_block_held_in_any_tier():
    """The instance reports a prefix as gone only when no tier holds it any more."""
    from pdserve.core.request import Request
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(2, 4, tiers=KVTiers(host_slots=1, disk_slots=0))
    kv.drain_events()
    first = Request("a", list(range(8)), SamplingParams(), ())
    assert kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.cache_computed_blocks(first)
    kv.free(first)
    assert [w.kind for w in kv.tiers.take_ops().writes] == ["store", "store"]
    events = kv.drain_events()
    added, removed = events.added, events.removed
    assert len(added) == 2 and removed == []
    other = Request("b", [50] * 8, SamplingParams(), ())
    assert kv.allocate_slots(other, 8)  # evicts both device blocks
    events = kv.drain_events()
    added, removed = events.added, events.removed
    assert added == [] and removed == [first.block_hashes[0]], "block 1 is still on the host"
    kv.free(other)
    kv.check_integrity()


def test_a_copy_of_a_block_reused_in_the_same_step_lands_before_the_step_writes():
    tiers = KVTiers(host_slots=4, disk_slots=0)
    for i, name in enumerate((b"a", b"b", b"c")):
        tiers.cached(i, name, 0)
    tiers.begin_step()  # the scheduler queues the copies before it allocates
    tiers.evicted(b"b")  # ... then hands out device block 1
    ops = tiers.take_ops()
    assert [w.block_hash for w in ops.writes] == [b"a", b"b", b"c"]
    assert ops.sync_writes == 2, "b, and everything queued before it, runs first"
    tiers.cached(5, b"d", 0)
    tiers.evicted(b"d")  # between steps (a reservation): the copy is dropped
    assert tiers.take_ops().writes == []
