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
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.config import ParallelConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig


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

    @property
    def ranks_per_stage(self) -> int:
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.ranks_per_stage * self.pp

    def coords(self, rank: int) -> RankCoords:
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
        return f"tp={self.tp} pp={self.pp} ep={self.ep} ({self.world_size} ranks)"


def plan_layout(model: ModelConfig, parallel: ParallelConfig) -> Layout:
    """Check that ``model`` can take the layout; raise naming the reason if not."""
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


def _check_experts(model: ModelConfig, tp: int, ep: int) -> None:
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
