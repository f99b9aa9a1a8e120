"""One rank's model shard, its KV cache, and the forward pass of a step.

The runner builds its stage of the model on its device, loads its slice of the
checkpoint, sizes and allocates the paged KV cache, and executes step plans.
The KV cache is one tensor per rank::

    kv_cache: [num_local_layers, 2 (K, V), num_blocks, block_size, Hkv_local, head_dim]

so one page of one layer is ``kv_cache[layer, :, block]`` and the transfer layer
can address pages without knowing the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from pdserve.core.config import EngineConfig
from pdserve.core.env import env_bytes
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.core.step import StepPlan, StepResult
from pdserve.distributed.context import SINGLE_RANK, ParallelContext
from pdserve.kernels import select_kernels
from pdserve.kernels.attention import select_backend
from pdserve.kernels.cpu_features import warn_if_emulated
from pdserve.kernels.cpu_linear import pack_linears, packing_available
from pdserve.models.afd_model import ExpertStack
from pdserve.models.families import CausalLM, build_model
from pdserve.models.loader import fill_random, load_checkpoint
from pdserve.models.lora_loader import (
    PeftAdapter,
    attach_adapters,
    install_adapter,
    read_adapter,
    remove_adapter,
)
from pdserve.models.quant import quantize_linears, select_path, weights_bytes
from pdserve.parallel.batch import PreparedBatch, prepare_batch
from pdserve.parallel.cuda_graphs import DecodeGraphs
from pdserve.parallel.kv_tiers import TierStore, tier_slots
from pdserve.parallel.sampler import Sampler, prompt_logprobs

logger = logging.getLogger(__name__)

KVAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_ENV = "PDSERVE_CPU_KV_CACHE_BYTES"  # another default pool for CPU ranks
_CPU_KV_BYTES = 256 << 20
_CUDA_KV_FRACTION = 0.85


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "a CPU build of torch" if torch.version.cuda is None else "no GPU visible"
        raise InvalidArgumentError("device", f"cuda asked, but this process has none ({why})")
    return torch.device(name)


def resolve_dtype(name: str, model: ModelConfig) -> torch.dtype:
    """The dtype called ``name``; "auto" takes the checkpoint's, on every device."""
    return _DTYPES[model.dtype if name == "auto" else name]


class ModelRunner:
    """One rank's model shard. Call ``allocate_kv`` before executing plans."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        ctx: ParallelContext = SINGLE_RANK,
        layer_range: tuple[int, int] | None = None,
        afd_role: str = "",
    ) -> None:
        """``afd_role``: "attention" or "experts" on an afd instance (``parallel/afd.py``)."""
        self.afd_role = afd_role
        self.model_config = model_config
        self.config = config
        self.ctx = ctx
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config)
        warn_if_emulated(self.dtype, self.device)
        self.block_size = config.cache.block_size
        backend_cls = select_backend(config.attention_backend, self.device)
        kernels = select_kernels(config.kernel_backend, self.device)
        self.layer_range = layer_range or (0, model_config.num_layers)
        with torch.device(self.device):
            if afd_role == "experts":
                self.model: CausalLM = ExpertStack(
                    model_config, ctx, self.dtype, self.layer_range, kernels
                )
            else:
                self.model = build_model(
                    model_config,
                    ctx,
                    self.dtype,
                    self.layer_range,
                    backend_cls,
                    kernels,
                    remote_experts=bool(afd_role),
                )
        if afd_role and self.tier_slots() != (0, 0):
            raise InvalidArgumentError("afd", "host and disk KV tiers are not supported with afd")
        if afd_role and config.lora_adapters:
            raise InvalidArgumentError("afd", "LoRA adapters are not supported with afd")
        self._load_weights(kernels.name)
        self.sampler = Sampler(
            config.seed, self.device, model_config.path, model_config.eos_token_ids
        )
        self.num_blocks = 0
        self.kv_cache = torch.empty(0)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.tiers: TierStore | None = None
        self.graphs: DecodeGraphs | None = None

    def _load_weights(self, kernels: str) -> None:
        """The checkpoint's weights (or seeded random ones: ``load_format: dummy``), the
        LoRA slots, then the linears quantized or packed for ``kernels``."""
        config = self.config
        if config.load_format == "dummy":
            c = self.ctx
            fill_random(self.model, hash((config.seed, c.tp_rank, c.pp_rank, c.ep_rank)))
        else:
            load_checkpoint(self.model, self.model_config.path, self.model_config.sha256)
        # The adapter in each LoRA slot (None: free); they ride on any packing or quantizing.
        self.adapter_slots, self.adapter_fingerprints = attach_adapters(self.model, config)
        self.model.eval()
        if config.quantization != "none":
            path = select_path(config.quantization, kernels, self.device, self.dtype)
            quantize_linears(self.model, path)
        elif packing_available(self.device, self.dtype):
            pack_linears(self.model)
        self.weights_bytes = weights_bytes(self.model)
        logger.info("weights: %d bytes (quantization %s)", self.weights_bytes, config.quantization)

    def allocate_kv(self, num_blocks: int, allocator: KVAllocator | None = None) -> None:
        """Allocate the paged KV cache; every rank of an instance gets the same count.

        ``allocator(shape, dtype, device)`` may place it (e.g. in shared memory);
        it must return zeros: masked-out slots still meet V in the attention sum.
        An afd expert rank holds no KV cache.
        """
        if self.afd_role == "experts":
            self.num_blocks = num_blocks
            return
        kv_heads = max(1, self.model_config.num_kv_heads // self.ctx.tp_size)
        shape = (
            len(self.model.layers),
            2,
            num_blocks,
            self.block_size,
            kv_heads,
            self.model_config.head_dim,
        )
        if allocator is None:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        else:
            self.kv_cache = allocator(shape, self.dtype, self.device)
        self.caches = [
            (self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(len(self.model.layers))
        ]
        self.num_blocks = num_blocks
        self.graphs = self._decode_graphs(num_blocks)
        host_slots, disk_slots = self.tier_slots()
        if self.tiers is None and host_slots + disk_slots > 0:
            rank = f"tp{self.ctx.tp_rank}pp{self.ctx.pp_rank}"
            self.tiers = TierStore(self.config.cache, host_slots, disk_slots, rank)
        logger.info(
            "rank tp=%d/%d pp=%d/%d: layers %s, %d KV blocks of %d tokens, %s on %s",
            self.ctx.tp_rank,
            self.ctx.tp_size,
            self.ctx.pp_rank,
            self.ctx.pp_size,
            self.layer_range,
            num_blocks,
            self.block_size,
            self.dtype,
            self.device,
        )

    def _decode_graphs(self, num_blocks: int) -> DecodeGraphs | None:
        """CUDA graphs of decode steps, where they apply: the whole model on one CUDA rank."""
        c, config = self.ctx, self.config
        one_rank = c.tp_size == c.pp_size == c.ep_size == 1 and not self.afd_role
        dense = self.model_config.num_experts == 0  # MoE reads its hit experts on the host
        if not (config.cuda_graphs and self.device.type == "cuda" and one_rank and dense):
            return None
        longest = config.max_model_len or self.model_config.max_position_embeddings
        return DecodeGraphs(
            self.model,
            self.caches,
            config.scheduler.max_num_seqs,
            min(longest, num_blocks * self.block_size),
            self.block_size,
            self.device,
        )

    def bytes_per_block(self) -> int:
        local_layers = self.layer_range[1] - self.layer_range[0]
        tp = self.ctx.tp_size
        kv_heads = max(1, self.model_config.num_kv_heads // tp)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (
            2
            * max(local_layers, 1)
            * self.block_size
            * kv_heads
            * self.model_config.head_dim
            * elem
        )

    def tier_slots(self) -> tuple[int, int]:
        """Host and disk tier blocks per rank, sized as if the rank held every layer.

        Every rank of an instance gets the same counts that way, whatever its stage.
        """
        full = self.bytes_per_block() // max(self.layer_range[1] - self.layer_range[0], 1)
        return tier_slots(self.config.cache, full * self.model_config.num_layers)

    def start_tier_ops(self, plan: StepPlan) -> list[bool]:
        """Copy the plan's offloaded blocks back; start its writes. A flag per load."""
        if self.tiers is None or not plan.tier_ops:
            return []
        return self.tiers.start(plan.tier_ops, self.kv_cache)

    def tier_io(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
        if self.tiers is None:
            return {}, {}
        return dict(self.tiers.io.bytes), dict(self.tiers.io.seconds)

    def finish_tier_ops(self) -> None:
        if self.tiers is not None:
            self.tiers.finish()

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()

    def max_num_blocks(self, extra_bytes_per_block: int = 0) -> int:
        """Blocks that fit this rank's KV budget (or the configured count).

        ``extra_bytes_per_block``: what else a block costs on this rank (a draft
        model's KV of the same block), paid from the same budget.
        """
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.afd_role == "experts":  # no KV here: the attention ranks' count rules
            return 1 << 40
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * _CUDA_KV_FRACTION)
            else:
                budget = env_bytes(CPU_KV_ENV, _CPU_KV_BYTES)
        return max(1, budget // (self.bytes_per_block() + extra_bytes_per_block))

    def prepare(self, plan: StepPlan) -> PreparedBatch:
        return prepare_batch(plan, self.block_size, self.device, self.adapter_slots)

    def read_adapter(self, name: str, folder: str) -> PeftAdapter:
        """Read and check a PEFT adapter for this model (InvalidArgumentError naming the field)."""
        if self.afd_role:
            raise InvalidArgumentError("afd", "LoRA adapters are not supported with afd")
        return read_adapter(name, folder, self.config.max_lora_rank, self.model_config)

    def load_adapter(self, slot: int, name: str, adapter: PeftAdapter) -> None:
        """Between steps: hold ``adapter`` in ``slot``; plans may name it from now on."""
        install_adapter(self.model, slot, adapter, len(self.adapter_slots))
        self.adapter_slots[slot] = name

    def unload_adapter(self, slot: int) -> None:
        remove_adapter(self.model, slot)
        self.adapter_slots[slot] = None

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the whole model (one stage, one rank) on a plan and sample."""
        loads_ok = self.start_tier_ops(plan)
        self.sampler.forget(plan.finished_request_ids)
        try:
            if not plan.seqs:
                return StepResult(plan.step_id, {}, loads_ok=loads_ok)
            batch = self.prepare(plan)
            logits = self.graphs.logits(batch) if self.graphs is not None else None
            if logits is not None:  # a decode step replayed from a CUDA graph
                result = self._sample_logits(plan, batch, logits)
            else:
                hidden, _ = self.model(
                    batch.input_ids, batch.positions, self.caches, batch.meta, lora=batch.lora
                )
                result = self.sample(plan, batch, hidden)
        finally:
            self.finish_tier_ops()
        return replace(result, loads_ok=loads_ok) if loads_ok else result

    def sample(self, plan: StepPlan, batch: PreparedBatch, hidden: torch.Tensor) -> StepResult:
        if batch.prompt_rows:  # every rank joins the logits' gather
            prompt = prompt_logprobs(self.model.compute_logits, hidden, batch.prompt_rows)
            return replace(self._sample(plan, batch, hidden), prompt_logprobs=prompt)
        return self._sample(plan, batch, hidden)

    def _sample(self, plan: StepPlan, batch: PreparedBatch, hidden: torch.Tensor) -> StepResult:
        if not batch.sample_ids:
            return StepResult(plan.step_id, {})
        # Distinct rising indices, as many as there are rows: every row, in order.
        every_row = batch.sample_indices.shape[0] == hidden.shape[0]
        logits = self.model.compute_logits(hidden if every_row else hidden[batch.sample_indices])
        return self._sample_logits(plan, batch, logits)

    def _sample_logits(
        self, plan: StepPlan, batch: PreparedBatch, logits: torch.Tensor
    ) -> StepResult:
        """Sample from the logits of the sampled rows, in ``batch.sample_ids``' order."""
        tokens = self.sampler.verify(
            logits, batch.sample_rows, batch.sample_drafts, batch.sample_ids
        )
        logprobs = self.sampler.logprobs(logits, batch.sample_rows, batch.sample_drafts, tokens)
        return StepResult.from_tokens(
            plan.step_id,
            dict(zip(batch.sample_ids, tokens, strict=True)),
            logprobs={batch.sample_ids[i]: v for i, v in logprobs.items()},
        )
