"""Sparse mixture-of-experts MLP (Mixtral): top-k routing over SwiGLU experts.

Routing matches the reference: softmax over the router logits in float32, keep
the top ``k``, renormalise their weights to sum to one. This rank holds the
experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``; within each expert the
intermediate dimension is split over the TP ranks. Partial outputs (other
experts, other intermediate slices) are summed by an all-reduce over the ranks
that share the tokens.

Weights per rank: ``w13 [E_local, 2 * I / tp, H]`` (gate rows, then up rows),
``w2 [E_local, H, I / tp]``, ``gate [E, H]`` (replicated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.parallel.context import ParallelContext
from pdserve.parallel.layers import TensorSource, _copy, silu_and_mul

# Which checkpoint matrix of an expert a shard id names.
W1_GATE, W3_UP, W2_DOWN = "w1", "w3", "w2"


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> ([T, k] float32 weights summing to 1, [T, k] expert ids)."""
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if num_experts % ctx.ep_size:
            raise ValueError(
                f"num_local_experts={num_experts} is not divisible by ep={ctx.ep_size}"
            )
        if intermediate_size % ctx.tp_size:
            raise ValueError(
                f"intermediate_size={intermediate_size} is not divisible by tp={ctx.tp_size}"
            )
        self.ctx = ctx
        self.num_experts = num_experts
        self.top_k = top_k
        self.local_experts = num_experts // ctx.ep_size
        self.expert_start = ctx.ep_rank * self.local_experts
        self.inter = intermediate_size // ctx.tp_size
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
        lo = self.ctx.tp_rank * self.inter
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
        full_inter = self.inter * self.ctx.tp_size
        lo = self.ctx.tp_rank * self.inter
        experts = slice(self.expert_start, self.expert_start + self.local_experts)
        if which == W2_DOWN:
            _copy(self.w2.data, source[experts, :, lo : lo + self.inter], "experts down_proj")
            return
        gate = source[experts, lo : lo + self.inter]
        up = source[experts, full_inter + lo : full_inter + lo + self.inter]
        _copy(self.w13.data, torch.cat([gate, up], dim=1), "experts gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (every rank of the group holds all T tokens) -> [T, H]
        weights, experts = route(F.linear(x, self.gate), self.top_k)
        out = self.expert_outputs(x, weights, experts)
        if self.ctx.tp_size > 1 or self.ctx.ep_size > 1:
            self.ctx.tp_all_reduce(out)
        return out

    def expert_outputs(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum over this rank's experts of their SwiGLU outputs, [T, H]."""
        out = torch.zeros_like(x)
        local = experts - self.expert_start
        hit = torch.unique(local[(local >= 0) & (local < self.local_experts)]).tolist()
        for e in hit:
            token_idx, k_pos = torch.where(local == e)
            h = silu_and_mul(F.linear(x[token_idx], self.w13[e]))
            y = F.linear(h, self.w2[e]) * weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out
