"""Weights shared between a node's instances: memory and load time, shared or not.

    pdserve bench weights --model builtin:small --instances 3

Starts ``--instances`` processes one after another, each loading the model's
weights as an instance's rank does (build the model, ``load_checkpoint``),
all kept alive until the last has loaded; then reads each one's proportional
set size (``Pss`` in ``/proc/PID/smaps_rollup``: a page shared by N processes
counts 1/N in each) after it read every weight, and its load time. Once with sharing off
(``PDSERVE_SHARE_WEIGHTS=0``: every process holds its own copy), once with it
on against an empty cache (the first process writes the node's file), once more
with the file in place. Written: one row per case and the JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import options_from


@dataclass(frozen=True)
class WeightsOptions:
    """``pdserve bench weights``' options, in the order of its flags."""

    model: str = "builtin:small"  # the model of every instance
    instances: int = 3  # processes loading it
    out: str = "bench/out/weights.json"  # the result file


def _load(model: str, queue: Any, done: Any) -> None:
    import torch

    from pdserve.core.model_config import ModelConfig
    from pdserve.distributed.context import ParallelContext
    from pdserve.kernels.attention import select_backend
    from pdserve.models.builtin import resolve_model
    from pdserve.models.families import build_model
    from pdserve.models.loader import load_checkpoint

    torch.set_num_threads(1)
    config = ModelConfig.from_dir(resolve_model(model))
    backend = select_backend("torch", torch.device("cpu"))
    start = time.perf_counter()
    built = build_model(config, ParallelContext(), torch.float32, (0, config.num_layers), backend)
    load_checkpoint(built, config.path)
    took = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in built.parameters())
    with torch.no_grad():  # read every weight, as serving does, so its pages are resident
        float(sum(p.sum() for p in built.parameters()))
    queue.put((os.getpid(), took, weights))
    done.wait()


def _pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(model: str, instances: int, share: bool, cache: str) -> dict[str, Any]:
    os.environ["PDSERVE_SHARE_WEIGHTS"] = "1" if share else "0"
    os.environ["PDSERVE_WEIGHTS_CACHE"] = cache
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    procs, loaded = [], []
    for _ in range(instances):  # one after another, as instances start
        p = ctx.Process(target=_load, args=(model, queue, done))
        p.start()
        procs.append(p)
        loaded.append(queue.get(timeout=600))
    pss = [_pss_mib(pid) for pid, _, _ in loaded]
    done.set()
    for p in procs:
        p.join(timeout=60)
    return {
        "weights_mib": round(loaded[0][2] / 2**20, 1),
        "load_s": [round(t, 3) for _, t, _ in loaded],
        "pss_mib": [round(x, 1) for x in pss],
        "pss_total_mib": round(sum(pss), 1),
    }


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(WeightsOptions, args))


def benchmark(args: WeightsOptions) -> int:
    """Memory and load time of the instances, weights shared or not; written."""
    rows = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-weights-") as cache:
        rows["not shared"] = measure(args.model, args.instances, False, cache)
        rows["shared, empty cache"] = measure(args.model, args.instances, True, cache)
        rows["shared, file in place"] = measure(args.model, args.instances, True, cache)
    print(
        f"{args.model}, {args.instances} processes, weights {rows['not shared']['weights_mib']} MiB"
    )
    print(f"{'case':<24} {'load s (each)':<28} {'Pss MiB (each)':<30} {'Pss total':>9}")
    for name, r in rows.items():
        loads = ", ".join(f"{t:.2f}" for t in r["load_s"])
        pss = ", ".join(f"{x:.0f}" for x in r["pss_mib"])
        print(f"{name:<24} {loads:<28} {pss:<30} {r['pss_total_mib']:>9.0f}")
    write_json(Path(args.out), {"model": args.model, "instances": args.instances, "rows": rows})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--instances", type=count, default=3)
    p.add_argument("--out", default="bench/out/weights.json")
    p.set_defaults(func=run)
