"""What an afd expert rank holds: each MoE layer's router and this rank's experts.

On an attention-FFN disaggregated instance (``parallel/afd.py``) the expert
ranks hold no attention, embedding, norm, LM head or KV cache: only one
:class:`~pdserve.models.moe.SparseMoE` per layer, with the experts split over
the expert group (rank ``j`` of ``F`` holds experts ``[j * E / F, (j + 1) * E / F)``)
and the router replicated. It loads from the same checkpoint names as the
full model and is a :class:`CausalLM` only so a :class:`ModelRunner` can hold
it; its ``forward`` is never called (the expert loop drives the layers).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.core.model_config import ModelConfig
from pdserve.distributed.context import ParallelContext
from pdserve.kernels import KernelOps
from pdserve.models.moe import SparseMoE
from pdserve.models.transformer import CausalLM, _moe_target


class ExpertLayer(nn.Module):
    """One layer's experts, as ``mlp`` (where :func:`expert_load` looks for them)."""

    def __init__(self, moe: SparseMoE) -> None:
        super().__init__()
        self.mlp = moe


class ExpertStack(CausalLM):
    """An afd expert rank's model: layers ``[start, end)``, experts only."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        dtype: torch.dtype,
        layer_range: tuple[int, int],
        ops: KernelOps,
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.ctx = ctx
        self.layer_start, self.layer_end = layer_range
        self.embed = None
        self.norm = None
        self.lm_head = None
        self.layers = nn.ModuleList(
            ExpertLayer(SparseMoE.of_model(config, ctx, dtype, ops))
            for _ in range(self.layer_start, self.layer_end)
        )

    def moe(self, local_layer: int) -> SparseMoE:
        layer = self.layers[local_layer]
        assert isinstance(layer, ExpertLayer)
        return layer.mlp

    def forward(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        raise RuntimeError("an afd expert rank runs its layers from the expert loop")

    def weight_targets(self, name: str) -> list[tuple[nn.Module, object, bool]]:
        m = self._LAYER.fullmatch(name)
        if m is None:
            return []
        index = int(m.group(1))
        if not self.layer_start <= index < self.layer_end:
            return []
        return _moe_target(self.moe(index - self.layer_start), m.group(2))
