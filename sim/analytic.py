"""Analytic profiles: an instance's step model from a device's datasheet.

For a model of ``P`` weights (active per token) at ``tp`` x ``pp`` devices::

    s_per_token = 2 P / (tp * peak_flops * mfu)  +  all-reduce bytes / interconnect
    s_per_attn  = 4 * layers * heads * head_dim / (tp * peak_flops * mfu)
    weights_s   = P * dtype_bytes / (tp * mem_bw * mbu)
    s_per_ctx   = kv_bytes_per_token / (tp * mem_bw * mbu)
    overhead_s  = step_overhead_s + 2 * layers * allreduce_latency_s (tp > 1)

combined with ``max`` (the roofline: a step is bound by compute or by memory).
Pipeline stages add KV capacity, not speed, to one step (a conservative choice:
pdserve does not overlap micro-batches across stages). ``mfu``/``mbu`` are
assumed efficiencies; :func:`calibrate` replaces them with the ones a measured
profile of the same device shows (actual / expected, as a planner corrects its
profile).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from pdserve.core.config import ParallelConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.layout import plan_layout
from pdserve.sim.profile import ModelShape, Profile, StepModel, TransferModel


@dataclass(frozen=True)
class DeviceSpec:
    """Peak numbers of one accelerator (dense bf16, or fp32 for the CPU entry)."""

    name: str
    peak_flops: float
    mem_bw: float  # bytes/s
    mem_bytes: float
    interconnect_bw: float  # bytes/s, one direction, device to device in a node
    network_bw: float  # bytes/s per device, between nodes (KV hand-off)
    dtype: str = "bfloat16"


DEVICES = {
    "h100": DeviceSpec("h100", 989e12, 3.35e12, 80e9, 450e9, 50e9),
    "a100": DeviceSpec("a100", 312e12, 2.039e12, 80e9, 300e9, 25e9),
    "h200": DeviceSpec("h200", 989e12, 4.8e12, 141e9, 450e9, 50e9),
    # A 2-core Zen 4 host (fp32 matmul ~190 GFLOP/s, copy ~52 GB/s), KV budget 256 MiB.
    "cpu": DeviceSpec("cpu", 190e9, 52e9, 256 * 2**20, 21e9, 3e9, "float32"),
}


@dataclass(frozen=True)
class Assumptions:
    """Efficiencies and overheads an analytic profile assumes.

    Attributes:
        mfu: achieved share of peak FLOP/s in compute-bound steps.
        mbu: achieved share of memory bandwidth in memory-bound steps.
        step_overhead_s: fixed cost of one engine step (scheduling, launches, sampling).
        allreduce_latency_s: latency of one tensor-parallel all-reduce.
        mem_fraction: share of device memory the engine may use (weights + KV).
        transfer_latency_s: fixed cost of one KV hand-off.
    """

    mfu: float = 0.5
    mbu: float = 0.8
    step_overhead_s: float = 0.002
    allreduce_latency_s: float = 10e-6
    mem_fraction: float = 0.9
    transfer_latency_s: float = 50e-6

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu", "mem_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidArgumentError(name, f"must be in (0, 1], got {getattr(self, name)}")
        # at most a second: per step or per message, more is no device (1e300 s hung
        # the simulation, its clock no longer moving at that magnitude)
        for name in ("step_overhead_s", "allreduce_latency_s", "transfer_latency_s"):
            if not 0 <= getattr(self, name) <= 1.0:
                raise InvalidArgumentError(
                    name, f"must be in [0, 1] s, got {getattr(self, name):g} s"
                )


MODELS = {
    "llama-7b": ModelShape("llama-7b", 32, 4096, 32, 32, 128, 11008, 32000, 4096),
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000, 4096),
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
    # OPT (Zhang et al. 2022, Table 1 of "OPT: Open Pre-trained Transformer Language
    # Models"): learned positions, a two-matrix MLP; the models DistServe evaluates
    "opt-13b": ModelShape("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, 2048, mlp_matrices=2),
    "opt-66b": ModelShape("opt-66b", 64, 9216, 72, 72, 128, 36864, 50272, 2048, mlp_matrices=2),
    "opt-175b": ModelShape("opt-175b", 96, 12288, 96, 96, 128, 49152, 50272, 2048, mlp_matrices=2),
}


def model_shape(name: str) -> ModelShape:
    """A preset (``llama-7b`` ...) or any model pdserve can load (builtin:<name>, a folder)."""
    if name in MODELS:
        return MODELS[name]
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model

    try:
        cfg = ModelConfig.from_dir(resolve_model(name))
    except InvalidArgumentError as e:
        where = "" if e.field == "model" else f"{e.field}: "  # a checkpoint's bad file
        raise InvalidArgumentError(
            "model", f"{where}{e.message} (analytic presets: {sorted(MODELS)})"
        ) from None
    return ModelShape(
        name,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.max_position_embeddings,
        cfg.num_experts,
        cfg.num_experts_per_tok,
    )


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _roofline_step(model: ModelShape, d: DeviceSpec, tp: int, a: Assumptions) -> StepModel:
    """A step's times on ``tp`` devices ``d`` (tensor parallel) at the assumed efficiencies."""
    b = _dtype_bytes(d.dtype)
    flops = tp * d.peak_flops * a.mfu
    bw = tp * d.mem_bw * a.mbu
    comm = 0.0 if tp == 1 else 2 * model.num_layers * model.hidden_size * b * 2 * (tp - 1) / tp
    return StepModel(
        overhead_s=a.step_overhead_s
        + (2 * model.num_layers * a.allreduce_latency_s if tp > 1 else 0),
        s_per_token=2 * model.params / flops + comm / d.interconnect_bw,
        s_per_attn=4 * model.num_layers * model.num_heads * model.head_dim / flops,
        weights_s=model.params * b / bw,
        s_per_ctx=model.kv_bytes_per_token(b) / bw,
        combine="max",
    )


def _kv_room(model: ModelShape, device: str, devices: int, a: Assumptions) -> float:
    """Bytes ``devices`` x ``device`` leave for the KV cache; too few for 16 tokens is an error."""
    d = DEVICES[device]
    b = _dtype_bytes(d.dtype)
    if device == "cpu":
        free = d.mem_bytes * devices  # the engine's CPU KV budget is separate from the weights
    else:
        free = d.mem_bytes * devices * a.mem_fraction - model.params * b
    if free < model.kv_bytes_per_token(b) * 16:
        raise InvalidArgumentError(
            "tp",
            f"{model.name} ({model.params * b / 1e9:.1f} GB of weights) leaves no room for KV "
            f"on {devices} x {device}: use more devices per instance",
        )
    return free


def analytic_profile(
    model: ModelShape,
    device: str,
    tp: int = 1,
    pp: int = 1,
    assumptions: Assumptions | None = None,
    command: str = "",
) -> Profile:
    """The roofline step model of ``model`` on ``tp`` x ``pp`` ``device``s."""
    if device not in DEVICES:
        raise InvalidArgumentError("device", f"unknown device {device!r}; known: {sorted(DEVICES)}")
    if tp < 1 or pp < 1:
        raise InvalidArgumentError("tp", "tensor and pipeline sizes must be >= 1")
    plan_layout(model, ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    a = assumptions or Assumptions()
    d = DEVICES[device]
    step = _roofline_step(model, d, tp, a)
    devices = tp * pp
    kv_bytes = model.kv_bytes_per_token(_dtype_bytes(d.dtype))
    free = _kv_room(model, device, devices, a)
    link = TransferModel(a.transfer_latency_s, d.network_bw * devices)
    node = TransferModel(a.transfer_latency_s, d.interconnect_bw)  # same node
    return Profile(
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        device=device,
        source="analytic",
        step=step,
        kv_bytes_per_token=kv_bytes,
        kv_capacity_tokens=int(free // kv_bytes),
        dtype=d.dtype,
        connectors={
            "default": link,
            "p2p": link,
            "object_store": link,
            "shm": node,
            "cuda_ipc": node,
            "nccl": node,  # device to device between the GPUs of one node
        },
        efficiency={"mfu": a.mfu, "mbu": a.mbu},
        command=command,
    )


def measured_efficiency(analytic: Profile, measured: Profile) -> dict[str, float]:
    """The mfu and mbu a measured profile shows: (time at the assumed efficiency) x
    efficiency / (measured time - overhead), median over its samples that the
    analytic model calls compute-bound (for mfu) and memory-bound (for mbu)."""
    if not measured.samples:
        raise InvalidArgumentError("calibrate", "the measured profile holds no samples")
    step = analytic.step
    mfu, mbu = analytic.efficiency.get("mfu", 1.0), analytic.efficiency.get("mbu", 1.0)
    compute, memory = [], []
    for s in measured.samples:
        f = s.features
        busy = max(s.seconds - step.overhead_s - step.s_per_seq * f.seqs, 1e-9)
        c = step.s_per_token * f.new_tokens + step.s_per_attn * f.attn
        m = step.weights_s + step.s_per_ctx * f.context
        if c >= m:
            compute.append(mfu * c / busy)
        else:
            memory.append(mbu * m / busy)
    out = {}
    if compute:
        out["mfu"] = min(1.0, statistics.median(compute))
    if memory:
        out["mbu"] = min(1.0, statistics.median(memory))
    return out


def calibrate(
    model: ModelShape, device: str, tp: int, pp: int, measured: Profile, base: Assumptions
) -> Profile:
    """The analytic profile with the measured efficiencies in place of the assumed ones."""
    if measured.device != device:
        raise InvalidArgumentError(
            "calibrate", f"the measured profile is of {measured.device!r}, not {device!r}"
        )
    first = analytic_profile(model, device, tp, pp, base)
    eff = measured_efficiency(first, measured)
    return analytic_profile(model, device, tp, pp, replace(base, **eff))
