"""Offline throughput: pdserve's engine against ``transformers.generate``, side by side.

    pdserve bench offline --model builtin:small

Two workloads on the same model, prompts and output lengths, in one run:

- ``batch1``: one request (128-token prompt, 128 new tokens);
- ``mix``: 32 requests with mixed prompt (32-512) and output (16-256) lengths.

The baseline is ``transformers``' ``generate`` with static batches (left-padded,
run until the batch's longest output). Only the tokens each request asked for
count as useful; the rest of a static batch is waste and is not credited.
Both run greedy in float32 on the same threads. Needs ``transformers``
(the ``test`` extra).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.report import write_json


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


def run_pdserve(
    model: str, work: Workload, prompts: list[list[int]], **engine: Any
) -> tuple[Measurement, list[list[int]]]:
    from pdserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", **engine)
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens
    ]
    llm.generate(prompts[0][:8], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    llm.engine.assert_idle()
    return Measurement("pdserve", work.name, seconds, work.useful_tokens), [
        o.outputs[0].token_ids for o in outputs
    ]


def run_transformers(
    folder: Path, work: Workload, prompts: list[list[int]], batch_size: int
) -> tuple[Measurement, list[list[int]]]:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit(
            "pdserve bench offline needs transformers: pip install 'pdserve[test]'"
        ) from e
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
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


def run(args: argparse.Namespace) -> int:
    from pdserve.core.builtin_models import resolve_model
    from pdserve.core.model_config import ModelConfig

    torch.manual_seed(0)
    folder = resolve_model(args.model)
    vocab = ModelConfig.from_dir(folder).vocab_size
    results: list[dict[str, Any]] = []
    for work in workloads(args.num_requests, args.seed):
        prompts = work.prompts(vocab, args.seed)
        ours, our_tokens = run_pdserve(args.model, work, prompts, max_num_seqs=args.max_num_seqs)
        base, base_tokens = run_transformers(folder, work, prompts, args.hf_batch_size)
        agree = sum(a == b for a, b in zip(our_tokens, base_tokens, strict=True))
        row = {
            "workload": work.name,
            "requests": len(prompts),
            "useful_tokens": work.useful_tokens,
            "pdserve_s": round(ours.seconds, 3),
            "pdserve_tok_s": round(ours.tokens_per_s, 1),
            "transformers_s": round(base.seconds, 3),
            "transformers_tok_s": round(base.tokens_per_s, 1),
            "speedup": round(ours.tokens_per_s / base.tokens_per_s, 2),
            "identical_outputs": f"{agree}/{len(prompts)}",
        }
        results.append(row)
        print(json.dumps(row))
    report = {
        "command": "pdserve bench offline "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in _flags(args).items()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "results": results,
    }
    if args.out:
        out = write_json(Path(args.out), report)
        print(f"wrote {out}")
    return 0


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(args).items()
        if k in ("model", "num_requests", "hf_batch_size", "seed", "max_num_seqs")
    }


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("offline", help="engine throughput vs transformers.generate")
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument(
        "--hf-batch-size", type=int, default=32, help="static batch size of the baseline"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/offline.json")
    p.set_defaults(func=run)


__all__ = ["Measurement", "Workload", "add_parser", "asdict", "run", "workloads"]
