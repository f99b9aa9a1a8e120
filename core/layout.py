"""Where each rank of an instance sits, and which layouts a model can take.

An instance has ``pp`` pipeline stages of ``R`` ranks each, ``R = max(tp, ep)``::

    global rank = stage * R + r            (r = 0 .. R-1 inside the stage)
    TP groups   = ranks [k*tp, (k+1)*tp) of each stage, k = 0 .. R/tp - 1
    EP group    = all R ranks of a stage (when ep > 1)
    PP peers    = rank r of stage s sends hidden states to rank r of stage s+1

Expert parallelism shares ranks with tensor parallelism ("EP within the TP
group"): with ``ep == tp`` the attention is split by heads over the stage's
ranks and the experts are split over the same ranks, each expert whole on one
rank. With ``ep > tp`` (e.g. EP=2, TP=1) every TP group computes the attention
of all tokens (replicated) and only the experts are split: EP then buys memory
for experts, not attention speed. With ``ep == 1`` each expert's intermediate
dimension is split over the TP ranks instead. Other mixes are refused.

With attention-FFN disaggregation (``afd``, MoE models only) the instance has
``A + F`` ranks: ranks ``[0, A)`` are the attention group (the attention split
by heads over them, TP ``A``, with the KV cache, embeddings, norms and LM head)
and ranks ``[A, A + F)`` the expert group (whole experts split over them);
there is one stage and no other TP or EP group::

    attention group  = ranks 0 .. A-1       (tp = A, rank 0 leads)
    expert group     = ranks A .. A+F-1     (ep = F, expert rank = rank - A)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.core.config import ParallelConfig
from pdserve.core.errors import InvalidArgumentError


class ModelLayoutShape(Protocol):
    """What a layout check reads of a model: a checkpoint's ``ModelConfig``, or the
    ``ModelShape`` the simulator's analytic profiles are built from."""

    @property
    def architecture(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def is_moe(self) -> bool: ...


@dataclass(frozen=True)
class RankCoords:
    """One rank's place in the instance layout."""

    rank: int
    stage: int
    r: int  # index inside the stage
    tp_rank: int
    ep_rank: int


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    stage_layers: tuple[tuple[int, int], ...]  # [start, end) of each stage
    afd_experts: int = 0  # ranks of the expert group with afd (0: no afd)

    @property
    def ranks_per_stage(self) -> int:
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.ranks_per_stage * self.pp + self.afd_experts

    def is_expert_rank(self, rank: int) -> bool:
        """An afd expert-group rank (holds experts only, no KV cache)."""
        return self.afd_experts > 0 and rank >= self.tp

    def expert_ranks(self) -> list[int]:
        return list(range(self.tp, self.tp + self.afd_experts))

    def coords(self, rank: int) -> RankCoords:
        if self.is_expert_rank(rank):
            return RankCoords(rank, 0, rank, 0, rank - self.tp)
        stage, r = divmod(rank, self.ranks_per_stage)
        return RankCoords(rank, stage, r, r % self.tp, r if self.ep > 1 else 0)

    def tp_groups(self) -> list[list[int]]:
        rps = self.ranks_per_stage
        return [
            [s * rps + k * self.tp + i for i in range(self.tp)]
            for s in range(self.pp)
            for k in range(rps // self.tp)
        ]

    def stage_groups(self) -> list[list[int]]:
        rps = self.ranks_per_stage
        return [[s * rps + i for i in range(rps)] for s in range(self.pp)]

    def describe(self) -> str:
        if self.afd_experts:
            return f"afd attention={self.tp} experts={self.afd_experts} ({self.world_size} ranks)"
        return f"tp={self.tp} pp={self.pp} ep={self.ep} ({self.world_size} ranks)"


def plan_layout(model: ModelLayoutShape, parallel: ParallelConfig) -> Layout:
    """Check that ``model`` can take the layout; raise naming the reason if not."""
    if parallel.afd:
        return _plan_afd(model, parallel)
    tp, pp, ep = (
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.expert_parallel_size,
    )
    if model.num_heads % tp:
        raise InvalidArgumentError(
            "tensor_parallel_size",
            f"{tp} does not divide the model's {model.num_heads} attention heads",
        )
    if model.num_kv_heads >= tp and model.num_kv_heads % tp:
        raise InvalidArgumentError(
            "tensor_parallel_size",
            f"{tp} does not divide the model's {model.num_kv_heads} KV heads",
        )
    if model.num_kv_heads < tp and tp % model.num_kv_heads:
        raise InvalidArgumentError(
            "tensor_parallel_size",
            f"{tp} is not a multiple of the model's {model.num_kv_heads} KV heads "
            "(needed to replicate them)",
        )
    if pp > model.num_layers:
        raise InvalidArgumentError(
            "pipeline_parallel_size", f"{pp} stages for a model of {model.num_layers} layers"
        )
    _check_experts(model, tp, ep)
    if ep > 1 and parallel.redundant_experts:
        slots_per_rank(model.num_experts, parallel.redundant_experts, ep)
    if not model.is_moe and model.intermediate_size % tp:
        raise InvalidArgumentError(
            "tensor_parallel_size",
            f"{tp} does not divide intermediate_size={model.intermediate_size}",
        )
    return Layout(tp, pp, ep, _stage_layers(model.num_layers, pp, parallel.pipeline_layers))


def _plan_afd(model: ModelLayoutShape, parallel: ParallelConfig) -> Layout:
    """Attention on ``afd_attention_ranks``, experts on ``afd_expert_ranks`` (one stage)."""
    if not model.is_moe:
        raise InvalidArgumentError(
            "afd", f"the model ({model.architecture}) has no experts to put on other ranks"
        )
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
        if getattr(parallel, name) != 1:
            raise InvalidArgumentError(
                name,
                f"{getattr(parallel, name)} with afd: set afd_attention_ranks and "
                "afd_expert_ranks instead (one stage)",
            )
    if parallel.redundant_experts:
        raise InvalidArgumentError("redundant_experts", "is not supported with afd")
    a, f = parallel.afd_attention_ranks, parallel.afd_expert_ranks
    if model.num_heads % a or (
        model.num_kv_heads % a if model.num_kv_heads >= a else a % model.num_kv_heads
    ):
        raise InvalidArgumentError(
            "afd_attention_ranks",
            f"{a} does not split the model's {model.num_heads} attention heads and "
            f"{model.num_kv_heads} KV heads evenly",
        )
    if model.num_experts % f:
        raise InvalidArgumentError(
            "afd_expert_ranks", f"{f} does not divide the model's {model.num_experts} experts"
        )
    return Layout(a, 1, 1, ((0, model.num_layers),), afd_experts=f)


def _check_experts(model: ModelLayoutShape, tp: int, ep: int) -> None:
    if ep == 1:
        if model.is_moe and model.intermediate_size % tp:
            raise InvalidArgumentError(
                "tensor_parallel_size",
                f"{tp} does not divide the experts' intermediate_size={model.intermediate_size}",
            )
        return
    if not model.is_moe:
        raise InvalidArgumentError(
            "expert_parallel_size", f"{ep}: the model ({model.architecture}) has no experts"
        )
    if model.num_experts % ep:
        raise InvalidArgumentError(
            "expert_parallel_size", f"{ep} does not divide the model's {model.num_experts} experts"
        )
    if ep < tp or ep % tp:
        raise InvalidArgumentError(
            "expert_parallel_size",
            f"{ep} with tensor_parallel_size={tp}: experts are split over the stage's ranks, "
            "so ep must equal tp or be a multiple of it",
        )


def _stage_layers(
    num_layers: int, pp: int, custom: tuple[int, ...] | None
) -> tuple[tuple[int, int], ...]:
    if custom is not None:
        if sum(custom) != num_layers:
            raise InvalidArgumentError(
                "pipeline_layers",
                f"{list(custom)} sums to {sum(custom)}, the model has {num_layers}",
            )
        sizes = list(custom)
    else:
        base, extra = divmod(num_layers, pp)
        # Later stages also run the LM head: give the extra layers to the first ones.
        sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return tuple(bounds)


def slots_per_rank(num_experts: int, redundant: int, ep: int) -> int:
    """Slots each rank holds; raise naming ``redundant_experts`` if the layout cannot be."""
    if redundant < 0:
        raise InvalidArgumentError("redundant_experts", "must be >= 0")
    if redundant > num_experts * (ep - 1):
        raise InvalidArgumentError(
            "redundant_experts",
            f"{redundant} replicas for {num_experts} experts over {ep} ranks: at most "
            f"{num_experts * (ep - 1)} (every expert on every rank)",
        )
    if (num_experts + redundant) % ep:
        raise InvalidArgumentError(
            "redundant_experts",
            f"{num_experts} experts + {redundant} redundant = {num_experts + redundant} slots "
            f"do not split evenly over expert_parallel_size={ep}",
        )
    return (num_experts + redundant) // ep


def check_fits(needs: dict[str, float], cluster: dict[str, float], field: str = "regions") -> None:
    """Refuse a layout the cluster's CPUs or GPUs cannot hold (``cluster``: Ray's totals);
    the error names ``field``, the option that sized the layout."""
    hints = {
        "CPU": "lower the instance counts or parallel sizes, or num_cpus_per_rank "
        "(fractional values such as 0.5 share a CPU between ranks)",
        "GPU": "lower the instance counts, parallel sizes or num_gpus_per_rank, or add GPU nodes",
    }
    for key, hint in hints.items():
        need, have = needs.get(key, 0.0), cluster.get(key, 0.0)
        if need > have + 1e-9:
            word = key if need == 1 else f"{key}s"
            raise InvalidArgumentError(
                field, f"this layout needs {need:g} {word}, the cluster has {have:g}: {hint}"
            )
