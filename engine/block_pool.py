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
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.core.errors import InvalidArgumentError


@dataclass(eq=False, slots=True)
class KVBlock:
    """One physical page: ``block_size`` token slots in every layer's K and V."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class EvictionPolicy(abc.ABC):
    """Orders unreferenced blocks for reuse.

    The pool calls ``add`` when a block's reference count drops to zero, ``remove``
    when such a block is taken back into use (a prefix-cache hit), and ``pop`` to
    pick the next block to hand out. Implementations hold no other state.
    """

    @abc.abstractmethod
    def add(self, block: KVBlock) -> None: ...

    @abc.abstractmethod
    def remove(self, block: KVBlock) -> None: ...

    @abc.abstractmethod
    def pop(self) -> KVBlock: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, block: KVBlock) -> bool: ...


class LRUEviction(EvictionPolicy):
    """Least recently freed first; uncached blocks before cached ones.

    Blocks with no hash hold nothing reusable, so they are handed out before any
    cached block; among cached blocks the one freed longest ago goes first.
    """

    def __init__(self) -> None:
        self._plain: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: OrderedDict[int, KVBlock] = OrderedDict()

    def add(self, block: KVBlock) -> None:
        queue = self._plain if block.block_hash is None else self._cached
        queue[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        if self._plain.pop(block.block_id, None) is None:
            del self._cached[block.block_id]

    def pop(self) -> KVBlock:
        if self._plain:
            return self._plain.popitem(last=False)[1]
        return self._cached.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._plain) + len(self._cached)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._plain or block.block_id in self._cached


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUEviction}


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks with reference counts and a hash index."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, eviction: str = "lru"):
        if num_blocks < 1:
            raise InvalidArgumentError("num_blocks", f"must be >= 1, got {num_blocks}")
        if eviction not in EVICTION_POLICIES:
            raise InvalidArgumentError("eviction", f"unknown policy {eviction!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._evictable: EvictionPolicy = EVICTION_POLICIES[eviction]()
        self._by_hash: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        # KV events for routers: (True, hash) cached, (False, hash) evicted.
        # None until someone asks for them (see ``drain_events``).
        self._events: list[tuple[bool, bytes]] | None = None
        for block in self.blocks:
            self._evictable.add(block)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free or cached, unreferenced)."""
        return len(self._evictable)

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
        out = []
        for _ in range(n):
            block = self._evictable.pop()
            if block.block_hash is not None:
                self._drop_hash(block)
                self.num_evictions += 1
            block.ref_cnt = 1
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

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in eviction order (first evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._evictable.add(block)

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
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == want, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {want} tables"
            )
            assert (block.ref_cnt == 0) == (block in self._evictable), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{'in' if block in self._evictable else 'not in'} the eviction queue"
            )
            if block.block_hash is not None:
                assert self._by_hash.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the index does not map to it"
                )
        assert len(self._evictable) == sum(b.ref_cnt == 0 for b in self.blocks)
        for h, block in self._by_hash.items():
            assert block.block_hash == h, f"index entry for block {block.block_id} is stale"
