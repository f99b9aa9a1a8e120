"""GPU-scale estimate of attention-FFN disaggregation: decode throughput per device.

    pdserve afd-estimate --device h100 --gpus 32

A roofline model of one decode step of a DeepSeek-V3-shaped MoE model (61
layers, the first 3 dense; 256 routed experts + 1 shared, top-8; hidden 7168;
expert intermediate 2048) on ``--gpus`` devices of a :data:`~pdserve.sim.analytic.DEVICES`
entry, with the efficiencies of the analytic profiles (``--mfu``, ``--mbu``).
Every piece of work is ``max(flops / (peak * mfu), bytes / (bandwidth * mbu))``.

Assumptions (each a flag or a field of :class:`MoEShape`):

- MLA attention, approximated: its projections as dense weights
  (q 7168->1536->128x192, kv 7168->576, kv_b 512->128x256, o 16384->7168), the
  KV cache as the 576-wide compressed latent per token and layer, and the core
  attention as ``2 * heads * (576 + 512)`` FLOPs per context token (absorbed).
- Weights in ``--weight-bytes`` (1: FP8 as DeepSeek-V3 ships; compute at the
  datasheet's bf16 peak, which is conservative), KV and activations in 2 bytes.
- Routing uniform: a step's ``B * 8`` (token, expert) pairs spread evenly over
  the expert devices; an expert's weights are read once per micro-batch if any
  pair hits it.
- Colocated EP: ``N`` devices, each with the whole attention (data-parallel,
  ``B / N`` sequences and their KV), the shared expert and dense layers, and
  ``256 / N`` routed experts; the all-to-all dispatch and combine each move a
  device's ``B / N * 8`` rows. Two variants: compute then communication, and
  communication hidden behind compute by two micro-batches (DeepSeek's dual
  micro-batch overlap), which reads the experts' weights twice.
- AFD: ``N_a`` attention devices (attention, KV, shared expert, dense layers,
  embeddings, LM head) and ``N_f = N - N_a`` expert devices; ``m`` micro-batches
  ping-pong, so a MoE layer takes ``m * max(attention, experts)`` plus the
  transfer (hidden when ``m >= 3``), plus one micro-batch of pipeline fill.
- Links: ``--nvlink-domain`` devices (8: one node) share NVLink
  (``interconnect_bw``); a layout of more devices crosses nodes at
  ``network_bw`` per device for all of its transfers (no node-limited routing).
- Every layout's batch ``B`` (sequences of ``--context`` tokens) is the largest
  that fits the devices' memory (``mem_fraction``) and the ``--tpot-slo-ms``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import flat_options, options_from
from pdserve.sim.analytic import DEVICES, Assumptions, DeviceSpec
from pdserve.sim.flags import DeviceFlags, add_device_flags, assumptions_from

KV_BYTES = 2  # KV cache and activations, bytes per value
A2A_LATENCY_S = 20e-6  # fixed cost of one dispatch or combine


@dataclass(frozen=True)
class EstimateOptions:
    """``pdserve afd-estimate``'s options, in the order of its flags."""

    gpus: list[int] = field(default_factory=lambda: [16, 32, 64])  # device counts estimated
    context: int = 4096  # tokens of each decoding sequence
    weight_bytes: float = 1.0  # 1: FP8 weights, 2: bf16
    tpot_slo_ms: float = 100.0  # largest decode step
    nvlink_domain: int = 8  # devices sharing NVLink
    out: str = "bench/out/afd_estimate.json"  # the result file ("": none)
    analytic: DeviceFlags = field(default_factory=DeviceFlags)  # the device and efficiencies


@dataclass(frozen=True)
class MoEShape:
    """A DeepSeek-V3-shaped MoE model with MLA attention."""

    name: str = "deepseek-v3"
    layers: int = 61
    dense_layers: int = 3
    hidden: int = 7168
    experts: int = 256
    shared_experts: int = 1
    top_k: int = 8
    moe_inter: int = 2048
    dense_inter: int = 18432
    vocab: int = 129280
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def attn_params(self) -> int:
        """One layer's MLA projections."""
        h, n = self.hidden, self.heads
        q = h * self.q_lora + self.q_lora * n * (self.nope_dim + self.rope_dim)
        kv = h * (self.kv_lora + self.rope_dim) + self.kv_lora * n * (self.nope_dim + self.v_dim)
        return q + kv + n * self.v_dim * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter

    @property
    def kv_bytes_per_token(self) -> int:
        """The compressed latent and the RoPE key, every layer."""
        return self.layers * (self.kv_lora + self.rope_dim) * KV_BYTES

    def attn_core_flops(self, context: int) -> float:
        """One token's absorbed attention over ``context`` tokens, one layer."""
        return 2.0 * self.heads * (2 * self.kv_lora + self.rope_dim) * context

    def dense_side_params(self) -> int:
        """What the attention side holds besides attention: dense MLPs, shared experts, vocab."""
        dense = self.dense_layers * 3 * self.hidden * self.dense_inter
        shared = self.moe_layers * self.shared_experts * self.expert_params
        return dense + shared + 2 * self.vocab * self.hidden

    def routed_params(self) -> int:
        return self.moe_layers * self.experts * self.expert_params


@dataclass(frozen=True)
class Costs:
    """The device and assumptions every piece of work is timed with."""

    device: DeviceSpec
    a: Assumptions
    weight_bytes: float
    context: int
    nvlink_domain: int = 8  # devices that share NVLink (one node)

    def __post_init__(self) -> None:
        if not 0 < self.weight_bytes < math.inf:
            raise InvalidArgumentError("weight_bytes", f"must be > 0, got {self.weight_bytes}")
        for name in ("context", "nvlink_domain"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be at least 1, got {getattr(self, name)}")

    def roofline(self, flops: float, nbytes: float) -> float:
        d = self.device
        return max(flops / (d.peak_flops * self.a.mfu), nbytes / (d.mem_bw * self.a.mbu))

    def link(self, devices: int) -> float:
        return (
            self.device.interconnect_bw if devices <= self.nvlink_domain else self.device.network_bw
        )

    @property
    def usable(self) -> float:
        return self.device.mem_bytes * self.a.mem_fraction


def attention_side(m: MoEShape, c: Costs, seqs: float) -> tuple[float, float]:
    """Seconds of one MoE layer's attention (+ shared expert), and of one dense layer,
    for ``seqs`` decoding sequences on one device."""
    p = m.attn_params
    attn = c.roofline(
        2 * p * seqs + m.attn_core_flops(c.context) * seqs,
        p * c.weight_bytes + seqs * c.context * (m.kv_lora + m.rope_dim) * KV_BYTES,
    )
    shared = m.shared_experts * c.roofline(
        2 * m.expert_params * seqs, m.expert_params * c.weight_bytes
    )
    dense_p = 3 * m.hidden * m.dense_inter
    dense = c.roofline(2 * dense_p * seqs, dense_p * c.weight_bytes)
    return attn + shared, attn + dense


def experts_side(m: MoEShape, c: Costs, tokens: float, devices: int) -> float:
    """Seconds of one MoE layer's routed experts on one of ``devices`` expert devices."""
    pairs = tokens * m.top_k
    active = m.experts * (1 - (1 - 1 / m.experts) ** pairs)  # experts hit at least once
    return c.roofline(
        2 * m.expert_params * pairs / devices, m.expert_params * c.weight_bytes * active / devices
    )


def transfer(m: MoEShape, c: Costs, rows: float, devices: int) -> float:
    """Dispatch + combine of ``rows`` (token, expert) rows of one device."""
    return 2 * (A2A_LATENCY_S + rows * m.hidden * KV_BYTES / c.link(devices))


def lm_head(m: MoEShape, c: Costs, seqs: float) -> float:
    p = m.vocab * m.hidden
    return c.roofline(2 * p * seqs, p * c.weight_bytes)


@dataclass(frozen=True)
class Estimate:
    """One layout at one batch: its decode step and what each device kind does."""

    layout: str
    gpus: int
    batch: int  # sequences decoding together
    step_ms: float
    tokens_per_s_per_gpu: float
    busy: dict[str, float]  # device kind -> share of the step it computes


def colocated(m: MoEShape, c: Costs, n: int, batch: int, overlap: bool) -> Estimate | None:
    """Colocated EP (data-parallel attention) on ``n`` devices; None if it does not fit."""
    seqs = batch / n
    weights = m.attn_params * m.layers + m.dense_side_params() + m.routed_params() / n
    if weights * c.weight_bytes + seqs * c.context * m.kv_bytes_per_token > c.usable:
        return None
    parts = 2 if overlap else 1
    ta = attention_side(m, c, seqs / parts)[0]
    te = experts_side(m, c, batch / parts, n)
    tc = transfer(m, c, seqs / parts * m.top_k, n)
    # Overlapped: one micro-batch's all-to-all runs while the other computes.
    period = max(parts * (ta + te), parts * tc) if overlap else ta + te + tc
    rest = m.dense_layers * attention_side(m, c, seqs)[1] + lm_head(m, c, seqs)
    step = m.moe_layers * period + rest + c.a.step_overhead_s
    compute = m.moe_layers * parts * (ta + te) + rest
    name = "colocated EP" + (", comm overlapped (2 micro-batches)" if overlap else "")
    return _estimate(name, n, batch, step, {"all": compute / step})


def disaggregated(m: MoEShape, c: Costs, na: int, nf: int, batch: int, mb: int) -> Estimate | None:
    """AFD: attention on ``na`` devices, experts on ``nf``, ``mb`` ping-pong micro-batches."""
    seqs = batch / na
    attention_weights = (m.attn_params * m.layers + m.dense_side_params()) * c.weight_bytes
    if attention_weights + seqs * c.context * m.kv_bytes_per_token > c.usable:
        return None
    if m.routed_params() / nf * c.weight_bytes > c.usable:
        return None
    ta = attention_side(m, c, seqs / mb)[0]
    te = experts_side(m, c, batch / mb, nf)
    rows = max(seqs / mb * m.top_k, batch / mb * m.top_k / nf)
    tc = transfer(m, c, rows, na + nf) / 2  # one direction
    # A micro-batch's round trip must fit the period; each group works mb times in it.
    period = max(mb * ta, mb * te, mb * tc, ta + te + 2 * tc)
    rest = m.dense_layers * attention_side(m, c, seqs)[1] + lm_head(m, c, seqs)
    step = m.moe_layers * period + rest + c.a.step_overhead_s
    busy = {
        "attention": (m.moe_layers * mb * ta + rest) / step,
        "experts": m.moe_layers * mb * te / step,
    }
    return _estimate(
        f"AFD {na} attention + {nf} expert, {mb} micro-batches", na + nf, batch, step, busy
    )


def _estimate(name: str, n: int, batch: int, step: float, busy: dict[str, float]) -> Estimate:
    return Estimate(
        name,
        n,
        batch,
        round(step * 1e3, 2),
        round(batch / step / n, 1),
        {k: round(v, 3) for k, v in busy.items()},
    )


def _batches() -> list[int]:
    out, b = [], 8.0
    while b <= 1 << 17:
        out.append(int(b))
        b *= 2**0.25
    return out


def best(candidates: list[Estimate | None], slo_ms: float) -> Estimate | None:
    """The highest per-device throughput among those within the step-time SLO."""
    ok = [e for e in candidates if e is not None and e.step_ms <= slo_ms]
    return max(ok, key=lambda e: e.tokens_per_s_per_gpu, default=None)


def estimate(m: MoEShape, c: Costs, n: int, slo_ms: float) -> dict[str, Any]:
    """Best colocated (both variants) and best AFD layout on ``n`` devices."""
    out: dict[str, Any] = {"gpus": n}
    for overlap in (False, True):
        e = best([colocated(m, c, n, b, overlap) for b in _batches()], slo_ms)
        out["colocated_overlap" if overlap else "colocated"] = asdict(e) if e else None
    afd = best(
        [
            disaggregated(m, c, na, n - na, b, mb)
            for na in range(1, n)
            for mb in (1, 2, 3, 4)
            for b in _batches()
        ],
        slo_ms,
    )
    out["afd"] = asdict(afd) if afd else None
    for base in ("colocated", "colocated_overlap"):
        if afd and out[base]:
            gain = afd.tokens_per_s_per_gpu / out[base]["tokens_per_s_per_gpu"]
            out[f"afd_vs_{base}"] = round(gain, 2)
    gains = [out[k] for k in ("afd_vs_colocated", "afd_vs_colocated_overlap") if k in out]
    if gains:
        out["afd_vs_best_colocated"] = min(gains)
    return out


def run(args: argparse.Namespace) -> int:
    return estimate_command(options_from(EstimateOptions, args))


def estimate_command(args: EstimateOptions) -> int:
    """The estimate at each device count; the report printed and written."""
    device = args.analytic.device or "h100"
    if not 0 < args.tpot_slo_ms < math.inf:
        raise InvalidArgumentError("tpot_slo_ms", f"must be > 0, got {args.tpot_slo_ms}")
    if min(args.gpus) < 2:  # AFD needs an attention device and an FFN device
        raise InvalidArgumentError("gpus", f"each count must be at least 2, got {args.gpus}")
    a = assumptions_from(args.analytic, None)
    c = Costs(DEVICES[device], a, args.weight_bytes, args.context, args.nvlink_domain)
    m = MoEShape()
    report = {
        "command": f"pdserve afd-estimate --device {device} "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in flat_options(args).items() if k in _FLAGS
        )
        + " "
        + " ".join(f"--gpus {g}" for g in args.gpus),
        "device": asdict(c.device),
        "assumptions": {
            **asdict(c.a),
            "weight_bytes": args.weight_bytes,
            "context": args.context,
            "tpot_slo_ms": args.tpot_slo_ms,
            "nvlink_domain": args.nvlink_domain,
        },
        "model": {
            **asdict(m),
            "params_b": round(
                (m.routed_params() + m.dense_side_params() + m.attn_params * m.layers) / 1e9, 1
            ),
        },
        "results": [estimate(m, c, n, args.tpot_slo_ms) for n in args.gpus],
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


_FLAGS = ("mfu", "mbu", "weight_bytes", "context", "tpot_slo_ms", "nvlink_domain")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "afd-estimate", help="GPU-scale AFD vs colocated EP decode estimate (DeepSeek-V3 shape)"
    )
    p.add_argument("--gpus", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--context", type=int, default=4096, help="tokens of each decoding sequence")
    p.add_argument("--weight-bytes", type=float, default=1.0, help="1: FP8 weights, 2: bf16")
    p.add_argument("--tpot-slo-ms", type=float, default=100.0, help="largest decode step")
    p.add_argument("--nvlink-domain", type=int, default=8, help="devices sharing NVLink")
    p.add_argument("--out", default="bench/out/afd_estimate.json")
    add_device_flags(p)
    p.set_defaults(func=run, prog="pdserve afd-estimate")
