"""Which prefill instance holds which KV blocks, in which tier, fed by the instances' KV events.

A block is held on the instance's device, or (with KV tiers) only below it, in
host memory or on disk: a hit there is loaded back instead of recomputed, but
only a block on the device can be served to a peer between two steps.
Blocks are named by the same chained hash the instances use
(:func:`~pdserve.engine.block_hash.hash_block_tokens`), so the router can
hash a prompt once and ask, per instance, how long a prefix is already cached.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pdserve.engine.block_hash import adapter_salt, block_hashes, first_parent


def prompt_block_hashes(
    token_ids: list[int],
    block_size: int,
    lora: str | None = None,
    fingerprint: str = "",
    cache_salt: str | None = None,
) -> list[bytes]:
    """Chained hashes of the prompt's full blocks, as an instance would compute them
    for a request under LoRA adapter ``lora`` (None: the base model) whose content
    has ``fingerprint``, in prefix-cache tenant ``cache_salt`` (None: the shared one)."""
    parent = first_parent(adapter_salt(lora, fingerprint), cache_salt)
    return block_hashes(token_ids, block_size, parent=parent)


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = defaultdict(set)
        self._held: dict[str, set[bytes]] = defaultdict(set)
        self._lower: dict[str, set[bytes]] = defaultdict(set)  # held, but not on the device

    def apply(
        self,
        instance_id: str,
        added: Sequence[bytes],
        removed: Sequence[bytes],
        lower: Sequence[bytes] = (),
        device: Sequence[bytes] = (),
    ) -> None:
        """One report's events: held blocks gained and lost (any tier), then tier moves."""
        self._apply_held(instance_id, added, removed)
        held, below = self._held[instance_id], self._lower[instance_id]
        below.difference_update(removed)
        below.difference_update(device)
        below.update(h for h in lower if h in held)

    def _apply_held(
        self, instance_id: str, added: Sequence[bytes], removed: Sequence[bytes]
    ) -> None:
        held = self._held[instance_id]
        for h in removed:
            held.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[h]
        for h in added:
            held.add(h)
            self._holders[h].add(instance_id)

    def forget(self, instance_id: str) -> None:
        self._apply_held(instance_id, [], list(self._held.get(instance_id, ())))
        self._held.pop(instance_id, None)
        self._lower.pop(instance_id, None)

    def cached_prefixes(self, hashes: list[bytes]) -> dict[str, int]:
        """Leading blocks of ``hashes`` held, for every instance holding at least one.

        Walks the prompt's blocks once, touching only their holders, so the cost
        does not grow with the number of instances that hold none of it.
        """
        counts: dict[str, int] = {}
        for k, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            extended = 0
            for instance in holders:
                if counts.get(instance, 0) == k:
                    counts[instance] = k + 1
                    extended += 1
            if not extended:
                break
        return counts

    def holder_count(self, block: bytes) -> int:
        """How many instances hold ``block``."""
        holders = self._holders.get(block)
        return len(holders) if holders else 0

    def holders(self, block: bytes) -> frozenset[str]:
        """The instances that hold ``block`` (any tier)."""
        return frozenset(self._holders.get(block, ()))

    def held_depth(self, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` that some instance holds: no instance holds more."""
        n = 0
        for h in hashes:
            if h not in self._holders:
                break
            n += 1
        return n

    def cached_blocks(self, instance_id: str, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` the instance holds."""
        held = self._held.get(instance_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def device_blocks(self, instance_id: str, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` the instance holds on its device."""
        held, below = self._held.get(instance_id), self._lower.get(instance_id, set())
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held or h in below:
                break
            n += 1
        return n

    def size(self, instance_id: str) -> int:
        return len(self._held.get(instance_id, ()))
