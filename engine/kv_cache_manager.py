"""Block tables of running requests over one :class:`BlockPool`, with prefix caching.

A request's block table covers its tokens in order; token ``i`` lives in slot
``i % block_size`` of block ``table[i // block_size]``::

    token_ids:  | prompt ...................................| output ...... |
    blocks:     [ hit 0 ][ hit 1 ][ new 2 ][ new 3 ][ new 4 ][ new 5 ]
                 ^ prefix-cache hits     ^ num_computed_tokens  ^ computed this step
                 (shared, ref_cnt > 1)                          (allocated now)

Full blocks are hashed by chaining (:mod:`pdserve.engine.block_hash`), so
two requests share block ``i`` only when all tokens up to its end are equal.
Hashes are stable across processes (blake2b), so a router can index them.

Who frees what: the manager holds one reference per block per table; ``free``
drops them when the request finishes, aborts or is preempted. A freed full
block keeps its hash and stays reusable until the pool evicts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.core.config import CacheConfig, EngineConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.request import Request
from pdserve.core.step import TierLoad
from pdserve.engine.block_hash import adapter_salt, block_hashes, first_parent
from pdserve.engine.block_pool import BlockPool, KVBlock
from pdserve.engine.eviction import DEFAULT_CLOCK, Clock
from pdserve.engine.kv_tiers import KVTiers, TierHit

logger = logging.getLogger(__name__)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were hits."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns the block table of every request that holds KV blocks on this instance."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        eviction: str = "lru",
        tiers: KVTiers | None = None,
        clock: Clock = DEFAULT_CLOCK,
    ) -> None:
        """``tiers``: host and disk tiers below the pool (None: evicted blocks are lost)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, eviction, clock)
        self.tiers = tiers if tiers is not None and tiers.enabled and enable_caching else None
        if self.tiers is not None:
            self.pool.on_evict = lambda _block, block_hash: self._tiers().evicted(block_hash)
        # Requests whose offloaded prefix blocks are copied back this step:
        # (device prefix held, blocks being loaded, their hashes, priority).
        self._loading: dict[str, tuple[list[KVBlock], list[KVBlock], list[bytes], int]] = {}
        self._tables: dict[str, list[KVBlock]] = {}
        # Each table's block ids: a new list when it changes, so plans can hold one.
        self._ids: dict[str, list[int]] = {}
        # How many leading blocks of each table are indexed in the prefix cache.
        self._num_cached: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # The first block's parent per LoRA adapter name; the engine sets it to
        # its adapters' salt (name and content fingerprint).
        self.adapter_salt: Callable[[str | None], bytes | None] = adapter_salt

    @classmethod
    def from_config(
        cls, cache: CacheConfig, num_blocks: int, tier_slots: tuple[int, int]
    ) -> KVCacheManager:
        """The manager of an engine: its pool, eviction policy and lower tiers."""
        tiers = KVTiers(
            *tier_slots, cache.host_tier_eviction, cache.disk_tier_eviction, cache.idle_eviction_s
        )
        return cls(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.eviction, tiers)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids now; the manager never changes this list: nor may you."""
        ids = self._ids.get(request_id)
        return ids if ids is not None else []

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of its known tokens."""
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            # The first block chains from the request's LoRA adapter (None: base),
            # salted by its prefix-cache tenant.
            params = request.sampling_params
            parent = (
                hashes[-1]
                if hashes
                else first_parent(self.adapter_salt(params.lora), params.cache_salt)
            )
            hashes.extend(block_hashes(request.token_ids, self.block_size, len(hashes), parent))

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of leading blocks already cached, leaving >= 1 token to compute.

        The last token is always recomputed so the step that runs it yields logits.
        Nothing is taken yet; pass the result to ``allocate_slots``.
        """
        if not self.pool.enable_caching or request.num_computed_tokens > 0:
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _tiers(self) -> KVTiers:
        assert self.tiers is not None
        return self.tiers

    def find_offloaded(self, request: Request, num_device_hits: int) -> list[TierHit]:
        """Blocks right after the device hits that a lower tier holds (same limit)."""
        if self.tiers is None or request.num_computed_tokens > 0:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if num_device_hits >= max_blocks:
            return []
        return self.tiers.find(request.block_hashes[num_device_hits:max_blocks])

    def start_loads(
        self, request: Request, device_prefix: Sequence[KVBlock], hits: Sequence[TierHit]
    ) -> bool:
        """Take device blocks for ``hits``; the next step copies them back. False: no room.

        The request's device prefix is held meanwhile, so taking blocks for the
        loads cannot evict it.
        """
        reclaimed = sum(1 for b in device_prefix if b.ref_cnt == 0)
        if not hits or len(hits) > self.pool.num_free_blocks - reclaimed:
            return False
        self.pool.touch(device_prefix)
        blocks = self.pool.allocate(len(hits))
        priority = request.sampling_params.priority
        self._loading[request.request_id] = (
            list(device_prefix),
            blocks,
            [h.block_hash for h in hits],
            priority,
        )
        self._tiers().load(hits, [b.block_id for b in blocks])
        return True

    def loads_done(self, loads: Sequence[TierLoad], ok: Sequence[bool]) -> list[str]:
        """Index the blocks that came back intact (up to each request's first failure).

        They are then released as cached blocks for the request to find as an
        ordinary prefix hit. Returns the requests that were loading.
        """
        flags = list(ok) if len(ok) == len(loads) else [False] * len(loads)
        landed = {load.block: good for load, good in zip(loads, flags, strict=True)}
        for prefix, blocks, hashes, priority in self._loading.values():
            for block, block_hash in zip(blocks, hashes, strict=True):
                if not landed.get(block.block_id, False) or not self.pool.cache(block, block_hash):
                    break
            self.pool.free(reversed(prefix + blocks), priority)
        if self.tiers is not None:
            self.tiers.loads_done(loads, flags)
        loaded, self._loading = list(self._loading), {}
        return loaded

    def drain_events(self) -> KVEvents:
        """Prefix blocks this instance came to hold, and stopped holding, in any tier.

        A block evicted from the device but kept in host memory or on disk is
        still held (a request for it is served without recomputing it); such
        blocks are also listed as ``lower``, and blocks back on the device as
        ``device``, so a router knows which tier holds them.
        """
        added, removed = self.pool.drain_events()
        if self.tiers is None:
            return KVEvents(added, removed)
        tier_added, tier_removed = self.tiers.drain_events()
        held, on_device = self._held_anywhere, self.pool.lookup
        return KVEvents(
            [h for h in dict.fromkeys(added + tier_added) if held(h)],
            [h for h in dict.fromkeys(removed + tier_removed) if not held(h)],
            [h for h in removed if on_device(h) is None and held(h)],
            [h for h in added if on_device(h) is not None],
        )

    def _held_anywhere(self, block_hash: bytes) -> bool:
        if self.pool.lookup(block_hash) is not None:
            return True
        return self.tiers is not None and self.tiers.holds(block_hash)

    def device_blocks(self, hashes: Sequence[bytes]) -> list[KVBlock]:
        """The leading run of ``hashes`` cached in the device pool (nothing is taken)."""
        blocks = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_landed(self, request: Request, start: int, hashes: Sequence[bytes]) -> int:
        """Index blocks ``start..`` of a reservation whose KV a peer wrote; how many were."""
        table = self._tables[request.request_id]
        priority = request.sampling_params.priority
        for i, block_hash in enumerate(hashes):
            block = table[start + i]
            if not self.pool.cache(block, block_hash):
                return i
            if self.tiers is not None:
                self.tiers.cached(block.block_id, block_hash, priority)
        return len(hashes)

    def can_allocate(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> bool:
        return self._num_new_blocks_needed(request, num_new_tokens, cached_prefix) is not None

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> bool:
        """Make the table cover ``num_computed + len(cached_prefix)*bs + num_new_tokens``.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        if not cached_prefix:  # the common case: a running request's table covers it already
            held, end = self._tables.get(request.request_id), request.num_computed_tokens
            if held and -(-(end + num_new_tokens) // self.block_size) <= len(held):
                return True
        n_new = self._num_new_blocks_needed(request, num_new_tokens, cached_prefix)
        if n_new is None:
            return False
        table = self._tables.setdefault(request.request_id, [])
        ids = self._ids.get(request.request_id, [])
        if not table and request.num_computed_tokens == 0 and self.pool.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += len(cached_prefix) * self.block_size
        if cached_prefix:
            assert not table, "a cached prefix can only start an empty block table"
            self.pool.touch(cached_prefix)
            table.extend(cached_prefix)
            ids = [b.block_id for b in cached_prefix]
            self._num_cached[request.request_id] = len(cached_prefix)
            request.num_computed_tokens = len(cached_prefix) * self.block_size
            request.num_cached_prompt_tokens = request.num_computed_tokens
        if n_new:
            blocks = self.pool.allocate(n_new)
            table.extend(blocks)
            ids = ids + [b.block_id for b in blocks]  # a new list: plans may hold the old
        self._ids[request.request_id] = ids
        return True

    def _num_new_blocks_needed(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock]
    ) -> int | None:
        table = self._tables.get(request.request_id, ())
        covered = request.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = self.blocks_for(covered + num_new_tokens) - len(table) - len(cached_prefix)
        needed = max(needed, 0)
        # Cached blocks nobody holds sit in the free queue; taking them shrinks it.
        reclaimed = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            return None
        return needed

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's blocks that became full and computed this step."""
        if not self.pool.enable_caching:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        self.update_block_hashes(request)
        start = self._num_cached.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            if self.pool.cache(table[i], request.block_hashes[i]) and self.tiers is not None:
                self.tiers.cached(
                    table[i].block_id, request.block_hashes[i], request.sampling_params.priority
                )
        self._num_cached[request.request_id] = max(start, end)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the table's blocks past those covering ``num_tokens`` tokens.

        They held rejected drafts' KV only (never indexed: they lie past the
        request's computed tokens).
        """
        table = self._tables.get(request.request_id)
        keep = self.blocks_for(num_tokens)
        if table is None or len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        self._ids[request.request_id] = self._ids[request.request_id][:keep]
        self.pool.free(reversed(tail), request.sampling_params.priority)

    def free(self, request: Request) -> None:
        """Release every block of the request; tail blocks become evictable first."""
        table = self._tables.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table), request.sampling_params.priority)

    def reset_prefix_cache(self) -> int:
        """Forget every unheld cached block, on the device and in every lower tier."""
        dropped = self.pool.reset_prefix_cache()
        if self.tiers is not None:
            dropped += self.tiers.reset()
        return dropped

    def check_integrity(self) -> None:
        """Raise AssertionError if any reference count, queue or index disagrees."""
        refs: dict[int, int] = {}
        tables = dict(self._tables)
        for rid, (prefix, blocks, _, _) in self._loading.items():
            tables[f"{rid} (loading)"] = prefix + blocks
        assert self._ids.keys() == self._tables.keys(), "block ids kept for other tables"
        for rid, table in tables.items():
            ids = [b.block_id for b in table]
            assert rid not in self._ids or self._ids[rid] == ids, f"{rid}: stale block ids"
            assert len(ids) == len(set(ids)), f"request {rid} holds a block twice"
            for block_id in ids:
                refs[block_id] = refs.get(block_id, 0) + 1
        self.pool.check_integrity(refs)
        if self.tiers is not None and not self._loading:
            self.tiers.check_integrity()

    def assert_empty(self) -> None:
        """Every block is unreferenced: nothing leaked after all requests ended."""
        self.check_integrity()
        assert not self._tables, f"block tables still held by {sorted(self._tables)}"
        assert not self._loading, f"tier loads still held by {sorted(self._loading)}"
        assert self.pool.num_free_blocks == self.pool.num_blocks


@dataclass(frozen=True)
class KVEvents:
    """What an instance's prefix cache gained and lost since its last report."""

    added: list[bytes]
    removed: list[bytes]
    lower: list[bytes] = field(default_factory=list)  # now held only below the device
    device: list[bytes] = field(default_factory=list)  # now (again) on the device


def resolve_max_model_len(config: EngineConfig, max_positions: int, num_blocks: int) -> int:
    """The context limit: the config's, else the model's (``max_positions``), capped by
    what the pool holds (the engine's rule; the simulator's instances take it too)."""
    pool_tokens = num_blocks * config.cache.block_size
    if config.max_model_len is not None:
        if config.max_model_len > max_positions:
            raise InvalidArgumentError(
                "max_model_len",
                f"{config.max_model_len} exceeds the model's max_position_embeddings "
                f"({max_positions})",
            )
        if config.max_model_len > pool_tokens:
            raise InvalidArgumentError(
                "max_model_len",
                f"{config.max_model_len} tokens do not fit the KV cache "
                f"({num_blocks} blocks x {config.cache.block_size} = {pool_tokens} tokens); "
                "raise cache.kv_cache_memory_bytes or lower max_model_len",
            )
        return config.max_model_len
    if max_positions > pool_tokens:
        logger.info(
            "max_model_len capped at %d tokens by the KV cache size (model allows %d)",
            pool_tokens,
            max_positions,
        )
    return min(max_positions, pool_tokens)
