"""Offline throughput: pdserve's engine against ``transformers.generate``, side by side.

    pdserve bench offline --model builtin:small

Two workloads on the same model, prompts and output lengths, in one run:

- ``batch1``: one request (128-token prompt, 128 new tokens);
- ``mix``: 32 requests with mixed prompt (32-512) and output (16-256) lengths.

The baseline is ``transformers``' ``generate`` with static batches (left-padded,
run until the batch's longest output). Only the tokens each request asked for
count as useful; the rest of a static batch is waste and is not credited.
Both run greedy in the same dtype on the same threads. Needs ``transformers``
(the ``test`` extra).

``--dtype`` defaults to the fastest dtype this CPU runs natively: bfloat16
where it has AVX-512 BF16 or AMX, else float32 (see
:mod:`pdserve.kernels.cpu_features`). Several dtypes (``--dtype
float32,bfloat16``) run interleaved, ``--repeats`` rounds of each in turn, so
a shared machine's load hits them alike. The batch-1 run also reports its
decode step against the memory-bandwidth floor: the bytes one step reads
(every weight but the embedding table, plus the KV of the mean context) over
the read bandwidth measured in the same run (a sum over a large tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import flat_options, options_from


@dataclass(frozen=True)
class OfflineOptions:
    """``pdserve bench offline``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model of both systems
    dtype: str = "float32"  # dtypes, comma-separated (the flag's default: this CPU's fastest)
    repeats: int = 1  # rounds over the dtypes, interleaved
    num_requests: int = 32  # requests of the batched workloads
    hf_batch_size: int = 32  # static batch size of the baseline
    max_num_seqs: int = 64  # pdserve's running sequences
    seed: int = 0  # seeds the prompts
    out: str = "bench/out/offline.json"  # the result file ("": none)


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_lens: list[int]
    output_lens: list[int]

    def prompts(self, vocab_size: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in self.prompt_lens]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def workloads(num_requests: int, seed: int) -> list[Workload]:
    rng = random.Random(seed)
    return [
        Workload("batch1", [128], [128]),
        Workload(
            "mix",
            [rng.randint(32, 512) for _ in range(num_requests)],
            [rng.randint(16, 256) for _ in range(num_requests)],
        ),
    ]


@dataclass
class Measurement:
    system: str
    workload: str
    seconds: float
    useful_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """This machine's read bandwidth in bytes/s: the best of ``repeats`` sums over ``mib`` MiB."""
    x = torch.ones(mib << 18)  # float32: 2**18 elements per MiB
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


def decode_floor(llm: Any, outputs: list[Any], bandwidth: float) -> dict[str, float]:
    """Batch 1: the measured decode step against the bytes it must read over ``bandwidth``."""
    from pdserve.kernels.cpu_linear import duplicate_bytes

    runner = llm.engine.executor.runner
    out = outputs[0]
    n = len(out.outputs[0].token_ids)
    step = (out.metrics.finished_time - out.metrics.first_token_time) / (n - 1)
    embed = runner.model.embed
    # A step reads one copy of each weight (the GEMV's plain one or oneDNN's), the
    # embedding table only for its row.
    weights = runner.weights_bytes - duplicate_bytes(runner.model)
    weights -= 0 if embed is None else embed.weight.nbytes
    mean_context = len(out.prompt_token_ids) + n / 2
    kv = runner.bytes_per_block() / runner.block_size * mean_context
    floor = (weights + kv) / bandwidth
    return {
        "decode_step_ms": round(step * 1e3, 3),
        "bytes_per_step_mb": round((weights + kv) / 1e6, 2),
        "floor_ms": round(floor * 1e3, 3),
        "step_over_floor": round(step / floor, 1),
    }


def run_pdserve(
    model: str, work: Workload, prompts: list[list[int]], dtype: str, **engine: Any
) -> tuple[Measurement, list[Any], Any]:
    from pdserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **engine)
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens
    ]
    llm.generate(prompts[0][:8], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    llm.engine.assert_idle()
    return Measurement("pdserve", work.name, seconds, work.useful_tokens), outputs, llm


def run_transformers(
    folder: Path, work: Workload, prompts: list[list[int]], batch_size: int, dtype: str
) -> tuple[Measurement, list[list[int]]]:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit(
            "pdserve bench offline needs transformers: pip install 'pdserve[test]'"
        ) from e
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs: list[list[int]] = []
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            lens = work.output_lens[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
            )
            outputs.extend(
                row[width : width + n].tolist() for row, n in zip(gen, lens, strict=True)
            )
        seconds = time.perf_counter() - start
    return Measurement("transformers", work.name, seconds, work.useful_tokens), outputs


def compare(
    args: OfflineOptions,
    folder: Path,
    work: Workload,
    prompts: list[list[int]],
    dtype: str,
    bandwidth: float,
) -> dict[str, Any]:
    """One workload in one dtype: pdserve, then transformers, as a result row."""
    ours, outputs, llm = run_pdserve(
        args.model, work, prompts, dtype, max_num_seqs=args.max_num_seqs
    )
    our_tokens = [o.outputs[0].token_ids for o in outputs]
    base, base_tokens = run_transformers(folder, work, prompts, args.hf_batch_size, dtype)
    pairs = list(zip(our_tokens, base_tokens, strict=True))
    agree = sum(a == b for a, b in pairs)
    prefix = sum(_matching_prefix(a, b) for a, b in pairs) / sum(map(len, our_tokens))
    row: dict[str, Any] = {
        "dtype": dtype,
        "workload": work.name,
        "requests": len(prompts),
        "useful_tokens": work.useful_tokens,
        "pdserve_s": round(ours.seconds, 3),
        "pdserve_tok_s": round(ours.tokens_per_s, 1),
        "transformers_s": round(base.seconds, 3),
        "transformers_tok_s": round(base.tokens_per_s, 1),
        "speedup": round(ours.tokens_per_s / base.tokens_per_s, 2),
        "identical_outputs": f"{agree}/{len(prompts)}",
        "matching_prefix": round(prefix, 3),  # share of tokens before the first difference
    }
    if len(prompts) == 1:
        row.update(decode_floor(llm, outputs, bandwidth))
    return row


def _matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, workload), the repeat with the highest pdserve tok/s."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["dtype"], row["workload"])
        if key not in best or row["pdserve_tok_s"] > best[key]["pdserve_tok_s"]:
            best[key] = row
    return list(best.values())


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(OfflineOptions, args))


def benchmark(args: OfflineOptions) -> int:
    """Each workload in each dtype, pdserve against transformers; the report written."""
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model

    torch.manual_seed(0)
    folder = resolve_model(args.model)
    vocab = ModelConfig.from_dir(folder).vocab_size
    load_before = os.getloadavg()
    bandwidth = read_bandwidth()
    print(json.dumps({"read_bandwidth_gb_s": round(bandwidth / 1e9, 1)}))
    results: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for dtype in args.dtype.split(","):  # interleaved: load hits every dtype alike
            for work in workloads(args.num_requests, args.seed):
                row = {
                    "repeat": repeat,
                    **compare(args, folder, work, work.prompts(vocab, args.seed), dtype, bandwidth),
                }
                results.append(row)
                print(json.dumps(row))
    report = {
        "command": "pdserve bench offline "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in _flags(args).items()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "best": best_rows(results),
        "results": results,
    }
    if args.out:
        out = write_json(Path(args.out), report)
        print(f"wrote {out}")
    return 0


def _flags(args: OfflineOptions) -> dict[str, Any]:
    return {
        k: v
        for k, v in flat_options(args).items()
        if k
        in ("model", "num_requests", "hf_batch_size", "seed", "max_num_seqs", "dtype", "repeats")
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.kernels.cpu_features import fastest_cpu_dtype

    p.add_argument("--model", default="builtin:small")
    fastest = fastest_cpu_dtype()
    p.add_argument(
        "--dtype",
        default=fastest,
        help="dtype of both systems, or several comma-separated, run interleaved; default: "
        f"the fastest this CPU runs natively ({fastest} here: bfloat16 with AVX-512 BF16 "
        "or AMX, else float32)",
    )
    p.add_argument("--repeats", type=count, default=1, help="rounds over the dtypes, interleaved")
    p.add_argument("--num-requests", type=count, default=32)
    p.add_argument(
        "--hf-batch-size", type=count, default=32, help="static batch size of the baseline"
    )
    p.add_argument("--max-num-seqs", type=count, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/offline.json")
    p.set_defaults(func=run)


__all__ = ["Measurement", "Workload", "add_arguments", "asdict", "run", "workloads"]
