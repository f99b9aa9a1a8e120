"""Elastic EP: the time from killing an expert-parallel follower rank to the next token.

    pdserve bench elastic

A Mixtral-shaped checkpoint with random weights (``--hidden``, ``--experts``,
... as in ``pdserve bench afd``) is served over ``--ranks`` EP ranks (TP = PP
= 1) of Ray actors. Each run starts a fresh instance, streams ``--batch``
greedy requests of ``--tokens`` tokens once undisturbed (the baseline: its
tokens, and its median step time from the leader's step counter), then again,
sending SIGKILL to rank ``--victim``'s process ``--kill-after`` steps in. The
leader stamps the recovery (``parallel/elastic.py``); reported per run:

- detect: the kill to the leader's failed collective;
- identify: pinging the followers through Ray to find the dead one;
- regroup: new process groups over the survivors (the slowest survivor);
- experts: re-placing the experts (read from the checkpoint, or kept/copied
  from replicas already on the survivors);
- kill to next token: the kill to the re-run step's tokens, next to the
  baseline step time.

Two cases: no redundant experts (the dead rank's experts are read from the
checkpoint) and ``--redundant`` replicas (with enough of them every expert of
the dead rank already lives on a survivor). Every killed run's tokens must
equal the baseline's.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.afd import MoeShapeFlags, add_model_flags, write_checkpoint
from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.config import build_engine_config
from pdserve.core.model_config import ModelConfig
from pdserve.core.options import flat_options, options_from
from pdserve.core.sampling_params import SamplingParams
from pdserve.parallel.instance import RankGroup, RankResources
from pdserve.parallel.rank_spec import GenerateItem


@dataclass(frozen=True)
class ElasticOptions:
    """``pdserve bench elastic``'s options, in the order of its flags."""

    ranks: int = 2  # expert-parallel ranks
    victim: int = 1  # the follower rank to kill
    redundant: int = 8  # replica slots (second case)
    shape: MoeShapeFlags = field(default_factory=MoeShapeFlags)  # the model's shape
    batch: int = 4  # requests streaming at the kill
    tokens: int = 64  # tokens per request
    kill_after: int = 8  # steps before the kill
    runs: int = 3  # instances killed per case
    cpus: float = 2.0  # CPUs over all ranks
    out: str = "bench/out/elastic.json"  # the result file


def _stream(ray: Any, group: RankGroup, args: ElasticOptions, kill: bool) -> dict[str, Any]:
    """One stream of the batch; with ``kill``, SIGKILL the victim a few steps in."""
    leader, victim = group.leader, group.workers[args.victim]
    pid = ray.get(victim.__ray_call__.remote(lambda _: os.getpid()))
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 500 + 3 for j in range(16)] for i in range(args.batch)]
    stamp = time.monotonic_ns()
    items = [GenerateItem(f"r{i}-{stamp}", p, params) for i, p in enumerate(prompts)]
    first = ray.get(leader.elastic_status.remote()).steps
    start = time.perf_counter()
    pending = leader.generate.remote(items)
    out: dict[str, Any] = {}
    if kill:
        while ray.get(leader.elastic_status.remote()).steps < first + args.kill_after:
            time.sleep(0.001)
        out["killed_at"] = time.time()
        os.kill(pid, signal.SIGKILL)
    outputs = ray.get(pending)
    seconds = time.perf_counter() - start
    steps = ray.get(leader.elastic_status.remote()).steps - first
    out.update(tokens=[o.outputs[0].token_ids for o in outputs], step_s=seconds / steps)
    return out


def run_once(folder: Path, redundant: int, args: ElasticOptions) -> dict[str, Any]:
    import ray

    model = ModelConfig.from_dir(folder)
    engine = build_engine_config(
        str(folder),
        expert_parallel_size=args.ranks,
        redundant_experts=redundant,
        max_num_seqs=args.batch,
        max_num_batched_tokens=16 * args.batch,
        enable_prefix_caching=False,
    )
    group = RankGroup.start(model, engine, RankResources(num_cpus=args.cpus / args.ranks))
    try:
        _stream(ray, group, args, kill=False)  # warm-up
        base = _stream(ray, group, args, kill=False)
        killed = _stream(ray, group, args, kill=True)
        status = ray.get(group.leader.elastic_status.remote())
    finally:
        group.shutdown()
    r, kill_at = status.recoveries[0], killed["killed_at"]
    return {
        "same_tokens": killed["tokens"] == base["tokens"],
        "detect_s": r.failed_at - kill_at,
        "identify_s": r.identify_s,
        "regroup_s": r.regroup_s,
        "experts_s": r.reload_s,
        "slots_read": r.loaded_slots,
        "slots_copied": r.copied_slots,
        "kill_to_next_token_s": r.resumed_at - kill_at,
        "baseline_step_s": base["step_s"],
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in runs[0] if k.endswith("_s")]
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}
    out["same_tokens"] = all(r["same_tokens"] for r in runs)
    out["slots_read"] = runs[0]["slots_read"]
    out["slots_copied"] = runs[0]["slots_copied"]
    out["runs"] = runs
    return out


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(ElasticOptions, args))


def benchmark(args: ElasticOptions) -> int:
    """Both cases, each instance killed mid-stream; written with the options."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=int(args.cpus), include_dashboard=False, log_to_driver=False)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, args.shape)
        for name, redundant in (("no replicas", 0), (f"{args.redundant} replicas", args.redundant)):
            results[name] = _summary([run_once(folder, redundant, args) for _ in range(args.runs)])
            row = {k: v for k, v in results[name].items() if k != "runs"}
            print(name, row)
    write_json(
        Path(args.out),
        {"args": flat_options(args), "host": platform.node(), "results": results},
    )
    return 0 if all(r["same_tokens"] for r in results.values()) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=count, default=2, help="expert-parallel ranks")
    p.add_argument("--victim", type=int, default=1, help="the follower rank to kill")
    p.add_argument("--redundant", type=int, default=8, help="replica slots (second case)")
    add_model_flags(p)
    p.add_argument("--batch", type=count, default=4, help="requests streaming at the kill")
    p.add_argument("--tokens", type=count, default=64, help="tokens per request")
    p.add_argument("--kill-after", type=int, default=8, help="steps before the kill")
    p.add_argument("--runs", type=count, default=3, help="instances killed per case")
    p.add_argument("--cpus", type=float, default=2.0, help="CPUs over all ranks")
    p.add_argument("--out", default="bench/out/elastic.json")
    p.set_defaults(func=run)
