"""The pool of physical KV blocks: reference counts, prefix-cache index, eviction.

A block is in exactly one of three states::

    in use      ref_cnt > 0; held by >= 1 block table; never evicted
    cached      ref_cnt == 0 and block_hash set; in the eviction queue, and in the
                hash index so a later request with the same prefix can take it back
    free        ref_cnt == 0 and no hash; in the eviction queue

``allocate`` pops from the eviction queue (a cached victim loses its hash),
``touch`` takes a block (maybe cached) into use, ``free`` returns it. The pool
knows nothing about requests; :class:`~pdserve.engine.kv_cache_manager.KVCacheManager`
owns the block tables and calls ``check_integrity`` with the expected counts.

Blocks are built on first use: ids ``len(blocks)..num_blocks-1`` have never
been handed out, are free and hold no hash, and exist only as that range.
``allocate`` takes them after the queue's uncached blocks and before its
cached ones (a policy hands out uncached blocks first), so a pool starts at
once and holds objects only for as many blocks as were ever in use together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pdserve.core.errors import InvalidArgumentError
from pdserve.engine.eviction import DEFAULT_CLOCK, Clock, EvictionPolicy, KVBlock, make_policy

__all__ = ["BlockPool", "KVBlock"]


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks with reference counts and a hash index."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction: str | EvictionPolicy = "lru",
        clock: Clock = DEFAULT_CLOCK,
    ) -> None:
        if num_blocks < 1:
            raise InvalidArgumentError("num_blocks", f"must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.clock = clock
        self.blocks: list[KVBlock] = []  # the blocks built so far; blocks[i].block_id == i
        self._evictable = make_policy(eviction) if isinstance(eviction, str) else eviction
        self._by_hash: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        # Told of each cached block that loses its hash to eviction, before it goes.
        self.on_evict: Callable[[KVBlock, bytes], None] | None = None
        # KV events for routers: (True, hash) cached, (False, hash) evicted.
        # None until someone asks for them (see ``drain_events``).
        self._events: list[tuple[bool, bytes]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free or cached, unreferenced)."""
        return len(self._evictable) + self.num_blocks - len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some block table."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` unreferenced blocks (evicting cached ones if needed), ref_cnt 1."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"allocate({n}) with only {self.num_free_blocks} free blocks")
        out = self._evictable.pop_uncached(min(n, self._evictable.num_uncached))
        for block in out:  # freed before, never cached since
            block.ref_cnt, block.priority = 1, 0
        start = len(self.blocks)
        fresh = [KVBlock(i, 1) for i in range(start, min(start + n - len(out), self.num_blocks))]
        self.blocks.extend(fresh)
        out.extend(fresh)
        for _ in range(n - len(out)):  # cached ones: each loses its hash
            block = self._evictable.pop()
            if block.block_hash is not None:
                self._evicted(block)
            block.ref_cnt, block.priority = 1, 0
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._by_hash.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take blocks found by ``lookup`` into use by one more block table."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._evictable.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock], priority: int = 0) -> None:
        """Drop one reference from each block, in eviction order (first evicted first).

        ``priority`` is the releasing request's; a block keeps the highest it has seen.
        """
        now, released = self.clock(), []
        for block in blocks:
            refs = block.ref_cnt - 1
            if refs < 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt = refs
            if priority > block.priority:
                block.priority = priority
            block.last_used = now
            if not refs:
                released.append(block)
        self._evictable.add_all(released)

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Index a full, in-use block under its hash. False if another holds the hash."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        if self._events is not None:
            self._events.append((True, block_hash))
        return True

    def cached_hashes(self) -> list[bytes]:
        return list(self._by_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds; returns how many."""
        dropped = 0
        for block in list(self._by_hash.values()):
            if block.ref_cnt == 0:
                self._evictable.remove(block)
                self._drop_hash(block)
                self._evictable.add(block)
                dropped += 1
        return dropped

    def _evicted(self, block: KVBlock, notify: bool = True) -> None:
        assert block.block_hash is not None
        if notify and self.on_evict is not None:
            self.on_evict(block, block.block_hash)
        self._drop_hash(block)
        self.num_evictions += 1

    def evict(self, block: KVBlock, notify: bool = True) -> None:
        """Drop an unreferenced cached block's hash now; it stays free for reuse."""
        assert block.ref_cnt == 0 and block.block_hash is not None
        self._evictable.remove(block)
        self._evicted(block, notify)
        self._evictable.add(block)

    def expired(self, now: float) -> list[KVBlock]:
        """Cached blocks the eviction policy wants moved down a tier now."""
        return self._evictable.expired(now)

    def _drop_hash(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._by_hash[block.block_hash]
        if self._events is not None:
            self._events.append((False, block.block_hash))
        block.block_hash = None

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes cached and evicted since the last call (recording starts on the first)."""
        if self._events is None:
            self._events = []
            return list(self._by_hash), []
        events, self._events = self._events, []
        added = [h for cached, h in events if cached]
        removed = [h for cached, h in events if not cached]
        return added, removed

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Raise AssertionError unless the pool matches the holders' view.

        ``expected_refs`` maps block id -> how many block tables hold it.
        """
        queued = self._evictable.block_ids()
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == want, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {want} tables"
            )
            assert (block.ref_cnt == 0) == (block.block_id in queued), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{'in' if block.block_id in queued else 'not in'} the eviction queue"
            )
            if block.block_hash is not None:
                assert self._by_hash.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the index does not map to it"
                )
        assert all(i < len(self.blocks) for i in expected_refs), "a table holds an unbuilt block"
        assert len(self._evictable) == sum(b.ref_cnt == 0 for b in self.blocks)
        assert len(queued) == len(self._evictable), "a block is queued twice"
        for h, block in self._by_hash.items():
            assert block.block_hash == h, f"index entry for block {block.block_id} is stale"
