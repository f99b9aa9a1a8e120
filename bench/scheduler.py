"""The engine scheduler's own cost per step: ``Scheduler.schedule`` and ``update``.

    pdserve bench scheduler [--batch 21 64 256] [--baseline DIR]

A steady decode batch of B requests (prompts of 1,000-1,000+B tokens, 16-token
blocks, no prefix caching, nothing stops within the run) steps ``--steps``
times: the figures are the mean time of ``schedule()`` and of ``update()`` per
step, the best of ``--repeat`` rounds, and their sum per row of the batch. This
is the host time a live engine spends per step before and after the forward
pass, and what the simulator pays at every batch change.

Each measurement runs in a child process. With ``--baseline DIR`` (a checkout
or ``git archive`` export of another pdserve tree) the child of every other
round imports that tree instead, so the two are measured alternately on the
same machine, and the table gives each figure as this tree / the baseline.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.core.options import options_from

# A child runs this file against a baseline tree (PYTHONPATH), so nothing of pdserve
# is imported at module level: an older tree may lack what this one has.
CHILD_FLAG = "--child"


@dataclass(frozen=True)
class SchedulerOptions:
    """``pdserve bench scheduler``'s options, in the order of its flags."""

    batch: list[int] = field(default_factory=lambda: [21, 64, 256])  # batch sizes
    steps: int = 2000  # steps per round
    repeat: int = 3  # rounds per batch size
    baseline: str | None = None  # a pdserve source tree measured alternately with this one
    out: str = "bench/out"  # output folder
    name: str = "scheduler"  # output file stem


def measure(batch: int, steps: int) -> tuple[float, float]:
    """Mean seconds of schedule() and of update() per step on a steady decode batch."""
    from pdserve.core.config import SchedulerConfig
    from pdserve.core.request import Request
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.kv_cache_manager import KVCacheManager
    from pdserve.engine.scheduler import Scheduler

    kv = KVCacheManager(batch * (1100 + batch + steps) // 16 + batch, 16, False)
    config = SchedulerConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=max(batch, 8192))
    scheduler = Scheduler(config, kv, 1 << 20)
    params = SamplingParams(max_tokens=1 << 19, ignore_eos=True)
    for i in range(batch):
        request = Request(f"r{i}", list(range(1000 + i)), params, (), 0.0)
        assert scheduler.reserve(request) is not None, "the pool is too small for the batch"
        scheduler.activate(request.request_id, 7)
    sampled = {f"r{i}": 7 for i in range(batch)}
    schedule_s = update_s = 0.0
    enabled = gc.isenabled()
    gc.disable()  # a collection inside one step would land on whichever call runs then
    try:
        for _ in range(steps):
            start = time.perf_counter()
            plan = scheduler.schedule()
            mid = time.perf_counter()
            scheduler.update(plan, sampled)
            schedule_s += mid - start
            update_s += time.perf_counter() - mid
    finally:
        if enabled:
            gc.enable()
    assert len(plan.seqs) == batch, "the batch did not stay whole"
    return schedule_s / steps, update_s / steps


def _child(argv: list[str]) -> None:
    from pdserve.engine import scheduler

    batch, steps = int(argv[0]), int(argv[1])
    print(json.dumps([*measure(batch, steps), scheduler.__file__]))


def _run_child(batch: int, steps: int, tree: str | None) -> tuple[float, float]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, str(batch), str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    schedule_s, update_s, source = json.loads(out.stdout.strip().splitlines()[-1])
    if tree is not None and not source.startswith(tree):
        raise RuntimeError(f"the baseline run imported {source}, not the tree under {tree}")
    return float(schedule_s), float(update_s)


def compare(
    batches: list[int], steps: int, repeat: int, baseline: str | None
) -> list[dict[str, Any]]:
    """Per batch size: the best round of this tree (and of the baseline tree)."""
    rows = []
    for batch in batches:
        runs: dict[str, list[tuple[float, float]]] = {"this": [], "baseline": []}
        for _ in range(repeat):
            runs["this"].append(_run_child(batch, steps, None))
            if baseline is not None:
                runs["baseline"].append(_run_child(batch, steps, baseline))
        row: dict[str, Any] = {"batch": batch}
        for name, got in runs.items():
            if got:
                schedule_s, update_s = min(got, key=sum)
                row[name] = {
                    "schedule_us": schedule_s * 1e6,
                    "update_us": update_s * 1e6,
                    "per_row_us": (schedule_s + update_s) * 1e6 / batch,
                }
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], key: str) -> str:
        this = row["this"][key]
        if "baseline" not in row:
            return f"{this:.1f}"
        base = row["baseline"][key]
        return f"{this:.1f} / {base:.1f} ({this / base:.2f}x)"

    lines = [
        "| batch | schedule() us | update() us | per row us |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        cells = [cell(row, k) for k in ("schedule_us", "update_us", "per_row_us")]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(SchedulerOptions, args))


def benchmark(args: SchedulerOptions) -> int:
    """Each batch size's host time per step (and the baseline's); written and printed."""
    from pdserve.bench.report import header, write_json
    from pdserve.bench.router_load import import_tree
    from pdserve.core.errors import InvalidArgumentError

    if args.steps < 1 or args.repeat < 1 or any(b < 1 for b in args.batch):
        raise InvalidArgumentError("batch", "--batch, --steps and --repeat must be at least 1")
    baseline = None
    if args.baseline is not None:
        if not (Path(args.baseline) / "pyproject.toml").is_file():
            raise InvalidArgumentError("baseline", f"{args.baseline} is not a pdserve source tree")
        baseline = import_tree(Path(args.baseline))
    rows = compare(args.batch, args.steps, args.repeat, baseline)
    command = (
        f"pdserve bench scheduler --batch {' '.join(map(str, args.batch))} "
        f"--steps {args.steps} --repeat {args.repeat}"
        + ("" if args.baseline is None else f" --baseline {args.baseline}")
    )
    payload = {**header(command), "baseline": args.baseline, "steps": args.steps, "rows": rows}
    path = write_json(Path(args.out) / f"{args.name}.json", payload)
    print(table(rows) + ("\n(this tree / baseline)" if baseline else ""))
    print(f"wrote {path}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.flags import count, file_stem

    p.add_argument("--batch", type=count, nargs="+", default=[21, 64, 256])
    p.add_argument("--steps", type=count, default=2000, help="steps per round")
    p.add_argument("--repeat", type=count, default=3, help="rounds per batch size (best kept)")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="a pdserve source tree measured alternately with this one",
    )
    p.add_argument("--out", default="bench/out")
    p.add_argument("--name", type=file_stem, default="scheduler")
    p.set_defaults(func=run)


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    _child(sys.argv[2:])
