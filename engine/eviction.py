"""Eviction policies: which unreferenced KV block is handed out (or moved down a tier) next.

Every tier of the KV hierarchy (the device pool, host memory, local disk) keeps
its unreferenced blocks in one :class:`EvictionPolicy`; the tier calls ``add``
when a block's last reference goes, ``remove`` when a block is taken back into
use (a prefix hit), and ``pop`` for the next victim. Three policies:

    lru       freed longest ago first
    idle      like lru, and a block unused for ``idle_s`` seconds is *expired*:
              the tier moves it down a level without waiting for pressure
    priority  blocks last used by the lowest-priority request first; lru within
              one priority

In every policy a block that holds no hash (nothing reusable) goes before any
cached one.
"""

from __future__ import annotations

import abc
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.core.errors import InvalidArgumentError


@dataclass(eq=False, slots=True)
class KVBlock:
    """One page of a tier: ``block_size`` token slots in every layer's K and V.

    ``priority`` is the highest priority of the requests that used the block
    since it was last handed out; ``last_used`` is when its last holder let go.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    priority: int = 0
    last_used: float = 0.0


class EvictionPolicy(abc.ABC):
    """Orders unreferenced blocks for reuse. Implementations hold no other state.

    Every policy hands out uncached blocks (no hash) first, least recently freed
    first; it keeps them in ``_plain`` and orders only the cached ones its own way.
    ``_plain`` is a plain FIFO: an uncached block leaves it only by being handed
    out (a block taken back into use is a prefix hit, so it holds a hash).
    """

    def __init__(self) -> None:
        self._plain: deque[KVBlock] = deque()

    @abc.abstractmethod
    def add(self, block: KVBlock) -> None: ...

    def add_all(self, blocks: Iterable[KVBlock]) -> None:
        """``add`` each of ``blocks``, in order."""
        plain, add = self._plain.append, self.add
        for block in blocks:
            if block.block_hash is None:
                plain(block)
            else:
                add(block)

    @abc.abstractmethod
    def remove(self, block: KVBlock) -> None: ...

    @abc.abstractmethod
    def pop(self) -> KVBlock: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, block: KVBlock) -> bool: ...

    @abc.abstractmethod
    def block_ids(self) -> set[int]:
        """The ids of every block in the queue (for integrity checks)."""

    def expired(self, now: float) -> list[KVBlock]:
        """Cached blocks to move down a tier now, without pressure (none by default)."""
        return []

    @property
    def num_uncached(self) -> int:
        """Blocks without a hash, which ``pop`` hands out before any cached one."""
        return len(self._plain)

    def pop_uncached(self, n: int) -> list[KVBlock]:
        """The next ``n`` blocks ``pop`` would give, all uncached (``n <= num_uncached``)."""
        popleft = self._plain.popleft
        return [popleft()] if n == 1 else [popleft() for _ in range(n)]

    def _remove_plain(self, block: KVBlock) -> None:
        self._plain.remove(block)  # O(n); no caller takes an uncached block back


class LRUEviction(EvictionPolicy):
    """Least recently freed first; uncached blocks before cached ones."""

    def __init__(self) -> None:
        super().__init__()
        self._cached: OrderedDict[int, KVBlock] = OrderedDict()

    def add(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self._plain.append(block)
        else:
            self._cached[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self._remove_plain(block)
        else:
            del self._cached[block.block_id]

    def pop(self) -> KVBlock:
        if self._plain:
            return self._plain.popleft()
        return self._cached.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._plain) + len(self._cached)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._cached or block in self._plain

    def block_ids(self) -> set[int]:
        return {b.block_id for b in self._plain} | set(self._cached)


class IdleEviction(LRUEviction):
    """LRU order, and cached blocks unused for ``idle_s`` seconds expire."""

    def __init__(self, idle_s: float) -> None:
        super().__init__()
        self.idle_s = idle_s

    def expired(self, now: float) -> list[KVBlock]:
        out = []
        for block in self._cached.values():  # oldest first: stop at the first fresh one
            if now - block.last_used < self.idle_s:
                break
            out.append(block)
        return out


class PriorityEviction(EvictionPolicy):
    """Lowest priority first, least recently freed first within a priority."""

    def __init__(self) -> None:
        super().__init__()
        self._cached: dict[int, OrderedDict[int, KVBlock]] = {}
        self._where: dict[int, int] = {}  # block id -> its priority queue

    def add(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self._plain.append(block)
            return
        self._cached.setdefault(block.priority, OrderedDict())[block.block_id] = block
        self._where[block.block_id] = block.priority

    def remove(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self._remove_plain(block)
            return
        priority = self._where.pop(block.block_id)
        queue = self._cached[priority]
        del queue[block.block_id]
        if not queue:
            del self._cached[priority]

    def pop(self) -> KVBlock:
        if self._plain:
            return self._plain.popleft()
        lowest = min(self._cached)
        queue = self._cached[lowest]
        block = queue.popitem(last=False)[1]
        del self._where[block.block_id]
        if not queue:
            del self._cached[lowest]
        return block

    def __len__(self) -> int:
        return len(self._plain) + len(self._where)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._where or block in self._plain

    def block_ids(self) -> set[int]:
        return {b.block_id for b in self._plain} | set(self._where)


EVICTION_POLICIES = ("lru", "idle", "priority")


def make_policy(name: str, idle_s: float = 60.0, field: str = "eviction") -> EvictionPolicy:
    """The policy called ``name``; ``field`` names the config entry in the error."""
    if name == "lru":
        return LRUEviction()
    if name == "idle":
        return IdleEviction(idle_s)
    if name == "priority":
        return PriorityEviction()
    raise InvalidArgumentError(field, f"unknown policy {name!r}; one of {EVICTION_POLICIES}")


Clock = Callable[[], float]
DEFAULT_CLOCK: Clock = time.monotonic
