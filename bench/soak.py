"""``pdserve bench soak``: a local cluster under steady load, client cancels and worker kills.

    pdserve bench soak --minutes 10 [--config deploy/configs/local.yaml] [--out bench/out/soak.json]

Phases, in order:

1. start: the cluster from the config on an embedded Ray instance, as ``pdserve serve``
   does (auth as the config says);
2. reference: the greedy output of every prompt of a small fixed pool, computed once
   through the healthy cluster one prompt at a time, then again all at once (the two
   must agree, or no token check could be trusted);
3. capacity: a closed loop of ``--capacity-concurrency`` clients for
   ``--capacity-seconds``; completed requests per second is the capacity;
4. soak: open-loop Poisson arrivals at ``--load`` x capacity for ``--minutes``, half
   ``Generate`` (streamed), half ``Complete`` (unary), greedy with ``ignore_eos``;
   ``--cancel-fraction`` of them are cancelled by the client (streams before the first
   token, right after it or mid-stream; unary calls after a random delay), and every
   ``--kill-every`` seconds a random prefill or decode rank process gets SIGKILL;
5. drain: every request gets its answer (or its deadline), the cluster is whole and
   idle again, each pool prompt is served once more, then every instance reports the KV
   pages it still holds and runs its idle check.

Every request ends as exactly one outcome (:func:`classify`); the tokens any request
received are checked against its prompt's reference (:func:`check_tokens`). A thread
samples the RSS of every process of the cluster meanwhile (:func:`rss_summary`).

Outcomes and the report are in :mod:`pdserve.bench.soak_outcomes`, the client and the
cluster handles in :mod:`pdserve.bench.soak_cluster`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.report import header, percentiles, write_json
from pdserve.bench.soak_cluster import RssSampler, SoakClient, SoakCluster
from pdserve.bench.soak_outcomes import (
    VOCAB,
    Attempt,
    classify,
    plan_attempts,
    request_json,
    result_table,
    rss_summary,
    tally,
    verdict,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakOptions:
    """``pdserve bench soak``'s options, in the order of its flags."""

    minutes: float = 10.0  # length of the soak phase
    config: str = "deploy/configs/local.yaml"  # cluster config (YAML)
    out: str = "bench/out/soak.json"  # result file (JSON)
    any_port: bool = False  # free ports instead of the config's
    load: float = 0.8  # offered rate, share of capacity
    cancel_fraction: float = 0.1  # requests the client cancels
    kill_every: float = 60.0  # seconds between rank kills
    capacity_seconds: float = 40.0  # length of the closed-loop capacity run
    capacity_concurrency: int = 16  # clients of the capacity run
    pool: int = 16  # distinct prompts
    prompt_len: Sequence[int] = (16, 96)  # LO HI of prompt lengths
    output_len: Sequence[int] = (8, 48)  # LO HI of output lengths
    deadline: float = 120.0  # seconds; a request with no final answer by then is lost
    settle_timeout: float = 180.0  # seconds the cluster may take to be whole and idle
    rss_every: float = 10.0  # seconds between RSS samples
    rss_baseline_minutes: float = 2.0  # the minutes whose peak RSS is the baseline
    rss_growth_limit: float = 1.25  # peak RSS over the run / baseline peak allowed
    seed: int = 0  # seeds prompts, arrivals and cancels
    prog: str = "pdserve bench soak"  # the command, for the record


# -- the phases --------------------------------------------------------------------------------


async def compute_references(
    client: SoakClient, num_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """(greedy output of each pool prompt, prompts whose concurrent answer differed)."""
    first = [
        await client.send(Attempt(i, "stream", i, num_tokens)) for i in range(len(client.pool))
    ]
    bad = [a for a in first if classify(a) != "completed" or len(a.tokens) != num_tokens]
    if bad:
        from pdserve.core.errors import InstanceFailedError

        raise InstanceFailedError(
            f"the healthy cluster did not answer prompt {bad[0].prompt} for the reference: "
            f"{bad[0].code} {bad[0].details} ({len(bad[0].tokens)} tokens)"
        )
    again = await asyncio.gather(
        *(client.send(Attempt(i, "unary", i, num_tokens)) for i in range(len(client.pool)))
    )
    return [a.tokens for a in first], [
        i for i, a in enumerate(again) if a.tokens != first[i].tokens
    ]


async def closed_loop(
    client: SoakClient, concurrency: int, seconds: float, output_len: tuple[int, int], seed: int
) -> tuple[list[Attempt], float]:
    """(requests, wall seconds) of ``concurrency`` clients sending back to back."""
    rng = np.random.default_rng(seed)
    done: list[Attempt] = []
    start = time.perf_counter()

    async def one_client(w: int) -> None:
        while time.perf_counter() - start < seconds:
            kind = "stream" if (len(done) + w) % 2 == 0 else "unary"
            n = int(rng.integers(output_len[0], output_len[1] + 1))
            done.append(
                await client.send(Attempt(len(done), kind, int(rng.integers(len(client.pool))), n))
            )

    await asyncio.gather(*(one_client(w) for w in range(concurrency)))
    return done, time.perf_counter() - start


async def measure_capacity(
    client: SoakClient, args: SoakOptions, references: list[list[int]]
) -> dict[str, Any]:
    """Completed requests per second of the closed loop, its outcomes, and the latencies
    that time the soak's cancels (``timing_s``)."""
    _say(f"capacity: closed loop, {args.capacity_concurrency} clients, {args.capacity_seconds:g} s")
    out_len = (args.output_len[0], args.output_len[1])
    done, wall = await closed_loop(
        client, args.capacity_concurrency, args.capacity_seconds, out_len, args.seed + 1
    )
    t = tally(done, references)
    streams = [a.ttft_s for a in done if a.kind == "stream" and a.ttft_s is not None]
    timing = {
        "ttft_p50": percentiles(streams).get("p50", 0.5),
        "e2e_p90": percentiles([a.e2e_s or 0.0 for a in done]).get("p90", 2.0),
    }
    return {
        "rps": t["completed_ok"] / wall,
        "wall_s": wall,
        **t["outcomes"],
        "token_problems": t["token_problems"],
        "timing_s": timing,
    }


async def open_loop(
    client: SoakClient,
    cluster: SoakCluster,
    planned: list[tuple[float, Attempt]],
    duration_s: float,
    kill_every_s: float,
    rng: np.random.Generator,
) -> tuple[list[Attempt], list[dict[str, Any]]]:
    """Send each request at its offset, and kill a rank every ``kill_every_s``; wait for all."""
    start = time.perf_counter()
    kills: list[dict[str, Any]] = []

    async def scheduled(at: float, a: Attempt) -> Attempt:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        a.sent_s = time.perf_counter() - start
        return await client.send(a)

    async def killer() -> None:
        n = 1
        while n * kill_every_s < duration_s:
            await asyncio.sleep(max(0.0, start + n * kill_every_s - time.perf_counter()))
            at = time.perf_counter() - start
            kills.append(await asyncio.to_thread(cluster.kill_random, rng, at))
            n += 1

    killing = asyncio.create_task(killer())
    attempts = await asyncio.gather(*(scheduled(at, a) for at, a in planned))
    await killing
    return list(attempts), kills


async def drive(cluster: SoakCluster, args: SoakOptions, api_key: str | None) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    lo, hi = args.prompt_len
    pool = [
        wl.synthetic_prompt(int(rng.integers(lo, hi + 1)), VOCAB, rng) for _ in range(args.pool)
    ]
    out_len = (args.output_len[0], args.output_len[1])
    client = SoakClient(cluster.address, api_key, pool, args.deadline)
    try:
        _say(f"reference: greedy output of {args.pool} prompts, {out_len[1]} tokens each")
        references, unstable = await compute_references(client, out_len[1])
        capacity = await measure_capacity(client, args, references)
        rate = args.load * capacity["rps"]
        duration = args.minutes * 60
        _say(
            f"soak: {rate:.2f} req/s ({args.load:.0%} of {capacity['rps']:.2f}) for {duration:g} s, "
            f"a kill every {args.kill_every:g} s"
        )
        arrivals = wl.arrival_times("poisson", rate, duration_s=duration, seed=args.seed + 2)
        planned = plan_attempts(
            arrivals, len(pool), out_len, args.cancel_fraction, capacity["timing_s"], rng
        )
        attempts, kills = await open_loop(client, cluster, planned, duration, args.kill_every, rng)
        _say("drain: waiting for the cluster to be whole and idle")
        settled = await asyncio.to_thread(cluster.wait_settled, args.settle_timeout)
        after = await asyncio.gather(
            *(client.send(Attempt(i, "stream", i, out_len[1])) for i in range(len(pool)))
        )
        after_ok = sum(a.tokens == references[a.prompt] for a in after)
        settled = settled and await asyncio.to_thread(cluster.wait_settled, args.settle_timeout)
    finally:
        await client.close()
    return {
        "capacity": capacity,
        "rate_rps": rate,
        "reference": {"prompts": len(pool), "tokens": out_len[1], "unstable_prompts": unstable},
        "soak": tally(attempts, references),
        "kills": kills,
        "settled": settled,
        "after_kills": {"prompts": len(pool), "matching_reference": after_ok},
        "leaks": await asyncio.to_thread(cluster.leaks),
        "events": list(cluster.status().events),
        "requests": [request_json(a) for a in attempts],
    }


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} soak {text}", flush=True)


def check_args(args: SoakOptions) -> None:
    from pdserve.core.errors import InvalidArgumentError

    lo, hi = args.output_len
    if not 3 <= lo <= hi:
        raise InvalidArgumentError(
            "output-len", f"needs 3 <= LO <= HI (a mid-stream cancel needs 3 tokens), got {lo} {hi}"
        )
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise InvalidArgumentError("prompt-len", f"needs 1 <= LO <= HI, got {args.prompt_len}")
    if not args.minutes > 0 or not args.load > 0 or not args.kill_every > 0:
        raise InvalidArgumentError("minutes", "--minutes, --load and --kill-every must be > 0")
    if not 0 <= args.cancel_fraction <= 1 or args.pool < 1 or args.capacity_concurrency < 1:
        raise InvalidArgumentError(
            "cancel-fraction", "must be in [0, 1] (and --pool, --capacity-concurrency >= 1)"
        )


def api_key_for(config: Any) -> str | None:
    """The key a client of this config's cluster sends (None: auth is disabled)."""
    if config.router.auth_disabled:
        return None
    env = [k.strip() for k in os.environ.get("PDSERVE_API_KEYS", "").split(",") if k.strip()]
    keys = [*config.router.api_keys, *env]
    return keys[0] if keys else None


def run(args: argparse.Namespace) -> int:
    from pdserve.core.options import options_from

    return soak(options_from(SoakOptions, args))


def soak(args: SoakOptions) -> int:
    """The cluster started, its capacity measured, the soak run; the verdict written."""
    import ray

    from pdserve.bench.serve import command_line, options_json
    from pdserve.cluster.config import load_config
    from pdserve.cluster.connect import connect

    check_args(args)
    config = load_config(args.config)
    if args.any_port:
        router = dataclasses.replace(config.router, grpc_port=0, http_port=0)
        config = dataclasses.replace(config, router=router)
    started_ray = not ray.is_initialized()
    _say(f"starting the cluster of {args.config}")
    connect("local", config.ray_num_cpus or DEFAULT_NUM_CPUS)
    cluster: SoakCluster | None = None
    sampler: RssSampler | None = None
    try:
        cluster = SoakCluster(config)
        sampler = RssSampler(cluster, args.rss_every)
        sampler.start()
        result = asyncio.run(drive(cluster, args, api_key_for(config)))
        sampler.stop()
        result["rss"] = rss_summary(sampler.samples, args.rss_baseline_minutes * 60)
        result["rss_samples"] = [dataclasses.astuple(s) for s in sampler.samples]
        result["ray_logs"] = _ray_logs()
    finally:
        if sampler is not None:
            sampler.stop()
        if cluster is not None:
            cluster.stop()
        if started_ray:
            ray.shutdown()
    result["log_errors"] = log_errors(result["ray_logs"])
    result["options"] = options_json(args)
    found = verdict(result, args.rss_growth_limit)
    result["problems"] = found
    path = write_json(Path(args.out), {**header(command_line(args.prog, args)), **result})
    print(result_table(result))
    for record in result["log_errors"]:
        print(f"logged: {record.splitlines()[1][:200]}")
    print("PASS" if not found else "FAIL: " + "; ".join(found))
    print(f"wrote {path} (the cluster's logs: {result['ray_logs']})")
    return 0 if not found else 1


DEFAULT_NUM_CPUS = 4  # a config without ray.num_cpus


def log_errors(folder: str | None, limit: int = 20, context: int = 16) -> list[str]:
    """The first ``limit`` ERROR records of the cluster's worker logs, each with the
    ``context`` lines after it (its traceback)."""
    if folder is None:
        return []
    found: list[str] = []
    for path in sorted(Path(folder).glob("worker-*.err")):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if " ERROR " in line and len(found) < limit:
                found.append("\n".join([f"{path.name}:{i + 1}", *lines[i : i + context]]))
    return found


def _ray_logs() -> str | None:
    """The log folder of this driver's Ray session (router, controller and rank logs)."""
    import ray

    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    return f"{node.get_session_dir_path()}/logs" if node is not None else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak phase")
    p.add_argument("--config", default="deploy/configs/local.yaml", help="cluster config (YAML)")
    p.add_argument("--out", default="bench/out/soak.json", help="result file (JSON)")
    p.add_argument("--any-port", action="store_true", help="free ports instead of the config's")
    p.add_argument("--load", type=float, default=0.8, help="offered rate, share of capacity")
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="requests the client cancels")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between rank kills")
    p.add_argument("--capacity-seconds", type=float, default=40.0)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--pool", type=int, default=16, help="distinct prompts")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 48), metavar=("LO", "HI"))
    p.add_argument(
        "--deadline",
        type=float,
        default=120.0,
        help="seconds; a request with no final answer by then is lost",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=180.0,
        help="seconds the cluster may take to be whole and idle at the end",
    )
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--rss-baseline-minutes", type=float, default=2.0)
    p.add_argument(
        "--rss-growth-limit",
        type=float,
        default=1.25,
        help="peak RSS over the run / peak in the baseline minutes allowed",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, prog="pdserve bench soak")
