"""Frozen configuration of one engine: KV cache, scheduler, parallel layout.

One dataclass per component; every tunable number lives here with a default and
a doc line. ``__post_init__`` rejects bad values with an error naming the field.
Derived values are properties, never stored copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.adapters import adapter_pairs, check_adapters
from pdserve.core.errors import InvalidArgumentError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_EVICTION_POLICIES = ("lru", "idle", "priority")
_QUANTIZATIONS = ("none", "int8", "int4")
_LOAD_FORMATS = ("safetensors", "dummy")
_SPECULATIVE_METHODS = ("none", "ngram", "draft")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(name, f"must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block (page).
        num_blocks: blocks in the pool; None sizes the pool from ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: memory for K and V of all layers on one rank; None
            takes 85% of the free memory on a GPU and 256 MiB on CPU
            (``$PDSERVE_CPU_KV_CACHE_BYTES`` sets another CPU default).
        enable_prefix_caching: reuse full blocks whose chained token hash matches.
        eviction: the device pool's eviction policy: lru, idle or priority.
        host_tier_bytes: host memory per rank that keeps prefix blocks below the
            device pool (0: no host tier).
        host_tier_eviction: the host tier's policy (idle: blocks unused for
            ``idle_eviction_s`` go down to disk without waiting for pressure).
        disk_tier_bytes: local disk per rank below the host tier (0: no disk tier).
        disk_tier_path: folder for the disk tier's files (needed when it is on).
        disk_tier_eviction: the disk tier's policy.
        idle_eviction_s: how long a block stays unused before the idle policy moves it.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    eviction: str = "lru"
    host_tier_bytes: int = 0
    host_tier_eviction: str = "lru"
    disk_tier_bytes: int = 0
    disk_tier_path: str | None = None
    disk_tier_eviction: str = "lru"
    idle_eviction_s: float = 60.0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        for name in ("num_blocks", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("eviction", "host_tier_eviction", "disk_tier_eviction"):
            if getattr(self, name) not in _EVICTION_POLICIES:
                raise InvalidArgumentError(
                    name, f"must be one of {_EVICTION_POLICIES}, got {getattr(self, name)!r}"
                )
        for name in ("host_tier_bytes", "disk_tier_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(name, f"must be an integer >= 0, got {value!r}")
        if self.disk_tier_bytes and not self.disk_tier_path:
            raise InvalidArgumentError("disk_tier_path", "is needed when disk_tier_bytes > 0")
        if not self.idle_eviction_s > 0:
            raise InvalidArgumentError("idle_eviction_s", "must be > 0")

    @property
    def tiers_enabled(self) -> bool:
        return self.enable_prefix_caching and (self.host_tier_bytes + self.disk_tier_bytes) > 0


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching with chunked prefill.

    Attributes:
        max_num_seqs: most requests in the running batch.
        max_num_batched_tokens: per-step token budget, shared by decode tokens and
            prefill chunks; a prompt longer than what is left is split over steps.
        max_prefill_chunk: most prompt tokens of one request in one step (0: no cap
            beyond the budget), so one long prompt cannot take a whole step.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_prefill_chunk: int = 0

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_prefill_chunk < 0:
            raise InvalidArgumentError("max_prefill_chunk", "must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    """Layout of one instance: tensor x pipeline ranks; experts over ``ep`` ranks.

    Attributes:
        tensor_parallel_size: ranks that split each layer's heads and hidden units.
        pipeline_parallel_size: stages that split the layers.
        expert_parallel_size: ranks that split the MoE experts.
        pipeline_layers: layers per stage (None: even split).
        redundant_experts: extra expert slots over the EP ranks, each holding a
            replica of a hot expert (EPLB, ``models/eplb.py``); ``experts +
            redundant_experts`` must divide by ``expert_parallel_size`` (checked
            against the model when the instance starts).
        rebalance_interval_s: with redundant experts, the leader re-places them
            from the load measured since the last placement this often (0: only
            when asked, ``rebalance_experts``).
        rebalance_min_tokens: a layer whose window holds fewer routed tokens keeps
            its placement and goes on counting (noise never moves weights).
        afd: attention-FFN disaggregation (MoE models, ``parallel/afd.py``): the
            attention, KV cache and dense parts run on ``afd_attention_ranks``
            ranks (heads split over them), the experts on ``afd_expert_ranks``
            other ranks; the tensor, pipeline and expert sizes stay 1.
        afd_attention_ranks: ranks of the attention group (with ``afd``).
        afd_expert_ranks: ranks of the expert group (with ``afd``).
        afd_micro_batches: micro-batches a step is cut into so that the two
            groups work at the same time (fewer when the step has fewer sequences).
        elastic_ep: keep serving on the surviving ranks when an expert-parallel
            follower rank dies (``parallel/elastic.py``). None: on wherever the
            layout allows it (``expert_parallel_size > 1`` with tensor and
            pipeline sizes 1, on CPU); True: required (other layouts are
            refused); False: a lost rank fails the instance.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_layers: tuple[int, ...] | None = None
    redundant_experts: int = 0
    rebalance_interval_s: float = 0.0
    rebalance_min_tokens: int = 1024
    afd: bool = False
    afd_attention_ranks: int = 1
    afd_expert_ranks: int = 1
    afd_micro_batches: int = 2
    elastic_ep: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            _positive(name, getattr(self, name))
        for name in ("afd_attention_ranks", "afd_expert_ranks", "afd_micro_batches"):
            _positive(name, getattr(self, name))
        for name in ("redundant_experts", "rebalance_interval_s", "rebalance_min_tokens"):
            if not 0 <= getattr(self, name) < math.inf:
                raise InvalidArgumentError(name, "must be >= 0 and finite")
        if self.redundant_experts and self.expert_parallel_size == 1:
            raise InvalidArgumentError(
                "redundant_experts",
                f"{self.redundant_experts} needs expert_parallel_size > 1 "
                "(with one EP rank every expert already sits on every rank)",
            )
        if self.elastic_ep and (self.expert_parallel_size == 1 or self.world_size > 1 or self.afd):
            raise InvalidArgumentError(
                "elastic_ep",
                "needs expert_parallel_size > 1 with tensor_parallel_size and "
                "pipeline_parallel_size 1 (a lost rank must hold only experts, no KV shard)",
            )
        if self.pipeline_layers is not None:
            if len(self.pipeline_layers) != self.pipeline_parallel_size:
                raise InvalidArgumentError(
                    "pipeline_layers",
                    f"needs one entry per stage ({self.pipeline_parallel_size}), "
                    f"got {len(self.pipeline_layers)}",
                )
            for n in self.pipeline_layers:
                _positive("pipeline_layers", n)

    @property
    def world_size(self) -> int:
        if self.afd:
            return self.afd_attention_ranks + self.afd_expert_ranks
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class DisaggregationConfig:
    """When a decode instance prefills a request itself instead of taking KV.

    Attributes:
        local_prefill_max_tokens: prompts this short are prefilled on the decode
            instance (a remote prefill would cost more than it saves).
        local_prefill_cached_fraction: prompts with at least this share of their
            tokens already cached on the decode instance are prefilled there.
        reservation_ttl_s: how long a decode instance holds pages for a prompt
            whose KV has not been handed off yet.
    """

    local_prefill_max_tokens: int = 16
    local_prefill_cached_fraction: float = 0.8
    reservation_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0:
            raise InvalidArgumentError("local_prefill_max_tokens", "must be >= 0")
        if not 0 < self.local_prefill_cached_fraction <= 1:
            raise InvalidArgumentError("local_prefill_cached_fraction", "must be in (0, 1]")
        if not 0 < self.reservation_ttl_s < math.inf:  # a NaN lease would never expire
            raise InvalidArgumentError("reservation_ttl_s", "must be > 0 and finite")

    def prefills_locally(self, prompt_len: int, cached_tokens: Callable[[], int]) -> bool:
        """The decode instance's rule: a short prompt, or one mostly cached there
        (``cached_tokens``: its leading tokens the decode instance holds, asked only
        for a prompt longer than ``local_prefill_max_tokens``), skips the prefill
        instance. The decode server and the simulator both ask it."""
        if prompt_len <= self.local_prefill_max_tokens:
            return True
        return cached_tokens() >= self.local_prefill_cached_fraction * prompt_len


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of running requests (see ``engine/speculative.py``).

    Attributes:
        method: "none"; "ngram": drafts by prompt lookup in the request's own tokens;
            "draft": drafts from a smaller model of the same vocabulary (``draft_model``).
        draft_model: the draft model's folder or ``builtin:`` name
            (``speculative_draft_model``), for method "draft" only.
        num_speculative_tokens: most draft tokens verified per request and step.
        prompt_lookup_min: shortest tail n-gram looked up in the request's tokens.
        prompt_lookup_max: longest tail n-gram looked up (tried first).
        max_batch: a step with more decoding requests than this drafts nothing
            (``speculative_max_batch``): a verifying row costs ``k + 1`` tokens of
            compute, which a large batch pays for and a small one hardly does.
        min_acceptance: a request whose running acceptance rate falls below this (or
            below a draft model's measured break-even) drafts only on occasional
            probe steps (``speculative_min_acceptance``; 0: always drafts).
    """

    method: str = "none"
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch: int = 8
    min_acceptance: float = 0.2

    def __post_init__(self) -> None:
        if self.method not in _SPECULATIVE_METHODS:
            raise InvalidArgumentError(
                "speculative_method", f"must be one of {_SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if (self.method == "draft") != bool(self.draft_model):
            msg = "is needed with speculative_method draft, and only then"
            raise InvalidArgumentError("speculative_draft_model", msg)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _positive(name, getattr(self, name))
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise InvalidArgumentError("prompt_lookup_max", "must be >= prompt_lookup_min")
        _positive("speculative_max_batch", self.max_batch)
        if not 0 <= self.min_acceptance <= 1:
            raise InvalidArgumentError("speculative_min_acceptance", "must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @staticmethod
    def flat_names() -> dict[str, str]:
        """Flat option name (API, CLI) -> field name."""
        prefixed = ("method", "draft_model", "max_batch", "min_acceptance")
        return {
            (f"speculative_{name}" if name in prefixed else name): name
            for name in SpeculativeConfig.__dataclass_fields__
        }


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance is built from.

    Attributes:
        model: checkpoint folder, or a built-in name such as ``builtin:tiny``.
        dtype: weight, activation and KV cache dtype; "auto" takes the checkpoint's (on
            the CPU too). "bfloat16" accumulates in float32; on a CPU it is fast with
            AVX-512 BF16 or AMX and emulated, with a warning, elsewhere
            (``kernels/cpu_features.py``).
        max_model_len: longest prompt + output; None takes the model's limit.
        seed: seed for requests sampled without their own seed.
        attention_backend: attention implementation by registry name ("auto": the
            device's default).
        kernel_backend: fused-layer kernels by registry name; auto: triton on CUDA, cpu
            (C kernels) on a CPU with a C compiler, torch elsewhere.
        device: "cpu", "cuda" or "auto".
        quantization: "none"; "int8": weight-only int8 of the dense linears (one
            symmetric scale per output channel); "int4": 4-bit, one scale per
            output channel and group of 32 inputs. See ``models/quant.py``.
        speculative: speculative decoding of running requests (off by default).
        lora_adapters: (name, folder) of each PEFT LoRA adapter served over the base
            model; a request picks one by name (``SamplingParams.lora``). See
            ``models/lora.py``.
        max_lora_rank: largest LoRA rank ``r`` an adapter may have.
        max_loras: most LoRA adapters the instance holds at once, start-up and
            runtime loads (``LLM.load_lora_adapter``) together.
        load_format: "safetensors" reads the folder's weights; "dummy" needs only its
            ``config.json`` and fills the weights with seeded random values, for timing
            a model's shape (``pdserve profile``, the GPU benchmarks) without its checkpoint.
        cuda_graphs: replay decode steps from CUDA graphs on one CUDA rank
            (``parallel/cuda_graphs.py``); False launches every kernel eagerly.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    kernel_backend: str = "auto"
    device: str = "auto"
    quantization: str = "none"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora_adapters: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 64
    max_loras: int = 8
    load_format: str = "safetensors"
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("max_loras", self.max_loras)
        check_adapters(self.lora_adapters, self.max_loras)
        if self.speculative.method == "draft" and self.parallel.pipeline_parallel_size > 1:
            msg = "is supported with pipeline_parallel_size 1 only (use tensor parallelism)"
            raise InvalidArgumentError("speculative_draft_model", msg)
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgumentError("model", "must be a non-empty path or name")
        if self.dtype not in _DTYPES:
            raise InvalidArgumentError("dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.device not in ("auto", "cpu", "cuda"):
            raise InvalidArgumentError("device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.quantization not in _QUANTIZATIONS:
            msg = f"must be one of {_QUANTIZATIONS}, got {self.quantization!r}"
            raise InvalidArgumentError("quantization", msg)
        if self.load_format not in _LOAD_FORMATS:
            msg = f"must be one of {_LOAD_FORMATS}, got {self.load_format!r}"
            raise InvalidArgumentError("load_format", msg)
        if not isinstance(self.kernel_backend, str) or not self.kernel_backend:
            msg = f"must be a kernels name (auto, torch, cpu, triton), got {self.kernel_backend!r}"
            raise InvalidArgumentError("kernel_backend", msg)


# EngineConfig's fields that no flat option names: the model is the argument, the
# groups are built from their fields' flat names.
_NOT_FLAT = {"model", "cache", "scheduler", "parallel", "speculative"}


def build_engine_config(model: str, /, **kwargs: Any) -> EngineConfig:
    """An :class:`EngineConfig` from flat keyword arguments (the API's and the CLI's)."""
    groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "parallel": {}}
    fields = {
        "cache": CacheConfig.__dataclass_fields__,
        "scheduler": SchedulerConfig.__dataclass_fields__,
        "parallel": ParallelConfig.__dataclass_fields__,
    }
    top: dict[str, Any] = {}
    speculative: dict[str, Any] = {}
    spec_names = SpeculativeConfig.flat_names()
    for name, value in kwargs.items():
        group = next((g for g, names in fields.items() if name in names), None)
        if name in spec_names:
            speculative[spec_names[name]] = value
        elif group is not None:
            groups[group][name] = value
        elif name == "lora_adapters":
            top[name] = adapter_pairs(value)
        elif name in EngineConfig.__dataclass_fields__ and name not in _NOT_FLAT:
            top[name] = value
        else:
            raise InvalidArgumentError(name, "unknown engine option")
    return EngineConfig(
        model=model,
        cache=CacheConfig(**groups["cache"]),
        scheduler=SchedulerConfig(**groups["scheduler"]),
        parallel=ParallelConfig(**groups["parallel"]),
        speculative=SpeculativeConfig(**speculative),
        **top,
    )
