"""Layers that can be split over tensor-parallel ranks, and how each loads its slice.

Each sharded layer owns the rule for which part of a checkpoint tensor belongs to
this rank, and reads only that part from a :class:`TensorSource` (a safetensors
slice, read lazily). Shapes below are per rank; ``tp`` is the TP size.

    ColumnParallelLinear  W: [sum(out_i / tp), in]   output split; no collective
    QKVParallelLinear     W: [(Hq + 2*Hkv_local) * D, in]   KV heads replicated if Hkv < tp
    RowParallelLinear     W: [out, in / tp]           input split; all-reduce after
    VocabParallelEmbedding  [ceil(V / tp), hidden]    masked lookup; all-reduce after
    ParallelLMHead          [ceil(V / tp), hidden]    all-gather of the logits

The column and row layers may carry LoRA adapters (``lora``, see ``lora.py``):
their delta is added to the base output, before the row layer's all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.context import ParallelContext, split_evenly
from pdserve.kernels import KernelOps, reference_kernels
from pdserve.kernels.cpu_linear import PackedWeight, packed_linear
from pdserve.models.lora import LinearLoRA, LoRABatch
from pdserve.models.quant import QuantizedWeight


class TensorSource(Protocol):
    """A checkpoint tensor that can be read in parts (``source[a:b]``, ``source[:, a:b]``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: object) -> torch.Tensor: ...


class _Linear(nn.Module):
    """Weight holder shared by the column and row layers; may be packed or quantized."""

    weight: nn.Parameter
    packed: PackedWeight | None = None
    quantized: QuantizedWeight | None = None
    lora: LinearLoRA | None = None

    def pack(self, reorder: Callable[[torch.Tensor], PackedWeight]) -> None:
        """Replace the weight by a matmul-ready copy (see ``cpu_linear``); loading ends here."""
        self.packed = reorder(self.weight.data)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def quantize(self, make: Callable[[torch.Tensor], QuantizedWeight]) -> None:
        """Replace the weight by integers and scales (see ``quant``); loading ends here."""
        self.quantized = make(self.weight.data)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def held_tensors(self) -> tuple[torch.Tensor, ...]:
        """The weight's packed or quantized copy and LoRA adapters, held outside ``parameters()``."""
        adapters = () if self.lora is None else self.lora.tensors
        if self.quantized is not None:
            return self.quantized.tensors + adapters
        return adapters if self.packed is None else (*self.packed.tensors, *adapters)

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, lora: LoRABatch | None = None
    ) -> torch.Tensor:
        """The base linear (dense, packed or quantized), plus the rows' LoRA deltas."""
        if self.quantized is not None:
            y = self.quantized.linear(x, bias)
        elif self.packed is not None:
            y = packed_linear(x, self.packed, bias)
        else:
            y = F.linear(x, self.weight, bias)
        if lora is not None and self.lora is not None:
            y = self.lora.add(x, y, lora)
        return y


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint slice {tuple(src.shape)} != param {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(_Linear):
    """``y = x W^T + b`` with the output split across TP ranks.

    ``output_sizes`` lists the logical matrices fused into this one (e.g. gate and
    up projections); each is split on its own so rank r holds slice r of each.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        for size in output_sizes:
            if size % ctx.tp_size:
                raise ValueError(f"output size {size} is not divisible by tp={ctx.tp_size}")
        self.ctx = ctx
        self.local_sizes = [s // ctx.tp_size for s in output_sizes]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        )

    def shard_rows(self, shard: int) -> tuple[int, int, int]:
        """(first source row, rows, first param row) of logical matrix ``shard``."""
        local = self.local_sizes[shard]
        return self.ctx.tp_rank * local, local, sum(self.local_sizes[:shard])

    def load(self, source: TensorSource, shard: int = 0, is_bias: bool = False) -> None:
        src_start, rows, dst_start = self.shard_rows(shard)
        param = self.bias if is_bias else self.weight
        assert param is not None
        _copy(
            param.data[dst_start : dst_start + rows], source[src_start : src_start + rows], "column"
        )

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        return self.matmul(x, self.bias, lora)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads; KV heads replicated when Hkv < tp."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        tp = ctx.tp_size
        if num_heads % tp:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by tp={tp}")
        if num_kv_heads >= tp and num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by tp={tp}")
        if num_kv_heads < tp and tp % num_kv_heads:
            raise ValueError(f"tp={tp} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.total_kv_heads = num_kv_heads
        kv_out = self.num_kv_heads * head_dim * tp
        super().__init__(hidden_size, [num_heads * head_dim, kv_out, kv_out], bias, ctx, dtype)

    @property
    def kv_head_start(self) -> int:
        """First global KV head this rank holds."""
        tp, r = self.ctx.tp_size, self.ctx.tp_rank
        if self.total_kv_heads >= tp:
            return r * self.num_kv_heads
        return r * self.total_kv_heads // tp

    def shard_rows(self, shard: int) -> tuple[int, int, int]:
        if shard == 0:
            return super().shard_rows(0)
        rows = self.num_kv_heads * self.head_dim
        dst = self.num_heads * self.head_dim + (shard - 1) * rows
        return self.kv_head_start * self.head_dim, rows, dst


class RowParallelLinear(_Linear):
    """``y = x W^T + b`` with the input split across TP ranks; sums partial outputs."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if input_size % ctx.tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp={ctx.tp_size}")
        self.ctx = ctx
        self.local_in = input_size // ctx.tp_size
        self.weight = nn.Parameter(
            torch.empty(output_size, self.local_in, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def load(self, source: TensorSource, shard: int = 0, is_bias: bool = False) -> None:
        if is_bias:
            assert self.bias is not None
            _copy(self.bias.data, source[:], "row bias")
            return
        start = self.ctx.tp_rank * self.local_in
        _copy(self.weight.data, source[:, start : start + self.local_in], "row")

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        # The LoRA delta of this rank's input slice is partial too: the all-reduce sums it.
        y = self.ctx.tp_all_reduce(self.matmul(x, None, lora))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across TP ranks."""

    def __init__(
        self, vocab_size: int, hidden_size: int, ctx: ParallelContext, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = split_evenly(vocab_size, ctx.tp_size, ctx.tp_rank)
        local = -(-vocab_size // ctx.tp_size)
        self.weight = nn.Parameter(
            torch.zeros(local, hidden_size, dtype=dtype), requires_grad=False
        )

    def load(self, source: TensorSource, shard: int = 0, is_bias: bool = False) -> None:
        n = self.vocab_end - self.vocab_start
        _copy(self.weight.data[:n], source[self.vocab_start : self.vocab_end], "embedding")
        self.weight.data[n:] = 0  # padding rows past the vocabulary

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.ctx.tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; every rank ends with the full logits.

    Packed like the linears (``pack``): a tied checkpoint loads this weight as a
    copy of the embedding's, so packing replaces the copy and never the lookup table.
    """

    packed: PackedWeight | None = None

    def pack(self, reorder: Callable[[torch.Tensor], PackedWeight]) -> None:
        """Replace the weight by a matmul-ready copy (see ``cpu_linear``); loading ends here."""
        self.packed = reorder(self.weight.data)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def held_tensors(self) -> tuple[torch.Tensor, ...]:
        """The packed weight, held outside ``parameters()``."""
        return () if self.packed is None else self.packed.tensors

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> logits: [S, vocab]
        if self.packed is not None:
            logits = packed_linear(hidden, self.packed, None)
        else:
            logits = F.linear(hidden, self.weight)
        return self.ctx.tp_all_gather(logits)[:, : self.vocab_size]


class RMSNorm(nn.Module):
    """RMS normalisation, optionally fused with the residual add before it."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, ops: KernelOps | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops or reference_kernels()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def load(self, source: TensorSource, shard: int = 0, is_bias: bool = False) -> None:
        _copy(self.weight.data, source[:], "norm")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``."""
        return self.ops.rms_norm_residual(x, residual, self.weight, self.eps)
