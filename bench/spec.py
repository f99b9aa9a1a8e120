"""Speculative decoding against plain decoding, side by side in one run.

    pdserve bench spec --model builtin:pycode --methods none,ngram,draft,draft+rules

B greedy requests whose prompts are the first ``--prompt-tokens`` tokens of
Python standard-library files, at B = 1 and 16, with each of ``--methods``:
``none`` (speculation off); ``ngram`` (prompt lookup: ``--num-speculative-tokens``
drafts, n-grams of ``--lookup-min`` to ``--lookup-max`` tokens); ``draft`` (the
draft model ``--draft-model``, ``--draft-tokens`` drafts). A method
alone has the batch-size rule lifted so every batch drafts; ``+rules`` keeps
the engine's own turn-off rules (``speculative_max_batch``, ``speculative_min_acceptance``).
Decode tokens/s is ``B * (N - 1)`` over the time a run of N new tokens takes
beyond a run of 1 on the same prompts (prefix caching off), median of
``--repeats`` runs, the engines taking turns; ``decode_tok_per_cpu_s`` is the
same over this process's CPU time, steadier than wall time on a shared machine
(one torch thread). Acceptance rate is accepted / proposed drafts;
``tokens_per_verify`` is what a verifying row yields on average;
``same_tokens`` says whether the greedy outputs equal the plain run's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import options_from

_FILES = (
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "collections/__init__",
    "csv",
    "dataclasses",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "inspect",
    "json/decoder",
    "shutil",
    "textwrap",
)


@dataclass(frozen=True)
class SpecOptions:
    """``pdserve bench spec``'s options, in the order of its flags."""

    model: str = "builtin:pycode"  # the target model
    methods: str = "none,ngram,ngram+rules"  # comma-separated, starting with none
    draft_model: str = "builtin:pycode-draft"  # for method draft
    draft_tokens: int = 0  # drafts per step of method draft (0: as ngram)
    decode_tokens: int = 128  # new tokens per request
    prompt_tokens: int = 256  # prompt tokens per request
    num_speculative_tokens: int = 4  # drafts per step
    lookup_min: int = 2  # shortest n-gram looked up
    lookup_max: int = 4  # longest n-gram looked up
    batches: str = "1,16"  # batch sizes, comma-separated
    repeats: int = 3  # decode runs per batch (median)
    threads: int = 1  # torch threads
    out: str = "bench/out/spec.json"  # the result file


def stdlib_prompts(tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    """``tokens``-token pieces of standard-library files: each file's first, then its next."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for i in range(count):
        text = (root / f"{_FILES[i % len(_FILES)]}.py").read_text(encoding="utf-8")
        start = i // len(_FILES) * tokens
        prompts.append(tokenizer.encode(text)[start : start + tokens])
    return prompts


def _run(
    llm: Any, prompts: list[list[int]], new: int
) -> tuple[tuple[float, float], list[list[int]]]:
    """(wall seconds, CPU seconds of this process) of one run, and its tokens."""
    from pdserve import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    took = (time.perf_counter() - wall, time.process_time() - cpu)
    return took, [o.outputs[0].token_ids for o in outs]


_METHODS = ("none", "ngram", "ngram+rules", "draft", "draft+rules")


def _engine(args: SpecOptions, method: str, batch: int) -> Any:
    from pdserve import LLM

    options: dict[str, Any] = {"speculative_method": method.removesuffix("+rules")}
    if method in ("ngram", "draft"):  # lift the batch-size rule
        options["speculative_max_batch"] = batch
    k = args.num_speculative_tokens
    if method.startswith("draft"):
        options["speculative_draft_model"] = args.draft_model
        k = args.draft_tokens or k
    return LLM(
        args.model,
        enable_prefix_caching=False,
        num_speculative_tokens=k,
        prompt_lookup_min=args.lookup_min,
        prompt_lookup_max=args.lookup_max,
        **options,
    )


def measure(args: SpecOptions, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Each method's decode tokens/s and acceptance on one batch; runs alternate."""
    methods = args.methods.split(",")
    engines = {m: _engine(args, m, len(prompts)) for m in methods}
    for llm in engines.values():
        _run(llm, prompts, 2)  # warm-up
    new = len(prompts) * (args.decode_tokens - 1)
    rates: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for method, llm in engines.items():
            one, _ = _run(llm, prompts, 1)
            full, tokens[method] = _run(llm, prompts, args.decode_tokens)
            rates[method].append((new / (full[0] - one[0]), new / (full[1] - one[1])))
    rows = []
    median = {m: [statistics.median(r[i] for r in rates[m]) for i in (0, 1)] for m in methods}
    base_wall, base_cpu = median["none"]
    for method, llm in engines.items():
        llm.check_idle()
        stats = llm.engine.scheduler.spec.stats  # warm-up and 1-token runs draft nothing
        wall, cpu = median[method]
        rows.append(
            {
                "method": method,
                "batch": len(prompts),
                "decode_tok_s": round(wall, 1),
                "decode_tok_per_cpu_s": round(cpu, 1),
                "speedup": round(wall / base_wall, 2),
                "cpu_speedup": round(cpu / base_cpu, 2),
                "acceptance_rate": round(stats.acceptance_rate, 3) if stats.proposed else None,
                "tokens_per_verify": (
                    round((stats.steps + stats.accepted) / stats.steps, 2) if stats.steps else None
                ),
                "same_tokens": tokens[method] == tokens["none"],
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(SpecOptions, args))


def benchmark(args: SpecOptions) -> int:
    """Each method's rows at each batch size; written."""
    from pdserve.core.tokenizer import Tokenizer
    from pdserve.models.builtin import resolve_model

    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_dir(resolve_model(args.model))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = stdlib_prompts(tokenizer, batch, args.prompt_tokens)
        for row in measure(args, prompts):
            rows.append(row)
            print(json.dumps(row))
    payload = {
        "model": args.model,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": args.threads,
        "decode_tokens": args.decode_tokens,
        "prompt_tokens": args.prompt_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "lookup": [args.lookup_min, args.lookup_max],
        "draft_model": args.draft_model,
        "draft_tokens": args.draft_tokens or args.num_speculative_tokens,
        "rows": rows,
    }
    print(f"wrote {write_json(Path(args.out), payload)}")
    return 0


def _methods(value: str) -> str:
    names = value.split(",")
    if names[0] != "none" or not set(names) <= set(_METHODS) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"want none first, then some of {_METHODS}: {value!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:pycode")
    p.add_argument(
        "--methods",
        type=_methods,
        default="none,ngram,ngram+rules",
        help=f"comma-separated, starting with none; of {', '.join(_METHODS)}",
    )
    p.add_argument("--draft-model", default="builtin:pycode-draft", help="for method draft")
    p.add_argument(
        "--draft-tokens",
        type=count,
        default=0,
        help="drafts per step of method draft (0: as ngram)",
    )
    p.add_argument("--decode-tokens", type=count, default=128, help="new tokens per request")
    p.add_argument("--prompt-tokens", type=count, default=256)
    p.add_argument("--num-speculative-tokens", type=count, default=4)
    p.add_argument("--lookup-min", type=count, default=2, help="shortest n-gram looked up")
    p.add_argument("--lookup-max", type=count, default=4, help="longest n-gram looked up")
    p.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=count, default=3, help="decode runs per batch (median)")
    p.add_argument("--threads", type=count, default=1, help="torch threads")
    p.add_argument("--out", default="bench/out/spec.json")
    p.set_defaults(func=run)
