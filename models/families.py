"""Model families, by the family name :class:`~pdserve.core.model_config.ModelConfig` reads."""

from __future__ import annotations

import torch

from pdserve.core.model_config import ModelConfig
from pdserve.distributed.context import ParallelContext
from pdserve.kernels import KernelOps
from pdserve.kernels.attention.backend import AttentionBackend
from pdserve.models.transformer import CausalLM

# Every supported family is the same decoder with family-specific options
# (q/k/v bias for Qwen2, sparse MoE for Mixtral) read from the config.
MODEL_FAMILIES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "qwen2": CausalLM,
    "mixtral": CausalLM,
}


def build_model(
    config: ModelConfig,
    ctx: ParallelContext,
    dtype: torch.dtype,
    layer_range: tuple[int, int],
    backend_cls: type[AttentionBackend],
    ops: KernelOps | None = None,
    remote_experts: bool = False,
) -> CausalLM:
    """One pipeline stage of ``config``'s model; ``ops`` (default: torch) run its fused layers.

    ``remote_experts``: leave the MoE experts out (they run on afd expert ranks)."""
    family = MODEL_FAMILIES[config.family]
    return family(config, ctx, dtype, layer_range, backend_cls, ops, remote_experts)


__all__ = ["MODEL_FAMILIES", "CausalLM", "build_model"]
