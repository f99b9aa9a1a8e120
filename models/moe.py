"""Sparse mixture-of-experts MLP (Mixtral): top-k routing over SwiGLU experts.

Routing matches the reference (:func:`pdserve.kernels.reference.route`):
softmax over the router logits in float32, keep the top ``k``, renormalise
their weights to sum to one.

- ``ep == 1``: every rank holds every expert with its intermediate dimension
  split over the TP ranks; partial outputs are summed by an all-reduce.
- ``ep > 1``: each rank holds ``S`` whole-expert *slots*, which a
  :class:`~pdserve.models.eplb.Placement` maps to logical experts (without
  EPLB rank ``r`` holds experts ``[r * S, (r + 1) * S)``; with redundant
  experts a hot expert has several slots). The all-to-all dispatch and combine
  run in :mod:`pdserve.models.moe_ep`.

Weights per rank: ``w13 [S, 2 * I_local, H]`` (gate rows, then up rows),
``w2 [S, H, I_local]``, ``gate [E, H]`` (replicated); ``I_local = I / tp``
when ``ep == 1``, else ``I``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.model_config import ModelConfig
from pdserve.distributed.context import ParallelContext
from pdserve.kernels import KernelOps, reference_kernels
from pdserve.models.eplb import Placement, static_placement
from pdserve.models.layers import TensorSource, _copy
from pdserve.models.moe_ep import expert_parallel_forward

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
        self.hidden_size = hidden_size
        self.inter = intermediate_size // self.shard_size
        self.gate = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False
        )
        # Tokens this rank routed to each expert since start, counted on the device
        # and read out only when someone asks (see ``expert_load``).
        self.routed = torch.zeros(num_experts, dtype=torch.int64, device=self.gate.device)
        # ``routed`` when the experts were last placed (the window EPLB places by).
        self.routed_at_placement = self.routed.clone()
        # Rows this rank's expert slots computed since start (EP): with replicas a
        # rank's work is not the sum of its experts' routed tokens.
        self.rows_computed = torch.zeros((), dtype=torch.int64, device=self.gate.device)
        self.set_placement(static_placement(num_experts, 0, ctx.ep_size))

    @classmethod
    def of_model(
        cls, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, ops: KernelOps | None
    ) -> SparseMoE:
        """The MoE block of ``config``'s layers on this rank."""
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            ctx,
            dtype,
            ops,
        )

    def set_placement(self, placement: Placement) -> list[int]:
        """Hold ``placement``'s slots of this rank; return the local slots whose expert
        changed (their weights are NaN until loaded, see ``parallel/expert_slots.py``)."""
        placement.check(self.num_experts)
        if placement.ep != self.ctx.ep_size:
            raise ValueError(
                f"placement over {placement.ep} ranks, this stage has {self.ctx.ep_size}"
            )
        old = getattr(self, "local_slots", ())
        self.placement = placement
        self.local_slots = placement.rank_slots(self.ctx.ep_rank)
        # What a routing rank needs: each expert's replicas (slots), padded with the first.
        replicas = placement.replicas
        width = max(len(v) for v in replicas.values())
        table = [
            replicas[e] + [replicas[e][0]] * (width - len(replicas[e]))
            for e in range(self.num_experts)
        ]
        device = self.gate.device
        self.replica_slots = torch.tensor(table, dtype=torch.int64, device=device)  # [E, R]
        self.replica_count = torch.tensor(
            [len(replicas[e]) for e in range(self.num_experts)], device=device
        )
        # Rows each local slot computed since its expert was placed there.
        self.computed = torch.zeros(len(self.local_slots), dtype=torch.int64, device=device)
        if len(old) != len(self.local_slots):
            self._allocate_slots(len(self.local_slots))
            return list(range(len(self.local_slots)))
        changed = [i for i, (a, b) in enumerate(zip(old, self.local_slots, strict=True)) if a != b]
        self.w13.data[changed] = float("nan")
        self.w2.data[changed] = float("nan")
        return changed

    def _allocate_slots(self, n: int) -> None:
        dtype, device, h = self.gate.dtype, self.gate.device, self.hidden_size
        self.w13 = nn.Parameter(
            torch.full((n, 2 * self.inter, h), float("nan"), dtype=dtype, device=device),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.full((n, h, self.inter), float("nan"), dtype=dtype, device=device),
            requires_grad=False,
        )

    @property
    def local_experts(self) -> int:
        """Slots on this rank."""
        return len(self.local_slots)

    def owns(self, expert: int) -> bool:
        return expert in self.local_slots

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

    def load_expert(
        self, source: TensorSource, expert: int, which: str, only: set[int] | None = None
    ) -> None:
        """One expert's ``w1``/``w3`` ([I, H]) or ``w2`` ([H, I]) into every local slot
        holding it (those in ``only`` when given)."""
        lo = self.shard_rank * self.inter
        slots = [i for i, e in enumerate(self.local_slots) if e == expert]
        if only is not None:
            slots = [i for i in slots if i in only]
        if not slots:
            return
        if which == W2_DOWN:
            tensor = source[:, lo : lo + self.inter]
        else:
            tensor = source[lo : lo + self.inter]
        row = 0 if which == W1_GATE else self.inter
        for i in slots:
            if which == W2_DOWN:
                _copy(self.w2.data[i], tensor, "expert w2")
            else:
                _copy(self.w13.data[i, row : row + self.inter], tensor, f"expert {which}")

    def load_fused(self, source: TensorSource, which: str, only: set[int] | None = None) -> None:
        """Every local slot from ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]."""
        full_inter = self.inter * self.shard_size
        lo = self.shard_rank * self.inter
        for i, e in enumerate(self.local_slots):
            if only is not None and i not in only:
                continue
            if which == W2_DOWN:
                _copy(self.w2.data[i], source[e : e + 1, :, lo : lo + self.inter][0], "down_proj")
                continue
            gate = source[e : e + 1, lo : lo + self.inter][0]
            up = source[e : e + 1, full_inter + lo : full_inter + lo + self.inter][0]
            _copy(self.w13.data[i], torch.cat([gate, up]), "experts gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (every rank of the stage holds all T tokens) -> [T, H]
        if self.ctx.ep_size > 1:
            return expert_parallel_forward(self, x)
        weights, experts = self.ops.route(F.linear(x, self.gate), self.top_k)
        self.count(experts)
        return self.ctx.tp_all_reduce(self.expert_outputs(x, weights, experts))

    def count(self, experts: torch.Tensor) -> None:
        """Add the tokens routed to each expert (``experts``: each token's picks) to ``routed``."""
        self.routed += torch.bincount(experts.reshape(-1), minlength=self.num_experts)

    @property
    def counts_all_tokens(self) -> bool:
        """This rank's counters see its share of the tokens exactly once.

        With experts split over ranks each routes its own slice of the tokens;
        otherwise every TP rank routes all of them, and the first one counts.
        """
        return self.ctx.ep_size > 1 or self.ctx.tp_rank == 0

    def expert_outputs(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum over this rank's experts of their SwiGLU outputs, [T, H]."""
        out = torch.zeros_like(x)
        local = experts  # with ep == 1 every expert is local, in order
        hit = torch.unique(local[(local >= 0) & (local < self.local_experts)]).tolist()
        for e in hit:
            token_idx, k_pos = torch.where(local == e)
            h = self.ops.silu_and_mul(F.linear(x[token_idx], self.w13[e]))
            y = F.linear(h, self.w2[e]) * weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def expert_rows(model: nn.Module, layer_start: int) -> dict[int, int]:
    """Rows this rank's expert slots computed since start, per global layer (EP only)."""
    out: dict[int, int] = {}
    for i, layer in enumerate(getattr(model, "layers", ())):
        moe = getattr(layer, "mlp", None)
        if isinstance(moe, SparseMoE) and moe.ctx.ep_size > 1:
            out[layer_start + i] = int(moe.rows_computed.item())
    return out


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
