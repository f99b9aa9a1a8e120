"""Online traffic beside low-priority load: overload at 2x, and a batch job.

    pdserve bench priority --duration 30

One local cluster (one region, one prefill and one decode instance), three
runs of the same online workload (priority 0, Poisson at ``--rate``, by
default the capacity measured first: completed requests per second with all
``--probe-requests`` sent at once), side by side:

- ``online``: alone, the baseline;
- ``2x``: beside requests of priority -1 that bring the offered load to twice the
  capacity (as many again as online by default; more with ``--online-share``
  below 1, online then running at that share of the capacity);
- ``batch``: while ``pdserve batch`` runs a file of ``--batch-lines`` requests.

Reported per run: online TTFT and TPOT p90 and SLO attainment; for the
low-priority requests, how many were served, capped (fewer tokens than asked:
admitted under overload with a capped ``max_tokens``) or refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.flags import count
from pdserve.bench.loadgen import HttpClient, LoadOptions, run_load
from pdserve.bench.report import RequestRecord, Slo, attainment, summarize, write_json
from pdserve.core.options import flat_options, options_from

CONFIG = """\
model: {model}
connector: shm
engine: {{dtype: float32, max_num_batched_tokens: 512}}
regions:
  - name: local
    prefill: {{count: 1, num_cpus_per_rank: 0.5}}
    decode: {{count: 1, num_cpus_per_rank: 0.5}}
slo: {{ttft_ms: {ttft_ms}, tpot_ms: {tpot_ms}}}
server: {{host: 127.0.0.1, grpc_port: 0, http_port: 0}}
auth: {{disabled: true}}
router: {{max_inflight_per_region: {cap}, low_priority_share: 0.5, low_priority_max_tokens: 16}}
"""


@dataclass(frozen=True)
class PriorityOptions:
    """``pdserve bench priority``'s options, in the order of its flags, then what the run
    found (the model's vocabulary, the capacity the 2x load doubles)."""

    model: str = "builtin:tiny"  # the model served
    rate: float | None = None  # online req/s (None: the measured capacity x online_share)
    online_share: float = 1.0  # online load as a share of the measured capacity
    probe_requests: int = 48  # requests sent at once to measure the capacity
    duration: float = 30.0  # seconds of each mode's load
    prompt_len: int = 256  # prompt tokens of every request
    output_len: int = 64  # output tokens of every request
    cap: int = 16  # router.max_inflight_per_region
    batch_lines: int = 200  # lines of the batch job
    batch_concurrency: int = 8  # the batch job's requests in flight
    ttft_slo_ms: float = 1000.0  # TTFT SLO
    tpot_slo_ms: float = 100.0  # TPOT SLO
    seed: int = 0  # seeds the prompts
    out: str = "bench/out/priority.json"  # the result file
    vocab: int = 0  # the model's vocabulary size (found)
    capacity: float | None = None  # req/s the 2x load doubles (measured, else the rate)

    @property
    def online_rate(self) -> float:
        """The online req/s, once given or measured."""
        if self.rate is None:
            raise ValueError("the online rate is given or measured before the runs")
        return self.rate


def _specs(
    args: PriorityOptions, seed: int, vocab: int, rate: float | None = None
) -> list[wl.RequestSpec]:
    rate = args.online_rate if rate is None else rate
    arrivals = wl.arrival_times("poisson", rate, None, args.duration, seed=seed)
    n = len(arrivals)
    prompts = np.full(n, args.prompt_len)
    outputs = np.full(n, args.output_len)
    return wl.build_requests(arrivals, prompts, outputs, vocab, (args.seed, seed))


def _low_priority(records: list[RequestRecord]) -> dict[str, int]:
    served = [r for r in records if r.ok]
    return {
        "sent": len(records),
        "served": len(served),
        "capped": sum(r.output_len < r.max_tokens for r in served),
        "refused": sum(not r.ok and "429" in (r.error or "") for r in records),
    }


async def _run(base: str, args: PriorityOptions, mode: str, slo: Slo) -> dict[str, Any]:
    online = HttpClient(base, None, "", 0.0, 600.0)
    low = HttpClient(base, None, "", 0.0, 600.0, {"priority": -1})
    for client in (online, low):
        client.model = await client.model_name()
    quiet = LoadOptions(progress=False)
    try:
        jobs: list[Any] = [run_load(online, _specs(args, 1, args.vocab), options=quiet)]
        if mode == "2x":  # low priority brings the offered load to twice the capacity
            capacity = args.online_rate if args.capacity is None else args.capacity
            rate = capacity * 2 - args.online_rate
            jobs.append(run_load(low, _specs(args, 2, args.vocab, rate), options=quiet))
        elif mode == "batch":
            jobs.append(_batch_job(base, args, online.model))
        results = await asyncio.gather(*jobs)
    finally:
        await online.close()
        await low.close()
    records = results[0]
    out: dict[str, Any] = {
        "online": summarize(records, slo),
        "online_attainment": attainment(records, slo),
    }
    if mode == "2x":
        out["low_priority"] = _low_priority(results[1])
    elif mode == "batch":
        out["batch"] = results[1]
    return out


async def _batch_job(base: str, args: PriorityOptions, model: str) -> dict[str, Any]:
    from pdserve.batch import BatchRunner

    with tempfile.TemporaryDirectory() as folder:
        src, out = Path(folder) / "in.jsonl", Path(folder) / "out.jsonl"
        body = {"model": model, "max_tokens": args.output_len, "ignore_eos": True}
        lines = [
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {**body, "prompt": spec.prompt_token_ids and list(spec.prompt_token_ids)},
            }
            for i, spec in enumerate(_specs(args, 3, args.vocab)[: args.batch_lines])
        ]
        src.write_text("".join(json.dumps(line) + "\n" for line in lines))
        runner = BatchRunner(base, None, concurrency=args.batch_concurrency)
        summary = await runner.run(src, out, progress=False)
        return {
            "lines": summary.lines,
            "succeeded": summary.succeeded,
            "retries": summary.retries,
            "errors": summary.errors,
        }


async def _capacity(base: str, args: PriorityOptions) -> float:
    """Requests per second the cluster completes when everything is sent at once."""
    client = HttpClient(base, None, "", 0.0, 600.0)
    client.model = await client.model_name()
    arrivals = np.zeros(args.probe_requests)
    n = len(arrivals)
    specs = wl.build_requests(
        arrivals, np.full(n, args.prompt_len), np.full(n, args.output_len), args.vocab, (9,)
    )
    try:
        records = await run_load(client, specs, options=LoadOptions(progress=False))
    finally:
        await client.close()
    return float(summarize(records, Slo())["throughput_rps"])


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(PriorityOptions, args))


def benchmark(args: PriorityOptions) -> int:
    """The three modes on a local cluster, at the given or measured rate; written."""
    from pdserve.bench.local import local_cluster
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model

    args = replace(args, vocab=ModelConfig.from_dir(resolve_model(args.model)).vocab_size)
    slo = Slo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    text = CONFIG.format(
        model=args.model, ttft_ms=args.ttft_slo_ms, tpot_ms=args.tpot_slo_ms, cap=args.cap
    )
    results: dict[str, Any] = {}
    with local_cluster(text, num_cpus=4) as (endpoints, _):
        base = endpoints.http_url
        if args.rate is None:
            results["capacity_rps"] = asyncio.run(_capacity(base, args))
            args = replace(args, rate=results["capacity_rps"] * args.online_share)
            print(
                f"capacity {results['capacity_rps']:.2f} req/s: online at {args.rate:.2f}, "
                "priority -1 bringing the load to 2x"
            )
        args = replace(args, capacity=results.get("capacity_rps", args.rate))
        for mode in ("online", "2x", "batch"):
            results[mode] = asyncio.run(_run(base, args, mode, slo))
            print(_line(mode, results[mode]), flush=True)
    write_json(
        Path(args.out),
        {"options": flat_options(args), "results": results},
    )
    return 0


def _line(mode: str, r: dict[str, Any]) -> str:
    o = r["online"]
    text = (
        f"{mode:7s} online: TTFT p90 {o['ttft_ms'].get('p90', float('nan')):8.1f} ms, "
        f"TPOT p90 {o['tpot_ms'].get('p90', float('nan')):6.1f} ms, "
        f"SLO met {r['online_attainment']:.0%} of {o['num_requests']}"
    )
    if "low_priority" in r:
        text += f" | priority -1: {r['low_priority']}"
    if "batch" in r:
        text += f" | batch: {r['batch']}"
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument(
        "--rate", type=float, default=None, help="online req/s (default: the measured capacity)"
    )
    p.add_argument(
        "--online-share",
        type=float,
        default=1.0,
        help="online load as a share of the measured capacity; in the 2x run priority -1 "
        "brings the total to twice the capacity (default 1: as much again)",
    )
    p.add_argument("--probe-requests", type=count, default=48)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--prompt-len", type=count, default=256)
    p.add_argument("--output-len", type=count, default=64)
    p.add_argument("--cap", type=count, default=16, help="router.max_inflight_per_region")
    p.add_argument("--batch-lines", type=count, default=200)
    p.add_argument("--batch-concurrency", type=count, default=8)
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/priority.json")
    p.set_defaults(func=run)
