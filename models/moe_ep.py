"""Expert-parallel forward of a :class:`~pdserve.models.moe.SparseMoE` over its slots.

Every rank of the stage holds all ``T`` tokens and routes a ``1/ep`` slice of
them. Each (token, expert) pair goes to one of the expert's replicas (slots):
replica ``(global token index) mod (replica count)``, so an expert's tokens
split evenly over its replicas, and a replica's rank is ``slot // S``. An
all-to-all sends each pair's row and slot to that rank, which runs the slot's
expert; a second all-to-all brings the outputs back, the routing rank sums a
token's ``k`` weighted outputs, and an all-gather gives every rank the whole
batch again. Replicas hold identical weights, so the output equals the one
without replicas up to the order of float sums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pdserve.distributed.context import ParallelContext, all_gather, split_evenly

if TYPE_CHECKING:
    from pdserve.models.moe import SparseMoE


def expert_parallel_forward(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    # x: [T, H] (every rank of the stage holds all T tokens) -> [T, H]
    ctx = moe.ctx
    lo, hi = split_evenly(x.shape[0], ctx.ep_size, ctx.ep_rank)
    out = route_and_combine(moe, x[lo:hi], lo)
    return _all_gather_rows(out, x.shape[0], ctx.ep_size, ctx)


def route_and_combine(moe: SparseMoE, mine: torch.Tensor, lo: int) -> torch.Tensor:
    """Route this rank's tokens ``mine`` [t, H] (rows ``lo ..`` of the batch) through the
    EP group's experts; their combined outputs [t, H]. Collective over the EP group."""
    ctx = moe.ctx
    ep, rank, per_rank = ctx.ep_size, ctx.ep_rank, moe.local_experts
    weights, experts = moe.ops.route(F.linear(mine, moe.gate), moe.top_k)  # [t, k]
    moe.count(experts)
    pair_token = torch.arange(mine.shape[0], device=mine.device).repeat_interleave(moe.top_k)
    pair_expert = experts.reshape(-1)  # [P]
    pick = (pair_token + lo) % moe.replica_count[pair_expert]
    pair_slot = moe.replica_slots[pair_expert, pick]  # [P]: the physical slot
    order = torch.argsort(pair_slot // per_rank, stable=True)
    pair_token, pair_slot = pair_token[order], pair_slot[order]
    pair_weight = weights.reshape(-1)[order]
    send_counts = torch.bincount(pair_slot // per_rank, minlength=ep)
    recv_counts = torch.empty_like(send_counts)
    with ctx.comm.timed(send_counts.numel() * 8):
        dist.all_to_all_single(recv_counts, send_counts, group=ctx.ep_group)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    # Dispatch: each (token, slot) pair goes to the rank holding the slot.
    rows = _all_to_all(mine[pair_token], recvs, sends, ctx)  # [P_in, H]
    row_slot = _all_to_all(pair_slot, recvs, sends, ctx) - rank * per_rank  # [P_in] local
    outputs = _run_slots(moe, rows, row_slot)
    # Combine: outputs return to the rank that routed the token.
    back = _all_to_all(outputs, sends, recvs, ctx)  # [P_out, H]
    out = torch.zeros_like(mine)
    out.index_add_(0, pair_token, (back * pair_weight[:, None]).to(out.dtype))
    return out


def _run_slots(moe: SparseMoE, rows: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
    """Each row through its local slot's expert; rows [P_in, H], row_slot [P_in]."""
    outputs = torch.empty_like(rows)
    moe.computed += torch.bincount(row_slot, minlength=moe.local_experts)
    moe.rows_computed += rows.shape[0]
    for s in torch.unique(row_slot).tolist():
        idx = torch.where(row_slot == s)[0]
        h = moe.ops.silu_and_mul(F.linear(rows[idx], moe.w13[s]))
        outputs[idx] = F.linear(h, moe.w2[s])
    return outputs


def _all_to_all(
    t: torch.Tensor, recv_splits: list[int], send_splits: list[int], ctx: ParallelContext
) -> torch.Tensor:
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    with ctx.comm.timed(t.numel() * t.element_size()):
        dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=ctx.ep_group)
    return out


def _all_gather_rows(
    part: torch.Tensor, total: int, parts: int, ctx: ParallelContext
) -> torch.Tensor:
    """Every rank's ``split_evenly`` slice of ``total`` rows, concatenated in order."""
    width = -(-total // parts)
    padded = part.new_zeros((width, *part.shape[1:]))
    padded[: part.shape[0]] = part
    with ctx.comm.timed(padded.numel() * padded.element_size() * parts):
        gathered = all_gather(padded, parts, ctx.ep_group, ctx.ep_shm)
    pieces = []
    for r, g in enumerate(gathered):
        lo, hi = split_evenly(total, parts, r)
        pieces.append(g[: hi - lo])
    return torch.cat(pieces)
