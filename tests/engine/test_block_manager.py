"""Block pool and KV cache manager: reference counts, prefix cache, eviction, integrity."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.core.request import Request
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_hash import hash_block_tokens
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """Reserve n tokens' slots as the scheduler would, then mark them computed."""
    prefix = kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
    assert kv.allocate_slots(req, n, prefix)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def test_hash_chains_over_the_whole_prefix() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != a


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    compute(kv, first, 10)
    second = make_request("b", list(range(8)))  # exactly the 2 full blocks
    hits = kv.find_cached_prefix(second)
    # The whole prompt is cached, but its last token must run to give logits:
    # only the first block counts as a hit.
    assert [b.block_id for b in hits] == kv.block_table("a")[:1]
    assert kv.allocate_slots(second, 4, hits)
    assert second.num_computed_tokens == 4
    assert kv.block_table("b")[0] == kv.block_table("a")[0]
    assert kv.pool.blocks[kv.block_table("a")[0]].ref_cnt == 2
    kv.check_integrity()
    kv.free(first)
    kv.free(second)
    kv.assert_empty()


def test_freed_blocks_stay_cached_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    assert kv.pool.num_cached_blocks == 2
    b = make_request("b", list(range(9)))
    assert len(kv.find_cached_prefix(b)) == 2  # reusable after the owner finished
    # A request needing every block evicts the cached ones (uncached go first).
    c = make_request("c", [100 + i for i in range(16)])
    compute(kv, c, 16)
    assert kv.pool.num_cached_blocks == 4  # c's blocks; a's were evicted
    assert kv.find_cached_prefix(make_request("d", list(range(9)))) == []
    kv.free(c)
    kv.assert_empty()


def test_lru_evicts_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    a, b, c, plain = pool.allocate(4)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(blk, h)
    pool.free([b])
    pool.free([a])
    pool.free([plain])
    pool.free([c])
    # Uncached blocks go before any cached one; then the least recently freed.
    assert pool.allocate(1)[0] is plain
    assert pool.allocate(1)[0] is b
    assert pool.lookup(b"b") is None
    assert pool.lookup(b"a") is a and pool.lookup(b"c") is c
    assert pool.num_evictions == 1


@pytest.mark.parametrize("eviction", ["lru", "priority"])
def test_blocks_are_built_on_first_use_and_used_ones_go_first(eviction: str) -> None:
    pool = BlockPool(10_000_000, eviction=eviction)  # no object per block up front
    assert pool.num_free_blocks == 10_000_000 and not pool.blocks
    a, b, c = pool.allocate(3)
    assert [x.block_id for x in (a, b, c)] == [0, 1, 2] and len(pool.blocks) == 3
    pool.cache(a, b"a")
    pool.free([c, b, a])
    # Freed uncached blocks, then never-used ones, then cached ones (each evicted).
    assert [x.block_id for x in pool.allocate(3)] == [2, 1, 3]
    assert pool.num_free_blocks == 10_000_000 - 3 and len(pool.blocks) == 4
    pool.check_integrity({1: 1, 2: 1, 3: 1})
    small = BlockPool(4, eviction=eviction)
    x = small.allocate(3)
    small.cache(x[0], b"x")
    small.free(x)
    assert [y.block_id for y in small.allocate(4)] == [1, 2, 3, 0]
    assert small.lookup(b"x") is None and small.num_evictions == 1


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    big = make_request("big", list(range(20)))
    assert not kv.allocate_slots(big, 20)
    assert not kv.holds("big")
    kv.assert_empty()


def test_double_free_is_refused() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([blk])


def test_integrity_check_catches_a_leak() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    req = make_request("a", [1, 2, 3])
    compute(kv, req, 3)
    kv.pool.blocks[kv.block_table("a")[0]].ref_cnt += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_cnt"):
        kv.check_integrity()


class KVCacheMachine(RuleBasedStateMachine):
    """Random interleavings of admit / extend / finish keep every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BS)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.sampled_from([[], [7] * 8, [7] * 4 + [8] * 4]), tail=st.integers(1, 10))
    def admit(self, prefix: list[int], tail: int) -> None:
        self.n += 1
        req = make_request(f"r{self.n}", prefix + [self.n] * tail)
        hits = self.kv.find_cached_prefix(req)
        num_new = req.num_tokens - len(hits) * BS
        if self.kv.allocate_slots(req, num_new, hits):
            req.num_computed_tokens += num_new
            self.kv.cache_computed_blocks(req)
            self.live[req.request_id] = req
        else:
            assert not self.kv.holds(req.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.append_token(self.n)
        if self.kv.allocate_slots(req, 1):
            req.num_computed_tokens += 1
            self.kv.cache_computed_blocks(req)
        else:
            req.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        for rid, req in self.live.items():
            assert len(self.kv.block_table(rid)) == self.kv.blocks_for(req.num_computed_tokens)

    def teardown(self) -> None:
        for req in self.live.values():
            self.kv.free(req)
        self.kv.assert_empty()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
