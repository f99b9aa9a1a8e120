"""The decoder-only transformer behind every supported family.

Llama, Mistral and Qwen2 differ only in q/k/v bias; Mixtral swaps the dense MLP
for :class:`~pdserve.models.moe.SparseMoE`. One pipeline stage holds layers
``[layer_start, layer_end)``, the embedding if it is the first stage, and the
final norm and LM head if it is the last.

Tensors cross this module flat over the step's tokens: ``input_ids [T]``,
``positions [T]``, hidden states ``[T, hidden]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from pdserve.core.model_config import ModelConfig
from pdserve.distributed.context import ParallelContext
from pdserve.kernels import KernelOps, reference_kernels
from pdserve.kernels.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdserve.models.lora import LoRABatch
from pdserve.models.moe import SparseMoE
from pdserve.models.rotary import RotaryEmbedding

# (cache_k, cache_v) of one layer, each [num_blocks, block_size, Hkv_local, D].
LayerCache = tuple[torch.Tensor, torch.Tensor]
# RoPE (cos, sin) at the step's positions, each [T, 1, D / 2]; shared by all layers.
RopeTables = tuple[torch.Tensor, torch.Tensor]

# The step's hot path (a layer and its attention, norms, MLP and linears) calls
# submodules through bound ``forward`` methods kept as plain attributes (``_qkv``,
# ``_attn``...): nothing here registers hooks, and ``nn.Module.__call__`` with the
# ``Module.__getattr__`` lookup of a submodule costs about 1 us a call, 75 calls a
# decode step. Modules are never swapped after construction (loading, packing,
# quantizing and LoRA change them in place), so the bound methods stay current.


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        dtype: torch.dtype,
        backend_cls: type[AttentionBackend],
        ops: KernelOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        d = config.head_dim
        self.qkv = QKVParallelLinear(
            config.hidden_size,
            d,
            config.num_heads,
            config.num_kv_heads,
            config.attention_bias,
            ctx,
            dtype,
        )
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, False, ctx, dtype)
        # This rank's head shape, kept as plain ints: read every layer and step.
        self.num_heads = self.qkv.num_heads
        self.num_kv_heads = self.qkv.num_kv_heads
        self.head_dim = d
        self.backend = backend_cls(self.num_heads, self.num_kv_heads, d, d**-0.5)
        self._qkv, self._o_proj = self.qkv.forward, self.o_proj.forward
        # A backend may rotate q and k inside its decode call (one native call, not
        # two). Only under the C ops, whose RoPE that is: other ops keep being called.
        self._fuse_rope = ops.name == "cpu"
        self._attend_rope = self.backend.forward_rope

    def forward(
        self,
        rope: RopeTables,
        x: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        qkv = self._qkv(x, lora)  # [T, (Hq + 2 * Hkv) * D]
        if self._fuse_rope:
            o = self._attend_rope(qkv, rope[0], rope[1], cache[0], cache[1], meta)
            if o is not None:
                return self._o_proj(o, lora)
        t = x.shape[0]
        nq, nkv = self.num_heads, self.num_kv_heads
        qkv = qkv.view(t, nq + 2 * nkv, self.head_dim)
        # q and k sit side by side in the fused output: rotate both in one go.
        qk, v = torch.split_with_sizes(qkv, [nq + nkv, nkv], 1)
        q, k = torch.split_with_sizes(self.ops.rotate(qk, *rope), [nq, nkv], 1)
        o = self.backend.forward(q, k, v, cache[0], cache[1], meta)
        return self._o_proj(o.reshape(t, -1), lora)


class DenseMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, ops: KernelOps
    ) -> None:
        super().__init__()
        self.ops = ops
        inter = config.intermediate_size
        self.gate_up = ColumnParallelLinear(config.hidden_size, [inter, inter], False, ctx, dtype)
        self.down = RowParallelLinear(inter, config.hidden_size, False, ctx, dtype)
        self._gate_up, self._down = self.gate_up.forward, self.down.forward

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        return self._down(self.ops.silu_and_mul(self._gate_up(x, lora)), lora)


class RemoteExperts(nn.Module):
    """Where a MoE layer's experts sit on an afd attention rank: on other ranks.

    The layer's post-attention hidden states go to the expert group and its
    combined output comes back (:mod:`pdserve.parallel.afd`); nothing runs here.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer's experts run on the afd expert ranks")


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        dtype: torch.dtype,
        backend_cls: type[AttentionBackend],
        ops: KernelOps,
        remote_experts: bool = False,
    ) -> None:
        """``remote_experts``: the MoE experts run on other ranks (afd attention rank)."""
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.attn = Attention(config, ctx, dtype, backend_cls, ops)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.mlp: nn.Module
        if config.is_moe and remote_experts:
            self.mlp = RemoteExperts()
        elif config.is_moe:
            self.mlp = SparseMoE.of_model(config, ctx, dtype, ops)
        else:
            self.mlp = DenseMLP(config, ctx, dtype, ops)
        self._input_norm, self._attn = self.input_norm.forward, self.attn.forward
        self._post_attn_norm = self.post_attn_norm.forward
        self._mlp: Callable[..., torch.Tensor] = self.mlp.forward
        self._mlp_takes_lora = isinstance(self.mlp, DenseMLP)  # MoE experts take no adapters

    def forward(
        self,
        rope: RopeTables,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LayerCache,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attention_part(rope, hidden, residual, cache, meta, lora)
        if self._mlp_takes_lora:
            return self._mlp(h, lora), residual
        return self._mlp(h), residual

    def attention_part(
        self,
        rope: RopeTables,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LayerCache,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, attention, norm: the MLP's input ``[T, hidden]`` and the residual."""
        h, residual = self._input_norm(hidden, residual)
        h = self._attn(rope, h, cache, meta, lora)
        return self._post_attn_norm(h, residual)


class CausalLM(nn.Module):
    """One pipeline stage of a causal language model."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        dtype: torch.dtype,
        layer_range: tuple[int, int],
        backend_cls: type[AttentionBackend],
        ops: KernelOps | None = None,
        remote_experts: bool = False,
    ) -> None:
        """``remote_experts``: an afd attention rank's model, the experts elsewhere."""
        super().__init__()
        self.config = config
        self.ctx = ctx
        ops = ops or reference_kernels()
        self.layer_start, self.layer_end = layer_range
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        self.embed = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, dtype)
            if ctx.is_first_stage
            else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, ctx, dtype, backend_cls, ops, remote_experts)
            for _ in range(self.layer_start, self.layer_end)
        )
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if ctx.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[LayerCache],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        on_layer: Callable[[int], None] | None = None,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """First stage embeds ``input_ids``; later stages continue from ``hidden``.

        ``lora`` says which rows run under which LoRA adapter (None: all base).

        ``on_layer(i)`` runs after local layer ``i`` wrote its KV (the transfer
        layer streams that layer's pages while the next layer computes).

        Returns ``(hidden, residual)`` to send to the next stage, or on the last
        stage ``(normed hidden, None)``.
        """
        if self.embed is not None:
            hidden, residual = self.embed(input_ids), None
        assert hidden is not None
        rope = self.rotary.tables(positions, hidden.dtype)
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            hidden, residual = layer.forward(rope, hidden, residual, cache, meta, lora)
            if on_layer is not None:
                on_layer(i)
        if self.norm is not None:
            hidden, _ = self.norm(hidden, residual)
            return hidden, None
        assert residual is not None
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab] float32
        assert self.lm_head is not None, "logits are computed on the last pipeline stage"
        return self.lm_head.compute_logits(hidden).float()

    # -- checkpoint names -> (module, shard) ----------------------------------

    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
    EXPERT_WEIGHT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")

    def weight_targets(self, name: str) -> list[tuple[nn.Module, object, bool]]:
        """Where checkpoint tensor ``name`` goes on this rank: (module, shard, is_bias)."""
        if name == "model.embed_tokens.weight":
            targets: list[tuple[nn.Module, object, bool]] = []
            if self.embed is not None:
                targets.append((self.embed, 0, False))
            if self.lm_head is not None and self.config.tie_word_embeddings:
                targets.append((self.lm_head, 0, False))
            return targets
        if name == "lm_head.weight":
            if self.lm_head is None or self.config.tie_word_embeddings:
                return []
            return [(self.lm_head, 0, False)]
        if name == "model.norm.weight":
            return [] if self.norm is None else [(self.norm, 0, False)]
        m = self._LAYER.fullmatch(name)
        if m is None:
            return []
        index = int(m.group(1))
        if not self.layer_start <= index < self.layer_end:
            return []
        layer = self.layers[index - self.layer_start]
        assert isinstance(layer, DecoderLayer)
        return _layer_target(layer, m.group(2))


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _layer_target(layer: DecoderLayer, rest: str) -> list[tuple[nn.Module, object, bool]]:
    parts = rest.split(".")
    kind = parts[-1]
    is_bias = kind == "bias"
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        norm = layer.input_norm if rest.startswith("input") else layer.post_attn_norm
        return [(norm, 0, False)]
    if parts[0] == "self_attn":
        if parts[1] in _QKV:
            return [(layer.attn.qkv, _QKV[parts[1]], is_bias)]
        if parts[1] == "o_proj":
            return [(layer.attn.o_proj, 0, is_bias)]
    mlp = layer.mlp
    if isinstance(mlp, DenseMLP) and parts[0] == "mlp":
        if parts[1] in ("gate_proj", "up_proj"):
            return [(mlp.gate_up, 0 if parts[1] == "gate_proj" else 1, is_bias)]
        if parts[1] == "down_proj":
            return [(mlp.down, 0, is_bias)]
    if isinstance(mlp, SparseMoE):
        return _moe_target(mlp, rest)
    return []


def _moe_target(moe: SparseMoE, rest: str) -> list[tuple[nn.Module, object, bool]]:
    if rest in ("block_sparse_moe.gate.weight", "mlp.gate.weight"):
        return [(moe, ("router",), False)]
    m = CausalLM.EXPERT_WEIGHT.fullmatch(rest)
    if m is not None:
        expert = int(m.group(1))
        return [(moe, ("expert", expert, m.group(2)), False)] if moe.owns(expert) else []
    if rest == "mlp.experts.gate_up_proj":
        return [(moe, ("fused", "w13"), False)]
    if rest == "mlp.experts.down_proj":
        return [(moe, ("fused", "w2"), False)]
    return []
