"""Sparse mixture-of-experts MLP (Mixtral): top-k routing over SwiGLU experts.

Routing matches the reference (:func:`pdserve.parallel.kernels.reference.route`):
softmax over the router logits in float32, keep the top ``k``, renormalise
their weights to sum to one. This rank holds the
experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``.

- ``ep == 1``: every rank holds every expert with its intermediate dimension
  split over the TP ranks; partial outputs are summed by an all-reduce.
- ``ep > 1``: each expert lives whole on one rank of the stage. Every rank
  routes a 1/ep slice of the tokens, sends each (token, expert) pair to the
  expert's rank with an all-to-all, gets the expert outputs back with a second
  all-to-all, and an all-gather gives every rank the whole batch again.

Weights per rank: ``w13 [E_local, 2 * I_local, H]`` (gate rows, then up rows),
``w2 [E_local, H, I_local]``, ``gate [E, H]`` (replicated); ``I_local = I / tp``
when ``ep == 1``, else ``I``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.parallel.context import ParallelContext, all_gather, split_evenly
from pdserve.parallel.kernels import KernelOps, reference_kernels
from pdserve.parallel.layers import TensorSource, _copy

# Which checkpoint matrix of an expert a shard id names.
W1_GATE, W3_UP, W2_DOWN = "w1", "w3", "w2"


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
        ops: KernelOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops or reference_kernels()
        if num_experts % ctx.ep_size:
            raise ValueError(
                f"num_local_experts={num_experts} is not divisible by ep={ctx.ep_size}"
            )
        # With experts split over ranks, each expert stays whole.
        self.shard_rank, self.shard_size = (0, 1) if ctx.ep_size > 1 else (ctx.tp_rank, ctx.tp_size)
        if intermediate_size % self.shard_size:
            raise ValueError(
                f"intermediate_size={intermediate_size} is not divisible by tp={ctx.tp_size}"
            )
        self.ctx = ctx
        self.num_experts = num_experts
        self.top_k = top_k
        self.local_experts = num_experts // ctx.ep_size
        self.expert_start = ctx.ep_rank * self.local_experts
        self.inter = intermediate_size // self.shard_size
        self.gate = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w13 = nn.Parameter(
            torch.empty(self.local_experts, 2 * self.inter, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(self.local_experts, hidden_size, self.inter, dtype=dtype),
            requires_grad=False,
        )
        # Tokens this rank routed to each expert since start, counted on the device
        # and read out only when someone asks (see ``expert_load``).
        self.routed = torch.zeros(num_experts, dtype=torch.int64, device=self.gate.device)

    def owns(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.local_experts

    def load(self, source: TensorSource, shard: object, is_bias: bool = False) -> None:
        """``shard`` is ("router",), ("expert", e, "w1"|"w2"|"w3") or ("fused", "w13"|"w2")."""
        assert isinstance(shard, tuple)
        if shard[0] == "router":
            self.load_router(source)
        elif shard[0] == "expert":
            self.load_expert(source, shard[1], shard[2])
        else:
            self.load_fused(source, W2_DOWN if shard[1] == "w2" else "w13")

    def load_router(self, source: TensorSource) -> None:
        _copy(self.gate.data, source[:], "moe gate")

    def load_expert(self, source: TensorSource, expert: int, which: str) -> None:
        """One expert's ``w1``/``w3`` ([I, H]) or ``w2`` ([H, I]) from the checkpoint."""
        e = expert - self.expert_start
        lo = self.shard_rank * self.inter
        if which == W2_DOWN:
            _copy(self.w2.data[e], source[:, lo : lo + self.inter], "expert w2")
        else:
            row = 0 if which == W1_GATE else self.inter
            _copy(
                self.w13.data[e, row : row + self.inter],
                source[lo : lo + self.inter],
                f"expert {which}",
            )

    def load_fused(self, source: TensorSource, which: str) -> None:
        """All experts at once: ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]."""
        full_inter = self.inter * self.shard_size
        lo = self.shard_rank * self.inter
        experts = slice(self.expert_start, self.expert_start + self.local_experts)
        if which == W2_DOWN:
            _copy(self.w2.data, source[experts, :, lo : lo + self.inter], "experts down_proj")
            return
        gate = source[experts, lo : lo + self.inter]
        up = source[experts, full_inter + lo : full_inter + lo + self.inter]
        _copy(self.w13.data, torch.cat([gate, up], dim=1), "experts gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (every rank of the stage holds all T tokens) -> [T, H]
        if self.ctx.ep_size > 1:
            return self._forward_expert_parallel(x)
        weights, experts = self.ops.route(F.linear(x, self.gate), self.top_k)
        self._count(experts)
        return self.ctx.tp_all_reduce(self.expert_outputs(x, weights, experts))

    def _count(self, experts: torch.Tensor) -> None:
        self.routed += torch.bincount(experts.reshape(-1), minlength=self.num_experts)

    @property
    def counts_all_tokens(self) -> bool:
        """This rank's counters see its share of the tokens exactly once.

        With experts split over ranks each routes its own slice of the tokens;
        otherwise every TP rank routes all of them, and the first one counts.
        """
        return self.ctx.ep_size > 1 or self.ctx.tp_rank == 0

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        group, ep, rank = self.ctx.ep_group, self.ctx.ep_size, self.ctx.ep_rank
        lo, hi = split_evenly(x.shape[0], ep, rank)
        mine = x[lo:hi]  # [t, H]: the tokens this rank routes
        weights, experts = self.ops.route(F.linear(mine, self.gate), self.top_k)  # [t, k]
        self._count(experts)
        pair_token = torch.arange(mine.shape[0], device=x.device).repeat_interleave(self.top_k)
        pair_expert = experts.reshape(-1)
        order = torch.argsort(pair_expert // self.local_experts, stable=True)
        pair_token, pair_expert = pair_token[order], pair_expert[order]
        pair_weight = weights.reshape(-1)[order]
        send_counts = torch.bincount(pair_expert // self.local_experts, minlength=ep)
        recv_counts = torch.empty_like(send_counts)
        with self.ctx.comm.timed(send_counts.numel() * 8):
            dist.all_to_all_single(recv_counts, send_counts, group=group)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        # Dispatch: each (token, expert) pair goes to the rank holding the expert.
        rows = _all_to_all(mine[pair_token], recvs, sends, self.ctx)  # [P_in, H]
        row_expert = _all_to_all(pair_expert, recvs, sends, self.ctx)  # [P_in]
        outputs = torch.empty_like(rows)
        for e in torch.unique(row_expert).tolist():
            idx = torch.where(row_expert == e)[0]
            local = e - self.expert_start
            outputs[idx] = F.linear(
                self.ops.silu_and_mul(F.linear(rows[idx], self.w13[local])), self.w2[local]
            )
        # Combine: outputs return to the rank that routed the token.
        back = _all_to_all(outputs, sends, recvs, self.ctx)  # [P_out, H]
        out = torch.zeros_like(mine)
        out.index_add_(0, pair_token, (back * pair_weight[:, None]).to(out.dtype))
        return _all_gather_rows(out, x.shape[0], ep, self.ctx)

    def expert_outputs(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum over this rank's experts of their SwiGLU outputs, [T, H]."""
        out = torch.zeros_like(x)
        local = experts - self.expert_start
        hit = torch.unique(local[(local >= 0) & (local < self.local_experts)]).tolist()
        for e in hit:
            token_idx, k_pos = torch.where(local == e)
            h = self.ops.silu_and_mul(F.linear(x[token_idx], self.w13[e]))
            y = F.linear(h, self.w2[e]) * weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


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


def expert_load(model: nn.Module, layer_start: int) -> dict[int, list[int]]:
    """Tokens routed per expert since start, per global layer, as this rank counted them.

    Empty on a rank whose counts would repeat another's (a TP rank past the
    first when experts are not split), and for dense models.
    """
    out: dict[int, list[int]] = {}
    for i, layer in enumerate(getattr(model, "layers", ())):
        moe = getattr(layer, "mlp", None)
        if isinstance(moe, SparseMoE) and moe.counts_all_tokens:
            out[layer_start + i] = moe.routed.tolist()
    return out
