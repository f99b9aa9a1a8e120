"""Attention-FFN disaggregation against colocated expert parallelism, same ranks.

    pdserve bench afd

A Mixtral-shaped checkpoint with random weights (``--hidden``, ``--experts``
...) is written once to a temporary folder; every layout serves it with the
same ranks and the same CPUs per rank, one after the other in this process:

- ``ep``: colocated, ``expert_parallel_size = ranks`` (each rank computes the
  attention of every token, the experts are split over the ranks), and the
  same with ``tensor_parallel_size = ranks`` (the attention split by heads);
- ``afd``: ``afd_attention_ranks`` + ``afd_expert_ranks`` = ranks, with
  ``--micro-batches`` ping-pong micro-batches, and the same without (one).

The workload is ``--batch`` prompts of ``--prompt-len`` tokens: one timed run
produces a single token (the prefill step), the next ``--decode-steps + 1``;
the median over ``--repeats`` such pairs of their difference over
``--decode-steps`` is the decode step time. Each rank's busy fraction is
(time running plans - time waiting for peers, ``CommStats``) / wall time of
the timed runs; a rank's waiting includes waiting for the other group (afd)
and for the slowest peer (ep).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.config import build_engine_config
from pdserve.core.model_config import ModelConfig
from pdserve.core.options import flat_options, options_from
from pdserve.core.sampling_params import SamplingParams
from pdserve.parallel.instance import RankGroup, RankResources
from pdserve.parallel.rank_spec import GenerateItem
from pdserve.parallel.worker import RankWorker


class TimedWorker(RankWorker):
    """A rank that also reports how long it spent running plans."""

    def busy(self) -> tuple[float, float]:
        """(seconds running plans, seconds of that waiting for peers) since start."""
        assert self.stage is not None and self.groups is not None
        return self.stage.run_seconds, self.groups.ctx.comm.seconds


@dataclass(frozen=True)
class MoeShapeFlags:
    """The MoE shape :func:`write_checkpoint` builds (:func:`add_model_flags`)."""

    hidden: int = 512  # hidden size
    inter: int = 1024  # each expert's intermediate size
    layers: int = 4  # decoder layers
    experts: int = 8  # experts per layer
    top_k: int = 2  # experts per token
    heads: int = 8  # attention heads (half as many KV heads)


@dataclass(frozen=True)
class AfdOptions:
    """``pdserve bench afd``'s options, in the order of its flags."""

    shape: MoeShapeFlags = field(default_factory=MoeShapeFlags)  # the model's shape
    ranks: int = 2  # ranks of every layout
    attention_ranks: int = 1  # afd: the rest hold experts
    micro_batches: int = 2  # afd: micro-batches of a step
    batch: int = 16  # prompts (sequences per step)
    prompt_len: int = 32  # tokens of each prompt
    decode_steps: int = 16  # decode steps timed
    repeats: int = 5  # prefill and decode runs (median)
    cpus: float = 2.0  # CPUs of all ranks together
    out: str = "bench/out/afd.json"  # the result file ("": none)


def write_checkpoint(folder: Path, args: MoeShapeFlags) -> None:
    """A Mixtral-shaped checkpoint with random weights (float32) in ``folder``."""
    h, inter, e, heads, kv = args.hidden, args.inter, args.experts, args.heads, args.heads // 2
    d, vocab = h // heads, 512
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_local_experts": e,
        "num_experts_per_tok": args.top_k,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 1e6,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    t = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h)}
    t["model.norm.weight"] = torch.ones(h)
    for i in range(args.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            t[p + f"self_attn.{name}_proj.weight"] = w(rows, h)
        t[p + "self_attn.o_proj.weight"] = w(h, heads * d)
        t[p + "block_sparse_moe.gate.weight"] = w(e, h)
        for x in range(e):
            q = p + f"block_sparse_moe.experts.{x}."
            t[q + "w1.weight"], t[q + "w3.weight"], t[q + "w2.weight"] = (
                w(inter, h),
                w(inter, h),
                w(h, inter),
            )
    tensors = {k: v.contiguous().clone() for k, v in t.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


def _layouts(args: AfdOptions) -> list[tuple[str, dict[str, Any]]]:
    a = args.attention_ranks
    f = args.ranks - a
    afd = dict(afd=True, afd_attention_ranks=a, afd_expert_ranks=f)
    return [
        (f"ep={args.ranks} (colocated)", dict(expert_parallel_size=args.ranks)),
        (
            f"tp={args.ranks} ep={args.ranks} (colocated)",
            dict(expert_parallel_size=args.ranks, tensor_parallel_size=args.ranks),
        ),
        (
            f"afd {a}+{f}, {args.micro_batches} micro-batches",
            dict(afd, afd_micro_batches=args.micro_batches),
        ),
        (f"afd {a}+{f}, 1 micro-batch", dict(afd, afd_micro_batches=1)),
    ]


def _generate(group: RankGroup, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    stamp = time.monotonic_ns()
    items = [GenerateItem(f"r{i}-{stamp}", p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    group.generate(items)
    return time.perf_counter() - start


def measure(folder: Path, parallel: dict[str, Any], args: AfdOptions) -> dict[str, Any]:
    """Prefill and decode step time of one layout, and each rank's busy fraction."""
    import ray

    model = ModelConfig.from_dir(folder)
    engine = build_engine_config(
        str(folder),
        max_num_batched_tokens=args.batch * args.prompt_len,
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
        **parallel,
    )
    res = RankResources(num_cpus=args.cpus / args.ranks)
    group = RankGroup.start(model, engine, res, worker_cls=TimedWorker)
    try:
        prompts = [
            [(7 * i + 13 * j) % 500 + 3 for j in range(args.prompt_len)] for i in range(args.batch)
        ]
        _generate(group, prompts, 2)  # warm-up
        prefill, decode, total = [], [], 0.0
        before = ray.get([w.busy.remote() for w in group.workers])
        for _ in range(args.repeats):  # back to back, so both see the same host load
            prefill.append(_generate(group, prompts, 1))
            full = _generate(group, prompts, args.decode_steps + 1)
            decode.append((full - prefill[-1]) / args.decode_steps)
            total += prefill[-1] + full
        after = ray.get([w.busy.remote() for w in group.workers])
        deltas = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
        return {
            "prefill_s": round(statistics.median(prefill), 4),
            "decode_step_ms": round(1e3 * statistics.median(decode), 2),
            "decode_step_ms_all": [round(1e3 * d, 2) for d in decode],
            "busy_fraction_by_rank": [round((run - wait) / total, 3) for run, wait in deltas],
            "waiting_fraction_by_rank": [round(wait / total, 3) for _, wait in deltas],
        }
    finally:
        group.shutdown()


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(AfdOptions, args))


def benchmark(args: AfdOptions) -> int:
    """Each layout measured on one checkpoint; the report printed and written."""
    import ray

    if args.ranks - args.attention_ranks < 1:
        raise SystemExit("--attention-ranks must leave at least one expert rank")
    if not ray.is_initialized():
        ray.init(num_cpus=max(1, int(args.cpus)), include_dashboard=False, log_to_driver=False)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, args.shape)
        for name, parallel in _layouts(args):
            results[name] = measure(folder, parallel, args)
    base = next(iter(results.values()))["decode_step_ms"]
    for r in results.values():
        r["decode_speedup_vs_ep"] = round(base / r["decode_step_ms"], 3)
    report = {
        "command": "pdserve bench afd "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in sorted(flat_options(args).items())
            if k in _FLAGS
        ),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "layouts": results,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        write_json(Path(args.out), report)
    return 0


_FLAGS = (
    "hidden",
    "inter",
    "layers",
    "experts",
    "top_k",
    "heads",
    "ranks",
    "attention_ranks",
    "micro_batches",
    "batch",
    "prompt_len",
    "decode_steps",
    "repeats",
    "cpus",
)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The MoE shape :func:`write_checkpoint` builds (shared with ``bench elastic``)."""
    p.add_argument("--hidden", type=count, default=512)
    p.add_argument("--inter", type=count, default=1024, help="each expert's intermediate size")
    p.add_argument("--layers", type=count, default=4)
    p.add_argument("--experts", type=count, default=8)
    p.add_argument("--top-k", type=count, default=2)
    p.add_argument("--heads", type=count, default=8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--ranks", type=count, default=2, help="ranks of every layout")
    p.add_argument("--attention-ranks", type=count, default=1, help="afd: the rest hold experts")
    p.add_argument("--micro-batches", type=count, default=2)
    p.add_argument("--batch", type=count, default=16, help="prompts (sequences per step)")
    p.add_argument("--prompt-len", type=count, default=32)
    p.add_argument("--decode-steps", type=count, default=16)
    p.add_argument("--repeats", type=count, default=5)
    p.add_argument("--cpus", type=float, default=2.0, help="CPUs of all ranks together")
    p.add_argument("--out", default="bench/out/afd.json")
    p.set_defaults(func=run)
