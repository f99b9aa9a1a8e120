"""A Llama-3-8B-shaped model on one GPU against its ceilings and a peer (CUDA only).

    pdserve bench gpu --out bench/out/gpu.json

Random weights built on the GPU (no checkpoint, no download). In one run:

- the ceilings: a plain device-to-device copy's bandwidth and a bf16 8192^3 matrix
  product's FLOP/s, both measured here;
- decode: one step (forward, logits, argmax) of ``b`` sequences of ``--context``
  cached tokens each, for each ``--batches`` b, run eagerly and replayed from a
  CUDA graph captured for that batch; the floor is reading every weight and the
  batch's KV once, over the copy bandwidth;
- prefill: one ``--prompt``-token sequence, its FLOPs (matrix products and causal
  attention) over the measured peak (MFU);
- the engine: ``--requests`` prompts of ``--prompt`` random tokens, ``--output``
  tokens each, through ``LLM.generate`` on that model (``load_format: dummy``), with
  decode steps replayed from CUDA graphs and launched eagerly: tokens/s and TTFT;
- the peer: the same model in ``transformers`` (bf16, sdpa): prefill of the same
  prompt, and a decode step from ``generate`` with a static cache ((time of
  ``1 + n`` new tokens - time of 1) / n at each batch), eager: ``generate`` would
  otherwise compile the model with torch.compile for every new shape, minutes a run.

Each part that fails is reported with its error and the rest still runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.flags import count
from pdserve.bench.kernels import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    VOCAB,
    copy_bandwidth,
    decode_step,
    median_ms,
    paged_meta,
    random_model,
)
from pdserve.bench.report import machine_info, write_json
from pdserve.core.options import flat_options, options_from

# Llama-3-8B's config.json, the shape of bench/kernels.py's model; `pdserve profile
# --load-format dummy` and the transformers peer read it.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# Matrix-product parameters a token meets (every layer's projections; the LM head is
# counted once per step, for the tokens whose logits are taken).
LAYER_PARAMS = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
LAYER_PARAMS += 3 * HIDDEN * INTER
H200_BF16_DATASHEET = 989e12
DEVICE = torch.device("cuda")


@dataclass(frozen=True)
class GpuOptions:
    """``pdserve bench gpu``'s options, in the order of its flags."""

    batches: list[int] = field(default_factory=lambda: [1, 16, 64, 256])  # decode batches
    context: int = 1024  # decode: cached tokens each
    prompt: int = 2048  # prefill: prompt tokens
    steps: int = 16  # peer decode: steps timed
    requests: int = 128  # engine: requests at once
    output: int = 128  # engine: tokens per request
    seed: int = 0  # seeds the weights and the prompts
    out: str = "bench/out/gpu.json"  # the result file


def write_config(folder: Path) -> Path:
    """A checkpoint folder holding only Llama-3-8B's ``config.json`` (for dummy loading)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B, indent=2) + "\n")
    return folder


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a bf16 8192^3 matrix product on random data."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    return 2 * 8192**3 / (median_ms(lambda: a @ b) / 1e3)


def prefill_flops(tokens: int) -> float:
    """Matrix products of ``tokens`` prompt tokens plus causal attention, one logits row."""
    linear = 2 * LAYERS * LAYER_PARAMS * tokens + 2 * HIDDEN * VOCAB
    attention = 2 * LAYERS * HEADS * HEAD_DIM * tokens * tokens  # QK^T and PV, half masked
    return float(linear + attention)


def graph_of(step: Callable[[], object]) -> Callable[[], object]:
    """``step`` captured in a CUDA graph (after warm-up runs on a side stream); its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def guarded(name: str, part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``part()``, or its error: one failing part does not stop the others."""
    start = time.perf_counter()
    try:
        row = part()
    except Exception as e:  # reported, never hidden: the row carries the traceback
        row = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    row = {"part": name, **row, "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    gc.collect()  # an engine's KV pool goes with its last reference, cycles included
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return row


@torch.no_grad()
def ours_decode(model: Any, batch: int, context: int, bandwidth: float) -> dict[str, Any]:
    step = decode_step(model, batch, context, torch.bfloat16, DEVICE)
    eager_ms = median_ms(step)
    row: dict[str, Any] = {"batch": batch, "context": context, "eager_ms": round(eager_ms, 3)}
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    weights -= (VOCAB - batch) * HIDDEN * 2  # of the embedding table a step reads its rows
    kv_bytes = batch * context * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    floor_ms = (weights + kv_bytes) / bandwidth * 1e3
    row.update(floor_ms=round(floor_ms, 3), eager_over_floor=round(eager_ms / floor_ms, 2))
    try:
        graph_ms = median_ms(graph_of(step))
        row.update(graph_ms=round(graph_ms, 3), graph_over_floor=round(graph_ms / floor_ms, 2))
    except Exception as e:  # a step that syncs with the host cannot be captured: say why
        row["graph_error"] = f"{type(e).__name__}: {e}"
    return row


@torch.no_grad()
def ours_prefill(model: Any, tokens: int, peak: float) -> dict[str, Any]:
    device = DEVICE
    meta, pages = paged_meta([tokens], [tokens], device)
    kv = torch.zeros(LAYERS, 2, pages, 16, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(LAYERS)]
    input_ids = torch.randint(0, VOCAB, (tokens,), device=device)
    positions = torch.arange(tokens, device=device)

    def step() -> torch.Tensor:
        hidden, _ = model(input_ids, positions, caches, meta)
        return model.compute_logits(hidden[-1:]).argmax(-1)

    ms = median_ms(step)
    return prefill_row(tokens, ms, peak)


def prefill_row(tokens: int, ms: float, peak: float) -> dict[str, Any]:
    flops = prefill_flops(tokens)
    return {
        "tokens": tokens,
        "ms": round(ms, 2),
        "tokens_per_s": round(tokens / ms * 1e3),
        "tflops": round(flops / ms / 1e9, 1),
        "mfu_vs_measured_peak": round(flops / (ms / 1e3) / peak, 3),
        "mfu_vs_datasheet": round(flops / (ms / 1e3) / H200_BF16_DATASHEET, 3),
    }


def peer_model() -> Any:
    import transformers

    config = transformers.LlamaConfig(**LLAMA3_8B)
    config._attn_implementation = "sdpa"
    with DEVICE:
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    for param in model.parameters():
        if param.dim() > 1:
            param.data.normal_(0.0, 0.02)
    return model.eval()


@torch.no_grad()
def peer_prefill(model: Any, tokens: int, peak: float) -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (1, tokens), device=DEVICE)
    ms = median_ms(lambda: model(ids, logits_to_keep=1, use_cache=False).logits)
    return prefill_row(tokens, ms, peak)


@torch.no_grad()
def peer_decode(model: Any, batch: int, context: int, steps: int) -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (batch, context), device=DEVICE)

    def generate(new: int) -> float:
        sync()
        start = time.perf_counter()
        model.generate(
            ids,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
            disable_compile=True,
        )
        sync()
        return time.perf_counter() - start

    one = generate(1)
    many = generate(1 + steps)
    return {"batch": batch, "context": context, "step_ms": round((many - one) / steps * 1e3, 3)}


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(GpuOptions, args))


def benchmark(args: GpuOptions) -> int:
    """The ceilings, our decode and prefill, the engine and the peer; the report written."""
    if not torch.cuda.is_available():
        raise SystemExit("pdserve bench gpu needs a CUDA GPU, and none is visible here")
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    bandwidth, peak = copy_bandwidth(device), matmul_peak(device)
    flags = [
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in flat_options(args).items()
        if k in _FLAGS
    ]
    report: dict[str, Any] = {
        "command": " ".join(["pdserve bench gpu", *flags]),
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name(device)},
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "bf16_matmul_tflops": round(peak / 1e12, 1),
    }
    print(json.dumps({k: report[k] for k in ("copy_bandwidth_gb_s", "bf16_matmul_tflops")}))
    report.update(ours_rows(args, bandwidth, peak))
    report["engine"] = [
        guarded(f"engine graphs={g}", partial(engine_row, args, g)) for g in (True, False)
    ]
    report["peer"] = guarded("peer", lambda: peer_rows(args, peak))
    out = write_json(Path(args.out), report)
    print(f"wrote {out}")
    return 0


def ours_rows(args: GpuOptions, bandwidth: float, peak: float) -> dict[str, Any]:
    model = random_model("triton", "triton", torch.bfloat16, DEVICE)
    return {
        "decode": [
            guarded(f"decode b={b}", partial(ours_decode, model, b, args.context, bandwidth))
            for b in args.batches
        ],
        "prefill": guarded("prefill", lambda: ours_prefill(model, args.prompt, peak)),
    }


def engine_row(args: GpuOptions, graphs: bool) -> dict[str, Any]:
    """Offline throughput of the whole engine on the 8B shape (random weights)."""
    import tempfile

    from pdserve import LLM, SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, VOCAB, (args.requests, args.prompt), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(
            str(write_config(Path(folder) / "llama3-8b")),
            load_format="dummy",
            dtype="bfloat16",
            device=DEVICE.type,
            cuda_graphs=graphs,
            max_num_seqs=args.requests,
            max_num_batched_tokens=8192,
        )
        try:
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            sync()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync()
            seconds = time.perf_counter() - start
        finally:
            llm.shutdown()
    ttft = sorted((o.metrics.first_token_time or 0.0) - o.metrics.arrival_time for o in outs)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "graphs": graphs,
        "requests": args.requests,
        "prompt": args.prompt,
        "output": args.output,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(out_tokens / seconds),
        "total_tokens_per_s": round((out_tokens + args.requests * args.prompt) / seconds),
        "ttft_p50_ms": round(ttft[len(ttft) // 2] * 1e3, 1),
        "ttft_max_ms": round(ttft[-1] * 1e3, 1),
    }


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def peer_rows(args: GpuOptions, peak: float) -> dict[str, Any]:
    model = peer_model()
    peer_decode(model, 1, 16, 2)  # warm-up
    rows: dict[str, Any] = {
        "prefill": guarded("peer prefill", lambda: peer_prefill(model, args.prompt, peak))
    }
    rows["decode"] = [
        guarded(f"peer decode b={b}", partial(peer_decode, model, b, args.context, args.steps))
        for b in args.batches
    ]
    return rows


_FLAGS = ("batches", "context", "prompt", "steps", "requests", "output", "seed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=count, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=count, default=1024, help="decode: cached tokens each")
    p.add_argument("--prompt", type=count, default=2048, help="prefill: prompt tokens")
    p.add_argument("--steps", type=count, default=16, help="peer decode: steps timed")
    p.add_argument("--requests", type=count, default=128, help="engine: requests at once")
    p.add_argument("--output", type=count, default=128, help="engine: tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/gpu.json")
    p.set_defaults(func=run)
