"""Expert-parallel load balancing (EPLB): which expert each slot of each EP rank holds.

With ``E`` experts, ``K`` redundant experts and ``ep`` ranks, every rank of a
stage holds ``(E + K) / ep`` expert *slots*; slot ``s`` lives on rank
``s // slots_per_rank``. A :class:`Placement` maps each slot to a logical
expert: every expert at least once, hot experts more often. Tokens routed to
an expert are split evenly over its replicas (:mod:`pdserve.models.moe_ep`).

:func:`place` chooses a placement from measured tokens per expert, in two
greedy passes (as DeepSeek's EPLB does):

1. replicas: ``K`` times, give one more replica to the expert with the highest
   load per replica (at most ``ep`` replicas each: more would share a rank);
2. ranks: take the replicas heaviest first (load per replica), each to the
   least-loaded rank with a free slot that does not hold that expert yet.

Pure Python, no torch: the same counts give the same placement on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from pdserve.core.layout import slots_per_rank


@dataclass(frozen=True)
class Placement:
    """``slots[s]`` is the logical expert of slot ``s``; rank ``r`` holds a run of slots."""

    slots: tuple[int, ...]
    ep: int

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.ep

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The experts of ``rank``'s slots, in slot order."""
        n = self.slots_per_rank
        return self.slots[rank * n : (rank + 1) * n]

    @cached_property
    def replicas(self) -> dict[int, list[int]]:
        """Expert -> the slots holding it, in slot order."""
        out: dict[int, list[int]] = {}
        for s, e in enumerate(self.slots):
            out.setdefault(e, []).append(s)
        return out

    def check(self, num_experts: int) -> None:
        """Raise ValueError unless the slots split evenly and hold every expert."""
        if len(self.slots) % self.ep:
            raise ValueError(f"{len(self.slots)} slots do not split over {self.ep} ranks")
        missing = set(range(num_experts)) - set(self.slots)
        if missing or not set(self.slots) <= set(range(num_experts)):
            raise ValueError(f"placement {self.slots} does not hold experts 0..{num_experts - 1}")


def static_placement(num_experts: int, redundant: int, ep: int) -> Placement:
    """Experts in order, then replicas of experts ``0..K-1``: with ``K = 0`` rank ``r``
    holds ``[r * E / ep, (r + 1) * E / ep)``, the layout without EPLB."""
    slots_per_rank(num_experts, redundant, ep)
    extra = [e % num_experts for e in range(redundant)]
    return Placement(tuple(range(num_experts)) + tuple(extra), ep)


def replica_counts(load: Sequence[float], redundant: int, cap: int) -> list[int]:
    """Replicas per expert: ``redundant`` extra ones, each to the highest load per replica."""
    counts = [1] * len(load)
    for _ in range(redundant):
        open_ = [e for e in range(len(load)) if counts[e] < cap]
        hot = max(open_, key=lambda e: (load[e] / counts[e], -e))
        counts[hot] += 1
    return counts


def place(load: Sequence[float], redundant: int, ep: int) -> Placement:
    """A placement of ``len(load)`` experts plus ``redundant`` replicas over ``ep`` ranks."""
    num_experts = len(load)
    per_rank = slots_per_rank(num_experts, redundant, ep)
    counts = replica_counts(load, redundant, ep)
    items = sorted(
        ((load[e] / counts[e], e) for e in range(num_experts) for _ in range(counts[e])),
        key=lambda item: (-item[0], item[1]),
    )
    held: list[list[int]] = [[] for _ in range(ep)]
    rank_load = [0.0] * ep
    for weight, e in items:
        free = [r for r in range(ep) if len(held[r]) < per_rank]
        # A second replica on the same rank is wasted but still correct.
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += weight
    return Placement(tuple(e for rank in held for e in sorted(rank)), ep)


def rank_loads(load: Sequence[float], placement: Placement) -> list[float]:
    """Tokens each rank computes when every expert's tokens split evenly over its replicas."""
    out = [0.0] * placement.ep
    for e, slots in placement.replicas.items():
        for s in slots:
            out[s // placement.slots_per_rank] += load[e] / len(slots)
    return out


def imbalance(per_rank: Sequence[float]) -> float:
    """Max over mean of ``per_rank``; 1.0 when nothing was counted."""
    total = sum(per_rank)
    return max(per_rank) * len(per_rank) / total if total else 1.0


def shrink(placement: Placement, survivors: Sequence[int], num_experts: int) -> Placement:
    """The placement over the ``survivors`` (old EP ranks, in order) when the others die.

        Deterministic, so every survivor computes the same one. Each survivor keeps
        the experts it holds (a dead rank's expert that a survivor already holds as
        a replica needs no load); each expert no survivor holds goes to the survivor
        with the fewest experts, over a replica if every slot is taken (from the
    survivor that gave up the fewest so far); free slots
        take replicas of the least-replicated experts. A survivor holds
        ``max(S, ceil(E / survivors))`` slots (at most ``E``); with one survivor,
        every expert once, in order (the layout without expert parallelism).
    """
    ep = len(survivors)
    if ep == 1:
        return static_placement(num_experts, 0, 1)
    per_rank = min(num_experts, max(placement.slots_per_rank, -(-num_experts // ep)))
    held = [list(dict.fromkeys(placement.rank_slots(r)))[:per_rank] for r in survivors]
    count = Counter(e for h in held for e in h)
    taken = [0] * ep  # replicas each survivor gave up: spread the reads
    for e in range(num_experts):
        if count[e]:
            continue
        free = [i for i in range(ep) if len(held[i]) < per_rank]
        if free:
            held[min(free, key=lambda i: (len(held[i]), i))].append(e)
        else:  # every slot taken: some expert has a replica to give up
            i, x = max(
                ((i, x) for i in range(ep) for x in held[i] if count[x] > 1),
                key=lambda p: (-taken[p[0]], count[p[1]], -p[0], -p[1]),
            )
            held[i][held[i].index(x)] = e
            count[x] -= 1
            taken[i] += 1
        count[e] += 1
    for h in held:
        while len(h) < per_rank:
            x = min((e for e in range(num_experts) if e not in h), key=lambda e: (count[e], e))
            h.append(x)
            count[x] += 1
    return Placement(tuple(e for h in held for e in h), ep)
