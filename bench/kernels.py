"""Triton kernels against the torch reference and the memory-bandwidth floor (CUDA only).

    pdserve bench kernels

Shapes are Llama-3-8B's: hidden 4096, 32 query and 8 KV heads of 128, intermediate
14336 (routing takes Mixtral's 8 experts, top 2). For each fused op and each
paged-attention kernel the report gives the median time of the Triton kernel and
of the torch reference, and the floor: the bytes the op must move at least,
divided by the bandwidth of a plain device-to-device copy measured on the same
GPU. Prefill attention is compute-bound, so its floor is a lower bound only.

Then a random-weight model of that shape (32 layers, no checkpoint) decodes a
batch with each kernel set; its tokens/s is set against the floor of reading
every weight and the batch's whole KV once per step. Kernels are benchmarked
through the modules that own them, not the public API.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import flat_options, options_from

if TYPE_CHECKING:
    from pdserve.kernels.attention.backend import AttentionMetadata
    from pdserve.kernels.attention.torch_ref import TorchAttention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
LAYERS, VOCAB, EXPERTS, TOP_K = 32, 128256, 8, 2
BLOCK_SIZE = 16
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class KernelsOptions:
    """``pdserve bench kernels``' options, in the order of its flags."""

    dtype: str = "bfloat16"  # the kernels' dtype: one of _DTYPES
    tokens: int = 4096  # rows of the row-wise ops
    batch: int = 64  # decode attention: sequences
    context: int = 4096  # decode attention: context each
    long_context: int = 32768  # one sequence, split-K
    prefill_chunk: int = 1024  # prefill attention: the chunk's tokens
    prefill_prefix: int = 1024  # prefill attention: cached tokens before it
    model_batch: int = 32  # 8B decode: sequences
    model_context: int = 2048  # 8B decode: context each
    seed: int = 0  # seeds the inputs
    out: str = "bench/out/kernels.json"  # the result file ("": none)


@dataclass
class Case:
    """One op at one shape: both implementations and the bytes it must move."""

    name: str
    shape: str
    nbytes: int
    triton: Callable[[], object]
    torch: Callable[[], object]


def median_ms(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` on the GPU, with the L2 cache flushed between runs."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a plain 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * src.numel() / seconds


def paged_meta(
    query_lens: list[int], seq_lens: list[int], device: torch.device
) -> tuple[AttentionMetadata, int]:
    """Attention metadata of one step over scattered pages, and the pages it needs."""
    from pdserve.kernels.attention.backend import AttentionMetadata

    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    order = torch.randperm(sum(blocks)).tolist()
    tables, slots, start = [], [], 0
    for qlen, n, b in zip(query_lens, seq_lens, blocks, strict=True):
        table = order[start : start + b]
        start += b
        tables.append(table + [0] * (max(blocks) - b))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - qlen, n)]

    def ints(values: list[int] | list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    decode = all(q == 1 for q in query_lens)
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    empty = torch.zeros((0, 0), dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=ints(slots, torch.int64),
        num_decode_tokens=len(seq_lens) if decode else 0,
        decode_seq_lens=ints(seq_lens if decode else []),
        decode_block_tables=ints(tables) if decode else empty,
        max_decode_seq_len=max(seq_lens) if decode else 0,
        prefill_query_start_loc=ints([0] if decode else starts),
        prefill_seq_lens=ints([] if decode else seq_lens),
        prefill_block_tables=empty if decode else ints(tables),
        prefill_query_lens_list=[] if decode else query_lens,
        prefill_seq_lens_list=[] if decode else seq_lens,
    )
    return meta, sum(blocks)


def layer_cases(tokens: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from pdserve.kernels import triton_ops
    from pdserve.kernels.torch_ops import TorchKernels

    fast, ref = triton_ops.TritonKernels(), TorchKernels()
    elem = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(tokens, HIDDEN, dtype=dtype, device=device)
    res, w = torch.randn_like(x), torch.ones(HIDDEN, dtype=dtype, device=device)
    gate_up = torch.randn(tokens, 2 * INTER, dtype=dtype, device=device)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    qk = qkv[:, : HEADS + KV_HEADS]
    cos = torch.rand(tokens, 1, HEAD_DIM // 2, dtype=dtype, device=device)
    sin = torch.rand_like(cos)
    logits = torch.randn(tokens, EXPERTS, dtype=dtype, device=device)
    qk_elems = tokens * (HEADS + KV_HEADS) * HEAD_DIM
    return [
        Case(
            "rms_norm_residual",
            f"[{tokens}, {HIDDEN}]",
            (4 * x.numel() + HIDDEN) * elem,
            lambda: fast.rms_norm_residual(x, res, w, 1e-5),
            lambda: ref.rms_norm_residual(x, res, w, 1e-5),
        ),
        Case(
            "silu_and_mul",
            f"[{tokens}, {2 * INTER}]",
            3 * tokens * INTER * elem,
            lambda: fast.silu_and_mul(gate_up),
            lambda: ref.silu_and_mul(gate_up),
        ),
        Case(
            "rotate",
            f"[{tokens}, {HEADS + KV_HEADS}, {HEAD_DIM}]",
            (2 * qk_elems + tokens * HEAD_DIM) * elem,
            lambda: fast.rotate(qk, cos, sin),
            lambda: ref.rotate(qk, cos, sin),
        ),
        Case(
            "route",
            f"[{tokens}, {EXPERTS}] top {TOP_K}",
            logits.numel() * elem + tokens * TOP_K * (4 + 8),
            lambda: fast.route(logits, TOP_K),
            lambda: ref.route(logits, TOP_K),
        ),
    ]


def attention_cases(args: KernelsOptions, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """Paged decode attention (a batch, then one long sequence), prefill attention, KV writes."""
    from pdserve.kernels.attention import torch_ref

    ref = torch_ref.TorchAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    cases = [
        decode_attention_case(batch, context, dtype, device, ref)
        for batch, context in [(args.batch, args.context), (1, args.long_context)]
    ]
    return cases + prefill_cases(args.prefill_chunk, args.prefill_prefix, dtype, device, ref)


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def decode_attention_case(
    batch: int, context: int, dtype: torch.dtype, device: torch.device, ref: TorchAttention
) -> Case:
    """Paged decode attention over ``batch`` sequences of ``context`` tokens each."""
    from pdserve.kernels import decode_attention

    elem = _element_size(dtype)
    kv_row = KV_HEADS * HEAD_DIM * elem  # one token's K (or V) in one layer
    meta, pages = paged_meta([1] * batch, [context] * batch, device)
    cache = torch.randn(2, pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device=device)

    def fast() -> object:
        return decode_attention.paged_decode_attention(
            q,
            cache[0],
            cache[1],
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.max_decode_seq_len,
            ref.scale,
        )

    def slow() -> object:
        out = torch.empty_like(q)
        ref.decode(q, cache[0], cache[1], meta, out)
        return out

    nbytes = 2 * batch * context * kv_row + 2 * q.numel() * elem
    return Case("decode_attention", f"{batch} x {context} ctx", nbytes, fast, slow)


def prefill_cases(
    chunk: int, prefix: int, dtype: torch.dtype, device: torch.device, ref: TorchAttention
) -> list[Case]:
    """Paged prefill attention of 4 chunks after ``prefix`` cached tokens, and their KV write."""
    from pdserve.kernels import kv_cache, prefill_attention
    from pdserve.kernels.attention import torch_ref

    elem = _element_size(dtype)
    kv_row = KV_HEADS * HEAD_DIM * elem  # one token's K (or V) in one layer
    chunks = 4
    meta, pages = paged_meta([chunk] * chunks, [prefix + chunk] * chunks, device)
    cache = torch.randn(2, pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    qkv = torch.randn(chunk * chunks, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    out = torch.empty_like(q)
    return [
        Case(
            "prefill_attention",
            f"{chunks} x {chunk} after {prefix}",
            2 * chunks * (prefix + chunk) * kv_row + 2 * q.numel() * elem,
            lambda: prefill_attention.paged_prefill_attention(
                q,
                cache[0],
                cache[1],
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_seq_lens,
                chunk,
                ref.scale,
                out=out,
            ),
            lambda: ref.prefill(q, k, v, cache[0], cache[1], meta, out),
        ),
        Case(
            "write_kv",
            f"{chunk * chunks} tokens",
            4 * chunk * chunks * kv_row,
            lambda: kv_cache.write_kv(k, v, cache[0], cache[1], meta.slot_mapping),
            lambda: torch_ref.write_kv(k, v, cache[0], cache[1], meta.slot_mapping),
        ),
    ]


def time_case(case: Case, bandwidth: float) -> dict[str, Any]:
    triton_ms, torch_ms = median_ms(case.triton), median_ms(case.torch)
    floor_ms = case.nbytes / bandwidth * 1e3
    return {
        "kernel": case.name,
        "shape": case.shape,
        "triton_us": round(triton_ms * 1e3, 1),
        "torch_us": round(torch_ms * 1e3, 1),
        "floor_us": round(floor_ms * 1e3, 1),
        "speedup_vs_torch": round(torch_ms / triton_ms, 2),
        "share_of_floor": round(floor_ms / triton_ms, 2),
    }


def random_model(kernels: str, attention: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The 8B-shaped model with random weights, its layers built on ``kernels``."""
    from pdserve.core.model_config import ModelConfig, RopeConfig
    from pdserve.distributed.context import SINGLE_RANK
    from pdserve.kernels import select_kernels
    from pdserve.kernels.attention import select_backend
    from pdserve.models.families import build_model

    config = ModelConfig(
        path="random",
        architecture="LlamaForCausalLM",
        family="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0),
        tie_word_embeddings=False,
        attention_bias=False,
        dtype="bfloat16",
    )
    with torch.device(device):
        model = build_model(
            config,
            SINGLE_RANK,
            dtype,
            (0, LAYERS),
            select_backend(attention, device),
            select_kernels(kernels, device),
        )
    for param in model.parameters():
        if param.dim() > 1:  # projections and embeddings; norms stay at one
            param.data.normal_(0.0, 0.02)
    return model.eval()


def decode_step(
    model: Any, batch: int, context: int, dtype: torch.dtype, device: torch.device
) -> Callable[[], torch.Tensor]:
    """One decode step of ``batch`` sequences of ``context`` cached tokens on scattered
    pages (forward, logits, argmax), its inputs made once."""
    meta, pages = paged_meta([1] * batch, [context] * batch, device)
    kv = torch.zeros(LAYERS, 2, pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(LAYERS)]
    input_ids = torch.randint(0, VOCAB, (batch,), device=device)
    positions = torch.full((batch,), context - 1, device=device)

    def step() -> torch.Tensor:
        hidden, _ = model(input_ids, positions, caches, meta)
        return model.compute_logits(hidden).argmax(-1)

    return step


@torch.no_grad()
def decode_throughput(
    args: KernelsOptions,
    kernels: str,
    dtype: torch.dtype,
    device: torch.device,
    bandwidth: float,
) -> dict[str, Any]:
    model = random_model(kernels, kernels, dtype, device)
    batch, context = args.model_batch, args.model_context
    step_ms = median_ms(decode_step(model, batch, context, dtype, device))
    elem = torch.tensor([], dtype=dtype).element_size()
    # Every weight once, except the embedding table, of which a step reads one row per token.
    weight_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not n.startswith("embed.")
    )
    weight_bytes += batch * HIDDEN * elem
    kv_bytes = batch * context * LAYERS * 2 * KV_HEADS * HEAD_DIM * elem
    floor_s = (weight_bytes + kv_bytes) / bandwidth
    return {
        "kernels": kernels,
        "batch": batch,
        "context": context,
        "step_ms": round(step_ms, 2),
        "tokens_per_s": round(batch / step_ms * 1e3, 1),
        "floor_tokens_per_s": round(batch / floor_s, 1),
        "share_of_floor": round(floor_s * 1e3 / step_ms, 2),
    }


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(KernelsOptions, args))


def benchmark(args: KernelsOptions) -> int:
    """Each kernel against torch and the floor, and the 8B decode step; the report written."""
    if not torch.cuda.is_available():
        raise SystemExit(
            "pdserve bench kernels needs a CUDA GPU: the Triton kernels it times run on the "
            "GPU only, and no CUDA device is visible here"
        )
    from pdserve.kernels.support import INTERPRETED

    if INTERPRETED:
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's timings mean nothing")
    torch.manual_seed(args.seed)
    device, dtype = torch.device("cuda"), _DTYPES[args.dtype]
    bandwidth = copy_bandwidth(device)
    print(json.dumps({"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)}))
    kernels = []
    for case in layer_cases(args.tokens, dtype, device) + attention_cases(args, dtype, device):
        kernels.append(time_case(case, bandwidth))
        print(json.dumps(kernels[-1]))
    models = []
    for name in ("torch", "triton"):
        models.append(decode_throughput(args, name, dtype, device, bandwidth))
        torch.cuda.empty_cache()  # the model and its KV are gone: give their memory back
        print(json.dumps(models[-1]))
    report = {
        "command": "pdserve bench kernels "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in flat_options(args).items() if k in _FLAGS
        ),
        "machine": f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
        f"{platform.machine()}",
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "kernels": kernels,
        "decode_8b": models,
    }
    if args.out:
        out = write_json(Path(args.out), report)
        print(f"wrote {out}")
    return 0


_FLAGS = (
    "dtype",
    "tokens",
    "batch",
    "context",
    "long_context",
    "prefill_chunk",
    "prefill_prefix",
    "model_batch",
    "model_context",
    "seed",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--tokens", type=count, default=4096, help="rows of the row-wise ops")
    p.add_argument("--batch", type=count, default=64, help="decode attention: sequences")
    p.add_argument("--context", type=count, default=4096, help="decode attention: context each")
    p.add_argument("--long-context", type=count, default=32768, help="one sequence, split-K")
    p.add_argument("--prefill-chunk", type=count, default=1024)
    p.add_argument("--prefill-prefix", type=int, default=1024, help="cached tokens before it")
    p.add_argument("--model-batch", type=count, default=32, help="8B decode: sequences")
    p.add_argument("--model-context", type=count, default=2048, help="8B decode: context each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/kernels.json")
    p.set_defaults(func=run)
