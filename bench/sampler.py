"""What penalties cost the sampler per step, against the same rows without them.

    pdserve bench sampler [--batch 1 16 64] [--vocab 32000 128256] [--context 1024]

A decode batch of B greedy rows over a vocabulary of V tokens steps ``--steps``
times through :class:`~pdserve.parallel.sampler.Sampler` as a rank runs it:
``plain`` rows, and ``penalised`` rows (presence, frequency and repetition
penalties) whose requests start with ``--context`` prompt tokens and carry one
new token a step after the first, as the scheduler sends them. The two
alternate round by round in one process, so load on the machine hits both; the
figures are the best round's mean per step, and their ratio. The first step of a
penalised row (its prompt sent whole) is timed apart: it is paid once a request.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.flags import count, file_stem
from pdserve.bench.report import header, write_json
from pdserve.core.options import options_from
from pdserve.core.step import RowSampling
from pdserve.parallel.sampler import Sampler

PENALTIES = (0.5, 0.5, 1.1)


@dataclass(frozen=True)
class SamplerOptions:
    """``pdserve bench sampler``'s options, in the order of its flags."""

    batch: list[int] = field(default_factory=lambda: [1, 16, 64])  # batch sizes
    vocab: list[int] = field(default_factory=lambda: [32000, 128256])  # vocabulary sizes
    context: int = 1024  # prompt tokens of each request
    steps: int = 50  # steps per round
    repeat: int = 3  # rounds of each
    threads: int = 1  # torch threads
    out: str = "bench/out"  # output folder
    name: str = "sampler"  # output file stem


def _rows(batch: int, context: int, step: int, vocab: int, rng: random.Random) -> list[RowSampling]:
    if step < 0:
        return [RowSampling() for _ in range(batch)]
    if step == 0:
        return [
            RowSampling(
                penalties=PENALTIES,
                seen=[rng.randrange(vocab) for _ in range(context)],
                num_seen_prompt=context,
            )
            for _ in range(batch)
        ]
    return [
        RowSampling(
            penalties=PENALTIES,
            seen=[rng.randrange(vocab)],
            seen_from=context + step - 1,
            num_seen_prompt=context,
        )
        for _ in range(batch)
    ]


def measure(batch: int, vocab: int, context: int, steps: int, penalised: bool) -> dict[str, float]:
    """Mean seconds per step (and of the first step, for penalised rows)."""
    rng = random.Random(0)
    logits = torch.randn(batch, vocab)
    ids = [f"r{i}" for i in range(batch)]
    sampler = Sampler()
    plans = [_rows(batch, context, s if penalised else -1, vocab, rng) for s in range(steps + 1)]
    start = time.perf_counter()
    sampler(logits, plans[0], ids)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for rows in plans[1:]:
        sampler(logits, rows, ids)
    return {"step_s": (time.perf_counter() - start) / steps, "first_step_s": first}


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(SamplerOptions, args))


def benchmark(args: SamplerOptions) -> int:
    """Each batch and vocabulary, plain and penalised, timed; written and printed."""
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for vocab in args.vocab:
        for batch in args.batch:
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.repeat):
                for kind in ("plain", "penalised"):
                    got = measure(batch, vocab, args.context, args.steps, kind == "penalised")
                    if kind not in best or got["step_s"] < best[kind]["step_s"]:
                        best[kind] = got
            plain, penalised = best["plain"]["step_s"] * 1e3, best["penalised"]["step_s"] * 1e3
            rows.append(
                {
                    "vocab": vocab,
                    "batch": batch,
                    "plain_ms": plain,
                    "penalised_ms": penalised,
                    "ratio": penalised / plain,
                    "first_step_ms": best["penalised"]["first_step_s"] * 1e3,
                }
            )
    command = (
        f"pdserve bench sampler --batch {' '.join(map(str, args.batch))} --vocab "
        f"{' '.join(map(str, args.vocab))} --context {args.context} --steps {args.steps} "
        f"--repeat {args.repeat} --threads {args.threads}"
    )
    path = write_json(Path(args.out) / f"{args.name}.json", {**header(command), "rows": rows})
    print(table(rows, args.context))
    print(f"wrote {path}")
    return 0


def table(rows: list[dict[str, Any]], context: int) -> str:
    lines = [
        f"| vocab | batch | plain ms | penalised ms | first step ms ({context}-token prompts) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['batch']} | {r['plain_ms']:.3f} | "
            f"{r['penalised_ms']:.3f} ({r['ratio']:.2f}x) | {r['first_step_ms']:.3f} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=count, nargs="+", default=[1, 16, 64])
    p.add_argument("--vocab", type=count, nargs="+", default=[32000, 128256])
    p.add_argument("--context", type=count, default=1024, help="prompt tokens of each request")
    p.add_argument("--steps", type=count, default=50, help="steps per round")
    p.add_argument("--repeat", type=count, default=3, help="rounds of each (best kept)")
    p.add_argument("--threads", type=count, default=1, help="torch threads (a rank's share)")
    p.add_argument("--out", default="bench/out")
    p.add_argument("--name", type=file_stem, default="sampler")
    p.set_defaults(func=run)
