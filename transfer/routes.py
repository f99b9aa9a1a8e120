"""Which prefill rank sends which KV slice to which decode rank (re-sharding).

A rank holds the layers of its pipeline stage and a range of KV heads (all of
them for TP=1; a 1/tp share, or one replicated head when heads < tp). For every
decode rank and every layer and head it holds, exactly one prefill rank is the
source: the lowest-numbered prefill rank holding that layer and head. Runs of
adjacent heads from the same source become one :class:`Route`::

    prefill TP=2 (heads 0-3 | 4-7)  ->  decode TP=1 (heads 0-7)
        route p0 -> d0, heads 0-3 into local 0-3
        route p1 -> d0, heads 4-7 into local 4-7

An attention-FFN disaggregated (afd) layout's expert ranks hold no KV cache:
they hold no heads, so they neither send nor receive (nor wait for) a route,
and the instance's attention ranks exchange KV like a TP group::

    prefill TP=1  ->  decode afd 1+1 (rank 0 attention, rank 1 experts)
        route p0 -> d0, heads 0-7                  (nothing into d1)

Layouts are described by (tp, pp, ep, stage layers) only; this module does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.layout import Layout


@dataclass(frozen=True)
class Route:
    """One rank pair's share of every transfer: these layers, these heads."""

    src_rank: int
    dst_rank: int
    layers: tuple[int, int]  # global layer range [start, end)
    heads: tuple[int, int]  # global KV head range [start, end)
    src_first_layer: int  # global index of the source rank's local layer 0
    dst_first_layer: int
    src_first_head: int  # global index of the source rank's local head 0
    dst_first_head: int

    def src_heads(self) -> tuple[int, int]:
        return self.heads[0] - self.src_first_head, self.heads[1] - self.src_first_head

    def dst_heads(self) -> tuple[int, int]:
        return self.heads[0] - self.dst_first_head, self.heads[1] - self.dst_first_head


def kv_heads_of(num_kv_heads: int, layout: Layout, rank: int) -> tuple[int, int]:
    """Global KV head range held by ``rank`` (empty on an afd expert rank)."""
    if layout.is_expert_rank(rank):
        return 0, 0
    tp_rank = layout.coords(rank).tp_rank
    if num_kv_heads >= layout.tp:
        per = num_kv_heads // layout.tp
        return tp_rank * per, (tp_rank + 1) * per
    head = tp_rank * num_kv_heads // layout.tp
    return head, head + 1


def plan_routes(num_kv_heads: int, src: Layout, dst: Layout) -> list[Route]:
    """Every route from ``src`` (prefill) ranks to ``dst`` (decode) ranks."""
    routes: list[Route] = []
    for d in range(dst.world_size):
        if dst.is_expert_rank(d):
            continue  # no KV cache there
        d_layers = dst.stage_layers[dst.coords(d).stage]
        d_heads = kv_heads_of(num_kv_heads, dst, d)
        for s_stage, s_layers in enumerate(src.stage_layers):
            lo, hi = max(d_layers[0], s_layers[0]), min(d_layers[1], s_layers[1])
            if lo >= hi:
                continue
            stage_ranks = [s_stage * src.ranks_per_stage + i for i in range(src.ranks_per_stage)]
            stage_ranks = [r for r in stage_ranks if not src.is_expert_rank(r)]
            routes.extend(
                _head_runs(num_kv_heads, src, stage_ranks, d, d_heads, (lo, hi), s_layers, d_layers)
            )
    return routes


def _head_runs(
    num_kv_heads: int,
    src: Layout,
    stage_ranks: list[int],
    d: int,
    d_heads: tuple[int, int],
    layers: tuple[int, int],
    s_layers: tuple[int, int],
    d_layers: tuple[int, int],
) -> list[Route]:
    runs: list[Route] = []
    for head in range(*d_heads):
        source = next(r for r in stage_ranks if _holds(num_kv_heads, src, r, head))
        s_first = kv_heads_of(num_kv_heads, src, source)[0]
        last = runs[-1] if runs else None
        if last is not None and last.src_rank == source and last.heads[1] == head:
            runs[-1] = Route(
                source,
                d,
                layers,
                (last.heads[0], head + 1),
                s_layers[0],
                d_layers[0],
                s_first,
                d_heads[0],
            )
        else:
            runs.append(
                Route(
                    source,
                    d,
                    layers,
                    (head, head + 1),
                    s_layers[0],
                    d_layers[0],
                    s_first,
                    d_heads[0],
                )
            )
    return runs


def _holds(num_kv_heads: int, layout: Layout, rank: int, head: int) -> bool:
    lo, hi = kv_heads_of(num_kv_heads, layout, rank)
    return lo <= head < hi


def routes_into(routes: list[Route], dst_rank: int) -> int:
    """How many routes feed one decode rank (each ends a transfer with one marker).

    0 for an afd expert rank: a decode step never waits for one there.
    """
    return sum(1 for r in routes if r.dst_rank == dst_rank)
