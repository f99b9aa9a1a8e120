"""Where offloaded KV blocks live below the device pool: host memory, then local disk.

The engine keeps the index; the ranks keep the bytes
(:class:`~pdserve.parallel.kv_tiers.TierStore`) and run the ops this index emits
with each step (:class:`~pdserve.core.step.TierOps`)::

    device pool --store (write-through, when a block is cached)--> host slots
    host slots  --demote (when the host tier evicts, or a block idles)--> disk files
    host / disk --load (a prefix hit below the device)--> a device block

Each tier is a :class:`BlockPool` of slots with its own eviction policy; a slot
holds one block hash. Writes run on the ranks beside the step's forward (those
that read a device block the step itself reuses run just before it) and are
done when the step returns, so between steps the index and the bytes agree. A
load that fails (a disk file missing or failing its MAC) is a cache miss:
the block is recomputed, never used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.step import TierLoad, TierOps, TierWrite
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.eviction import DEFAULT_CLOCK, Clock, KVBlock, make_policy

TIERS = ("host", "disk")


@dataclass
class TierCounters:
    """Blocks looked up below the device pool, per tier; and the writes issued."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: int = 0
    failed_loads: int = 0
    stores: int = 0  # device -> host or disk
    demotions: int = 0  # host -> disk
    drops: int = 0  # disk files deleted


@dataclass(frozen=True)
class TierHit:
    """One block found below the device pool: its tier and slot there."""

    tier: str
    entry: KVBlock
    block_hash: bytes


class KVTiers:
    """The index of the host and disk tiers of one instance, and the ops to run next."""

    def __init__(
        self,
        host_slots: int,
        disk_slots: int,
        host_eviction: str = "lru",
        disk_eviction: str = "lru",
        idle_s: float = 60.0,
        clock: Clock = DEFAULT_CLOCK,
    ) -> None:
        self.clock = clock
        self.host = self._tier(host_slots, host_eviction, idle_s, "host_tier_eviction")
        self.disk = self._tier(disk_slots, disk_eviction, idle_s, "disk_tier_eviction")
        if self.host is not None:
            self.host.on_evict = self._demote
        if self.disk is not None:
            self.disk.on_evict = self._drop
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.drain_events()  # start recording what the tiers gain and lose
        self.counters = TierCounters()
        self._pending: dict[bytes, tuple[int, int]] = {}  # hash -> (device block, priority)
        self._loads: list[TierLoad] = []
        self._loading: list[tuple[BlockPool, KVBlock]] = []
        self._writes: list[TierWrite] = []
        # Stores queued for the next step, by hash: their index in ``_writes``.
        self._queued: dict[bytes, int] = {}
        self._sync = 0  # leading writes that must land before the step writes KV

    def _tier(self, slots: int, policy: str, idle_s: float, field: str) -> BlockPool | None:
        if slots <= 0:
            return None
        return BlockPool(slots, True, make_policy(policy, idle_s, field), self.clock)

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    # -- writes -----------------------------------------------------------------

    def cached(self, block_id: int, block_hash: bytes, priority: int) -> None:
        """A device block became a full prefix block: copy it down at the next step."""
        self._pending[block_hash] = (block_id, priority)

    def begin_step(self) -> None:
        """Queue the copies of the blocks cached since the last step (before allocating)."""
        for block_hash, (block_id, priority) in self._pending.items():
            self._store(block_id, block_hash, priority)
        self._pending.clear()

    def evicted(self, block_hash: bytes) -> None:
        """The device pool hands out a cached block.

        Between steps its bytes may be overwritten at once (a KV transfer into a
        reservation), so a copy not yet queued is forgotten. Within a step's
        scheduling, a queued copy must land before the step writes into the
        block: it and every write queued before it run ahead of the forward.
        """
        self._pending.pop(block_hash, None)
        index = self._queued.get(block_hash)
        if index is not None:
            self._sync = max(self._sync, index + 1)

    def take_ops(self) -> TierOps:
        """The ops of the step about to run: leading writes, loads, the other writes."""
        self.begin_step()
        self._sweep_idle()
        ops = TierOps(self._loads, self._writes, self._sync)
        self._loads, self._writes, self._queued, self._sync = [], [], {}, 0
        return ops

    def _store(self, block_id: int, block_hash: bytes, priority: int) -> None:
        top = self.host if self.host is not None else self.disk
        if top is None or self.holds(block_hash) or top.num_free_blocks == 0:
            return
        slot = top.allocate(1)[0]  # may demote or drop the victim first
        top.cache(slot, block_hash)
        kind = "store" if top is self.host else "save"
        self._queued[block_hash] = len(self._writes)
        self._writes.append(TierWrite(kind, block_id, slot.block_id, block_hash))
        top.free([slot], priority)
        self.counters.stores += 1

    def holds(self, block_hash: bytes) -> bool:
        """Some lower tier holds the block."""
        return any(
            t is not None and t.lookup(block_hash) is not None for t in (self.host, self.disk)
        )

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes the lower tiers gained and lost since the last call."""
        added: list[bytes] = []
        removed: list[bytes] = []
        for tier in (self.host, self.disk):
            if tier is not None:
                got, lost = tier.drain_events()
                added += got
                removed += lost
        return added, removed

    def _demote(self, slot: KVBlock, block_hash: bytes) -> None:
        """The host tier gives up ``slot``: keep its block on disk if there is a disk tier."""
        disk = self.disk
        if disk is None or disk.lookup(block_hash) is not None or disk.num_free_blocks == 0:
            return
        entry = disk.allocate(1)[0]
        disk.cache(entry, block_hash)
        self._writes.append(TierWrite("demote", -1, slot.block_id, block_hash))
        disk.free([entry], slot.priority)
        self.counters.demotions += 1

    def _drop(self, entry: KVBlock, block_hash: bytes) -> None:
        self._writes.append(TierWrite("drop", -1, entry.block_id, block_hash))
        self.counters.drops += 1

    def _sweep_idle(self) -> None:
        """Host blocks idle past the host policy's limit go down to disk now."""
        host = self.host
        if host is None:
            return
        for slot in host.expired(self.clock()):
            host.evict(slot)

    # -- loads --------------------------------------------------------------------

    def find(self, hashes: Sequence[bytes]) -> list[TierHit]:
        """The leading run of ``hashes`` held by a lower tier (host preferred)."""
        hits = []
        for block_hash in hashes:
            hit = self._find_one(block_hash)
            if hit is None:
                self.counters.misses += 1
                break
            hits.append(hit)
        return hits

    def _find_one(self, block_hash: bytes) -> TierHit | None:
        for name, tier in (("host", self.host), ("disk", self.disk)):
            entry = tier.lookup(block_hash) if tier is not None else None
            if entry is not None:
                return TierHit(name, entry, block_hash)
        return None

    def load(self, hits: Sequence[TierHit], device_blocks: Sequence[int]) -> None:
        """Copy ``hits`` into ``device_blocks`` at the next step; entries stay put until then."""
        for hit, block_id in zip(hits, device_blocks, strict=True):
            tier = self.host if hit.tier == "host" else self.disk
            assert tier is not None
            tier.touch([hit.entry])
            self._loading.append((tier, hit.entry))
            self._loads.append(TierLoad(hit.tier, hit.entry.block_id, hit.block_hash, block_id))
            self.counters.hits[hit.tier] += 1

    def loads_done(self, loads: Sequence[TierLoad], ok: Sequence[bool]) -> None:
        """The step ran (``ok`` has a flag per load; empty if the step failed)."""
        for tier, entry in self._loading:
            tier.free([entry], entry.priority)
        self._loading.clear()
        flags = list(ok) if len(ok) == len(loads) else [False] * len(loads)
        for load, good in zip(loads, flags, strict=True):
            if not good:
                self.counters.failed_loads += 1
                self.forget(load.block_hash)

    def forget(self, block_hash: bytes) -> None:
        """Drop a hash from every tier's index (its bytes are not to be trusted)."""
        for tier in (self.host, self.disk):
            entry = tier.lookup(block_hash) if tier is not None else None
            if tier is not None and entry is not None and entry.ref_cnt == 0:
                tier.evict(entry, notify=tier is self.disk)

    def forget_writes(self, writes: Sequence[TierWrite]) -> None:
        """A step failed: the blocks it wrote down may be incomplete, so none is used."""
        for write in writes:
            if write.kind != "drop":
                self.forget(write.block_hash)

    def reset(self) -> int:
        """Forget every block in every tier (disk files are deleted at the next step)."""
        dropped = 0
        for tier in (self.host, self.disk):
            if tier is not None:
                for block_hash in tier.cached_hashes():
                    entry = tier.lookup(block_hash)
                    assert entry is not None
                    tier.evict(entry, notify=tier is self.disk)
                    dropped += 1
        return dropped

    # -- inspection -----------------------------------------------------------------

    def num_blocks(self, tier: str) -> int:
        pool = self.host if tier == "host" else self.disk
        return 0 if pool is None else pool.num_cached_blocks

    def capacity(self, tier: str) -> int:
        pool = self.host if tier == "host" else self.disk
        return 0 if pool is None else pool.num_blocks

    def check_integrity(self) -> None:
        """Between steps: no entry is held, and every tier's queues and index agree."""
        assert not self._loading, f"{len(self._loading)} tier loads never finished"
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.check_integrity({})
