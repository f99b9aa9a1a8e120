"""Expert load of MoE instances: per-layer token counts from every rank, and imbalance.

Each rank counts, on its device, the tokens it routed to each expert
(:func:`pdserve.models.moe.expert_load`); the controller reads every rank
now and then (the counters are never read in the step loop), sums them per
layer and, from the tokens routed since its previous read, computes per
layer::

    by expert   max over mean of the tokens each expert got
    by rank     max over mean of the rows each EP rank's expert slots computed
                (1.0 when the experts are not split over ranks)

Ranks count the rows their slots computed themselves
(:func:`pdserve.models.moe.expert_rows`), so the ratio stays right when
EPLB replicates hot experts and splits their tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray

from pdserve.cluster.elastic_ep import refresh_members
from pdserve.core.snapshot import ExpertLoad

if TYPE_CHECKING:
    from pdserve.cluster.instances import Instance


def imbalance(tokens: list[int], parts: int = 0) -> float:
    """Max over mean of ``tokens`` (summed in ``parts`` equal runs when given); 1 if none."""
    if parts > 1:
        size = len(tokens) // parts
        tokens = [sum(tokens[i * size : (i + 1) * size]) for i in range(parts)]
    total = sum(tokens)
    return max(tokens) * len(tokens) / total if total else 1.0


class ExpertLoadReader:
    """Reads the MoE instances' counters; keeps the previous read for the recent window."""

    def __init__(self) -> None:
        self._last: dict[str, dict[int, list[int]]] = {}
        self._last_rows: dict[str, list[dict[int, int]]] = {}
        self._recent: dict[str, ExpertLoad] = {}

    def read(self, instances: list[Instance], timeout_s: float) -> dict[str, ExpertLoad]:
        """Instance id -> its expert load, for the instances whose ranks all answered."""
        elastic = refresh_members(instances, timeout_s)  # first drop ranks an instance lost
        refs = {
            i.instance_id: [w.expert_load.remote() for w in i.group.workers]
            + [w.expert_rows.remote() for w in i.group.workers]
            for i in instances
        }
        everything = [r for rs in refs.values() for r in rs]
        ready, _ = ray.wait(everything, num_returns=len(everything), timeout=timeout_s)
        done = set(ready)
        out = {}
        for instance in instances:
            mine = refs[instance.instance_id]
            if not all(r in done for r in mine):
                continue
            try:
                answers = ray.get(mine, timeout=0)
            except Exception:  # a rank died: the health check deals with it
                continue
            n = len(instance.group.workers)
            load = self._update(instance, answers[:n], answers[n:])
            status = elastic.get(instance.instance_id)
            load.ep_rank_failures = sum(len(r.dead) for r in status.recoveries) if status else 0
            load.ep_ranks = len(status.members) if status else 0
            out[instance.instance_id] = load
        for gone in set(self._last) - {i.instance_id for i in instances}:
            self._last.pop(gone, None)
            self._last_rows.pop(gone, None)
            self._recent.pop(gone, None)
        return out

    def _update(
        self,
        instance: Instance,
        per_rank: list[dict[int, list[int]]],
        rows: list[dict[int, int]],
    ) -> ExpertLoad:
        total: dict[int, list[int]] = {}
        for counts in per_rank:
            for layer, tokens in counts.items():
                have = total.setdefault(int(layer), [0] * len(tokens))
                for e, n in enumerate(tokens):
                    have[e] += n
        before = self._last.get(instance.instance_id, {})
        by_rows = rank_windows(rows, self._last_rows.get(instance.instance_id, []))
        self._last_rows[instance.instance_id] = rows
        by_expert: dict[int, float] = {}
        by_rank: dict[int, float] = {}
        previous = self._recent.get(instance.instance_id)
        for layer, tokens in total.items():
            old = before.get(layer, [0] * len(tokens))
            window = [n - o for n, o in zip(tokens, old, strict=True)]
            if sum(window) == 0 and previous is not None and layer in previous.by_expert:
                by_expert[layer] = previous.by_expert[layer]  # nothing new: keep the last
                by_rank[layer] = previous.by_rank[layer]
                continue
            by_expert[layer] = imbalance(window)
            by_rank[layer] = imbalance(by_rows[layer]) if layer in by_rows else 1.0
        self._last[instance.instance_id] = total
        load = ExpertLoad(total, by_expert, by_rank)
        self._recent[instance.instance_id] = load
        return load


def rank_windows(rows: list[dict[int, int]], before: list[dict[int, int]]) -> dict[int, list[int]]:
    """Layer -> rows each rank that holds it computed since ``before`` (one read earlier)."""
    out: dict[int, list[int]] = {}
    for i, counts in enumerate(rows):
        old = before[i] if i < len(before) else {}
        for layer, n in counts.items():
            out.setdefault(int(layer), []).append(n - old.get(layer, 0))
    return out
