"""``pdserve bench`` subcommands.

Each benchmark lives in a module of its own with ``add_arguments(p)`` and ``run(args)``.
Several bring torch or Ray at import, so a command line loads only the module of the
benchmark it names: ``pdserve bench serve`` (a load generator) and ``pdserve bench
--help`` start without torch.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Collection
from typing import NamedTuple

BENCH_HELP = "benchmarks (see bench/RESULTS.md)"


class Kind(NamedTuple):
    module: str  # under pdserve.bench
    help: str


# In the order `pdserve bench --help` lists them.
KINDS: dict[str, Kind] = {
    "offline": Kind("offline", "engine throughput vs transformers.generate"),
    "parallel": Kind("parallel", "TP=2 and PP=2 step time (shm and gloo) against one rank"),
    "transfer": Kind("transfer", "KV connector bandwidth vs the raw channel"),
    "ttft": Kind("disagg_ttft", "TTFT of disaggregated vs colocated serving at low load"),
    "router": Kind("router", "router decision time and front-door latency"),
    "scheduler": Kind("scheduler", "the engine scheduler's host time per step"),
    "sampler": Kind("sampler", "the sampler's time per step with penalties vs without"),
    "kernels": Kind("kernels", "Triton kernels vs torch and the bandwidth floor (GPU)"),
    "gpu": Kind("gpu", "an 8B-shaped model's decode and prefill vs the GPU's ceilings (GPU)"),
    "cuda-ipc": Kind("cuda_ipc", "KV pages into another process's pool over CUDA IPC (GPU)"),
    "serve": Kind("serve", "load a running cluster over gRPC or HTTP; goodput under SLOs"),
    "disagg-vs-colocated": Kind(
        "headline", "goodput of disaggregated vs colocated serving on the same cores, over rates"
    ),
    "peer": Kind("peer", "the serving benchmark against transformers' continuous batching"),
    "peer-prefill": Kind("peer_prefill", "a prefix from a peer instance's cache vs recomputing it"),
    "soak": Kind("soak", "a local cluster at 80%% load with client cancels and worker kills"),
    "quant": Kind("quant", "int8/int4 weight-only vs float32: memory, speed, perplexity"),
    "multiturn": Kind("multiturn", "multi-turn chat over KV tiers: off, host, host+disk"),
    "priority": Kind("priority", "online SLOs beside low-priority load and a batch job"),
    "spec": Kind("spec", "speculative decoding (prompt lookup, draft model) vs off"),
    "eplb": Kind("eplb", "MoE imbalance and step time before/after EPLB"),
    "elastic": Kind("elastic", "time from killing an EP rank to the next token"),
    "afd": Kind("afd", "attention-FFN disaggregation against colocated EP"),
    "coldstart": Kind("coldstart", "time to first token from zero, warm pool, running"),
    "weights": Kind("weights", "memory and load time of weights shared per node"),
    "startup": Kind("startup", "instances one after another vs at once; a whole cluster"),
}


def add_kind(kinds: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    """Benchmark ``name``'s parser, flags and all (imports its module)."""
    kind = KINDS[name]
    p = kinds.add_parser(name, help=kind.help, description=kind.help)
    importlib.import_module(f"pdserve.bench.{kind.module}").add_arguments(p)
    return p


def add_bench_parser(sub: argparse._SubParsersAction, load: Collection[str] | None = None) -> None:
    """``pdserve bench``: every benchmark with its flags, or, given ``load``, only those
    named there (the others are a line of help, their modules not imported)."""
    bench = sub.add_parser("bench", help=BENCH_HELP)
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, kind in KINDS.items():
        if load is None or name in load:
            add_kind(kinds, name)
        else:
            kinds.add_parser(name, help=kind.help)


def named_kind(argv: list[str]) -> str | None:
    """The benchmark a ``pdserve bench ...`` command line names, if any (``bench`` takes
    no flags of its own but ``--help``, so it is the first word after ``bench``)."""
    rest = argv[argv.index("bench") + 1 :] if "bench" in argv else []
    first = next((word for word in rest if not word.startswith("-")), None)
    return first if first in KINDS else None
