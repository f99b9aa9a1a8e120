"""Step time of multi-rank layouts against one rank, with the communication share.

    pdserve bench parallel --model builtin:small

Each layout gets the same CPUs in total (``--cpus``): one rank uses all of
them in-process; N ranks get ``cpus / N`` each as Ray actors. The workload is
``--batch`` prompts of ``--prompt-len`` tokens: one timed run produces a single
token (the prefill step), another ``--decode-steps + 1`` tokens; their
difference gives the decode step time. Beside it, ``decode_median_ms`` and
``prefill_median_s`` are the median times of the decode and prefill steps the
engine timed itself (its executor's :class:`~pdserve.parallel.executor.StepTimes`,
scheduling and sampling left out); a busy spell on the host moves a median far
less than a difference of two runs. The communication share is the time
the leader spent in collectives and transfers (waiting for peers included)
over the wall time of the runs.

Every multi-rank layout runs twice, with its collectives over shared memory
(``shm``, the default on one host) and over gloo (``PDSERVE_SHM_COLLECTIVES=0``),
so both compare against the same one-rank baseline of the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import options_from
from pdserve.parallel.executor import StepTimes
from pdserve.parallel.rank_spec import SHM_COLLECTIVES_ENV as ENV_SWITCH

# name -> (tp, pp, collectives): "-" is the one-rank baseline, always run first.
LAYOUTS = {
    "1": (1, 1, "-"),
    "tp2": (2, 1, "shm"),
    "tp2-gloo": (2, 1, "gloo"),
    "pp2": (1, 2, "shm"),
    "pp2-gloo": (1, 2, "gloo"),
}


@dataclass(frozen=True)
class ParallelOptions:
    """``pdserve bench parallel``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model of every layout
    cpus: float = 2.0  # CPUs for every layout in total
    batch: int = 16  # prompts of a step
    prompt_len: int = 128  # tokens of each prompt
    decode_steps: int = 32  # decode steps timed
    repeats: int = 2  # prefill and decode runs per layout (best kept)
    rounds: int = 1  # passes over every layout (best kept)
    layouts: list[str] = field(default_factory=lambda: list(LAYOUTS))  # layouts to run
    settle_s: float = 5.0  # pause after Ray starts and after each layout
    out: str = "bench/out/parallel.json"  # the result file ("": none)


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(length)] for i in range(batch)]


def measure(
    model: str, tp: int, pp: int, collectives: str, args: ParallelOptions
) -> dict[str, Any]:
    from pdserve import SamplingParams

    world = tp * pp
    llm = _start(model, tp, pp, collectives, args)
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
    warm = len(_step_times(llm).steps)
    comm_before = _comm_seconds(llm)
    # Alternate the two runs, so a busy spell on the host slows both kinds.
    runs = [(timed(1), timed(args.decode_steps + 1)) for _ in range(args.repeats)]
    comm = _comm_seconds(llm) - comm_before
    steps = StepTimes(steps=deque(list(_step_times(llm).steps)[warm:]))
    llm.shutdown()
    time.sleep(args.settle_s)  # let Ray replace the killed rank processes before the next layout
    return _row(
        {
            "layout": f"tp={tp} pp={pp}",
            "collectives": collectives,
            "ranks": world,
            "prefill_s": min(r[0] for r in runs),
            "full_s": min(r[1] for r in runs),
            "comm_share": None if world == 1 else round(min(comm / wall, 1.0), 3),
            "decode_median_ms": _ms(steps.median(args.batch)),
            "prefill_median_s": steps.median(args.batch * args.prompt_len),
        },
        args.decode_steps,
    )


def _start(model: str, tp: int, pp: int, collectives: str, args: ParallelOptions) -> Any:
    """The layout's LLM, on ``args.cpus`` CPUs in all."""
    from pdserve import LLM

    kwargs: dict[str, Any] = dict(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        dtype="float32",
        max_num_batched_tokens=args.batch * args.prompt_len,
        enable_prefix_caching=False,
    )
    if tp * pp > 1:
        kwargs["num_cpus_per_rank"] = args.cpus / (tp * pp)
    else:
        torch.set_num_threads(int(args.cpus))
    with _switch(collectives):
        return LLM(model, **kwargs)


def _row(row: dict[str, Any], decode_steps: int) -> dict[str, Any]:
    """Derive the prefill and decode step times from the fastest runs of each kind."""
    decode_step = (row["full_s"] - row["prefill_s"]) / decode_steps
    row["prefill_step_s"] = round(row["prefill_s"], 4)
    row["decode_step_ms"] = round(decode_step * 1e3, 2)
    return row


@contextmanager
def _switch(collectives: str) -> Iterator[None]:
    """Set the shared-memory switch while the ranks are built (they read it then)."""
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "0" if collectives == "gloo" else "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


def _step_times(llm: Any) -> StepTimes:
    """The step times the engine's executor kept (the leader's, for several ranks)."""
    if llm.instance is None:
        times: StepTimes = llm.backend.engine.executor.step_times
        return times
    import ray

    times = ray.get(llm.instance.leader.step_times.remote())
    return StepTimes(steps=times.steps)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _comm_seconds(llm: Any) -> float:
    if llm.instance is None:
        return 0.0
    import ray

    return float(ray.get(llm.instance.leader.comm_stats.remote()).seconds)


def _best(rows: list[dict[str, Any]], decode_steps: int) -> dict[str, Any]:
    """One layout's rounds: the fastest runs of each kind (and the comm share of the fastest)."""
    best = dict(min(rows, key=lambda r: r["full_s"]))
    best["prefill_s"] = min(r["prefill_s"] for r in rows)
    for key in ("decode_median_ms", "prefill_median_s"):
        medians = [r[key] for r in rows if r[key] is not None]
        best[key] = min(medians) if medians else None
    return _row(best, decode_steps)


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(ParallelOptions, args))


def benchmark(args: ParallelOptions) -> int:
    """Every layout, in rounds, against one rank; the report written."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=int(args.cpus), include_dashboard=False, log_to_driver=False)
        time.sleep(args.settle_s)  # Ray starts its worker pool: not while the baseline runs
    layouts = [LAYOUTS["1"]] + [LAYOUTS[name] for name in args.layouts if name != "1"]
    rounds: list[list[dict[str, Any]]] = []
    for _ in range(args.rounds):  # interleaved, so a busy spell on the host hits every layout
        rounds.append([])
        for tp, pp, collectives in layouts:
            rounds[-1].append(measure(args.model, tp, pp, collectives, args))
            print(json.dumps(rounds[-1][-1]), flush=True)
    rows = [_best(list(same), args.decode_steps) for same in zip(*rounds, strict=True)]
    base = rows[0]
    for row in rows[1:]:
        row["prefill_vs_1_rank"] = round(row["prefill_step_s"] / base["prefill_step_s"], 2)
        row["decode_vs_1_rank"] = round(row["decode_step_ms"] / base["decode_step_ms"], 2)
        if row["decode_median_ms"] and base["decode_median_ms"]:
            ratio = row["decode_median_ms"] / base["decode_median_ms"]
            row["decode_median_vs_1_rank"] = round(ratio, 3)
    report = {
        "command": f"pdserve bench parallel --model {args.model} --cpus {args.cpus} --batch {args.batch} "
        f"--prompt-len {args.prompt_len} --decode-steps {args.decode_steps} --repeats {args.repeats} --rounds {args.rounds} "
        f"--layouts {' '.join(args.layouts)}",
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "results": rows,
    }
    if args.out:
        write_json(Path(args.out), report)
        print(f"wrote {args.out}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--cpus", type=float, default=2.0, help="CPUs for every layout in total")
    p.add_argument("--batch", type=count, default=16)
    p.add_argument("--prompt-len", type=count, default=128)
    p.add_argument("--decode-steps", type=count, default=32)
    p.add_argument("--repeats", type=count, default=2)
    p.add_argument("--rounds", type=count, default=1, help="passes over every layout; best kept")
    p.add_argument(
        "--layouts",
        nargs="+",
        choices=list(LAYOUTS),
        default=list(LAYOUTS),
        help="layouts to run (the one-rank baseline always runs)",
    )
    p.add_argument(
        "--settle-s", type=float, default=5.0, help="pause after Ray starts and after each layout"
    )
    p.add_argument("--out", default="bench/out/parallel.json")
    p.set_defaults(func=run)
