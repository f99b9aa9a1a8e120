"""Step time of multi-rank layouts against one rank, with the communication share.

    pdserve bench parallel --model builtin:small

Each layout gets the same CPUs in total (``--cpus``): one rank uses all of
them in-process; N ranks get ``cpus / N`` each as Ray actors. The workload is
``--batch`` prompts of ``--prompt-len`` tokens: one timed run produces a single
token (the prefill step), another ``--decode-steps + 1`` tokens; their
difference gives the decode step time. The communication share is the time
the leader spent in collectives and transfers (waiting for peers included)
over the wall time of the runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.report import write_json

LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(length)] for i in range(batch)]


def measure(model: str, tp: int, pp: int, args: argparse.Namespace) -> dict[str, Any]:
    from pdserve import LLM, SamplingParams

    world = tp * pp
    kwargs: dict[str, Any] = dict(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        dtype="float32",
        max_num_batched_tokens=args.batch * args.prompt_len,
        enable_prefix_caching=False,
    )
    if world > 1:
        kwargs["num_cpus_per_rank"] = args.cpus / world
    else:
        torch.set_num_threads(int(args.cpus))
    llm = LLM(model, **kwargs)
    prompts = _prompts(args.batch, args.prompt_len, llm.model_config.vocab_size)

    wall = 0.0

    def timed(n: int) -> float:
        nonlocal wall
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        elapsed = time.perf_counter() - start
        wall += elapsed
        return elapsed

    timed(2)  # warm-up
    wall = 0.0
    comm_before = _comm_seconds(llm)
    prefill = min(timed(1) for _ in range(args.repeats))
    full = min(timed(args.decode_steps + 1) for _ in range(args.repeats))
    comm = _comm_seconds(llm) - comm_before
    llm.shutdown()
    decode_step = (full - prefill) / args.decode_steps
    return {
        "layout": f"tp={tp} pp={pp}",
        "ranks": world,
        "prefill_step_s": round(prefill, 4),
        "decode_step_ms": round(decode_step * 1e3, 2),
        "comm_share": None if world == 1 else round(min(comm / wall, 1.0), 3),
    }


def _comm_seconds(llm: Any) -> float:
    if llm.instance is None:
        return 0.0
    import ray

    return float(ray.get(llm.instance.leader.comm_stats.remote()).seconds)


def run(args: argparse.Namespace) -> int:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=int(args.cpus), include_dashboard=False, log_to_driver=False)
    rows = []
    for tp, pp in LAYOUTS:
        row = measure(args.model, tp, pp, args)
        rows.append(row)
        print(json.dumps(row))
    base = rows[0]
    for row in rows[1:]:
        row["prefill_vs_1_rank"] = round(row["prefill_step_s"] / base["prefill_step_s"], 2)
        row["decode_vs_1_rank"] = round(row["decode_step_ms"] / base["decode_step_ms"], 2)
    report = {
        "command": f"pdserve bench parallel --model {args.model} --cpus {args.cpus} --batch {args.batch} "
        f"--prompt-len {args.prompt_len} --decode-steps {args.decode_steps}",
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "results": rows,
    }
    if args.out:
        write_json(Path(args.out), report)
        print(f"wrote {args.out}")
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("parallel", help="TP=2 and PP=2 step time against one rank")
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--cpus", type=float, default=2.0, help="CPUs for every layout in total")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench/out/parallel.json")
    p.set_defaults(func=run)
