"""The router's own cost: placement decisions, and the latency the front door adds.

    pdserve bench router

1. Decision time with 10, 100 and 1,000 instances (half prefill, half decode,
   one region, every prefill instance holding part of a shared prefix), for
   every policy: the router's region choice plus the policy, in process.
2. Under load, on a real local cluster (builtin:tiny, one prefill and one
   decode instance) driven over gRPC, HTTP/SSE or both (``--protocol``) by many
   concurrent streams: the router's recorded decision times, and the time from
   a token being ready at the router to the front door having written it to
   the client; with ``--router-cpu N`` also with the router actor alone on core
   N and every other process on the remaining cores, alternated ``--repeat``
   times; with ``--baseline DIR`` the router actor of every other run imports
   pdserve from the source tree DIR (a before/after comparison).
3. After each load run, the floor the protocol's library sets: a bare grpc.aio
   or aiohttp server whose streams are all woken at once and each write one
   chunk (no router). See :mod:`pdserve.bench.router_load`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.bench.router_floor import percentile as _percentile
from pdserve.bench.router_load import LoadFlags, under_load
from pdserve.core.messages import LoadReport
from pdserve.core.options import options_from
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.prefix_index import prompt_block_hashes
from pdserve.router.router import CompletionInput, InstanceInfo, Router


@dataclass(frozen=True)
class RouterOptions:
    """``pdserve bench router``'s options, in the order of its flags."""

    rounds: int = 2000  # timed decisions per case
    decisions_only: bool = False  # the in-process rows alone: no cluster, no load runs
    load: LoadFlags = field(default_factory=LoadFlags)  # the front door's load runs
    out: str = "bench/out/router.json"  # the result file ("": none)


def decision_times(n: int, policy: str, rounds: int, holders: int | None) -> dict[str, Any]:
    """``holders`` prefill instances hold part of the prompt (None: all of them);
    the others hold unrelated prefixes of their own."""
    router = Router(RouterConfig(policy=policy, auth_disabled=True), None, None)
    rng = random.Random(n)
    prompt = [rng.randrange(3, 2000) for _ in range(512)]
    hashes = prompt_block_hashes(prompt, 16)
    for i in range(n):
        role = "prefill" if i % 2 == 0 else "decode"
        router.register(InstanceInfo(f"{role}-{i}", role, "local", None, 16, 4096))
        if role == "decode":
            cached: list[bytes] = []
        elif holders is None or i // 2 < holders:
            cached = hashes[: rng.randrange(len(hashes))]
        else:
            cached = prompt_block_hashes([rng.randrange(3, 2000) for _ in range(256)], 16)
        router.on_report(
            LoadReport(
                f"{role}-{i}",
                role,
                rng.randrange(8),
                rng.randrange(64),
                rng.randrange(4000),
                rng.randrange(100, 1000),
                1000,
                0.02,
                300.0,
                cached,
            )
        )
    inp = CompletionInput("bench", prompt, SamplingParams(max_tokens=128))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        router.chooser.choose(inp)
        times.append(time.perf_counter() - start)
    return {
        "instances": n,
        "prompt_held_by": "all prefill instances"
        if holders is None
        else f"{holders} prefill instances",
        "policy": policy,
        "p50_us": round(_percentile(times, 0.5) * 1e6, 1),
        "p99_us": round(_percentile(times, 0.99) * 1e6, 1),
    }


def validation_cost(rounds: int) -> dict[str, Any]:
    """The checks the front doors run on every request, on a typical one, in process.

    Times the whole admission path of a text request (sampling parameters,
    Unicode and range checks, tokenizing, the context check, the id and region
    checks) and, separately, the checks alone (no tokenizing), per request.
    """
    from pdserve.core.tokenizer import Tokenizer
    from pdserve.models.builtin import resolve_model
    from pdserve.router.frontdoor.requests import (
        completion_input,
        fit_context,
        prompt_tokens,
        sampling_params,
    )

    tokenizer = Tokenizer.from_dir(resolve_model("builtin:tiny"))
    prompt = "The router sees the whole cluster and places every request. " * 32  # ~2 KB
    fields = {
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["\n\n", "###", "END", "</s>"],
        "stop_token_ids": [2, 3],
    }
    ids = prompt_tokens(tokenizer, prompt, 4096, 1209)

    def admit() -> None:
        params = sampling_params(fields, 1209)
        tokens = prompt_tokens(tokenizer, prompt, 4096, 1209)
        completion_input(tokens, fit_context(params, len(tokens), 4096, True), "east", "client-42")

    def checks() -> None:
        params = sampling_params(fields, 1209)
        completion_input(ids, fit_context(params, len(ids), 4096, True), "east", "client-42")

    out: dict[str, Any] = {"prompt_chars": len(prompt), "prompt_tokens": len(ids)}
    for name, fn in (("admission", admit), ("checks_without_tokenizing", checks)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[f"{name}_p50_us"] = round(_percentile(times, 0.5) * 1e6, 1)
        out[f"{name}_p99_us"] = round(_percentile(times, 0.99) * 1e6, 1)
    return out


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(RouterOptions, args))


def benchmark(args: RouterOptions) -> int:
    """Decision times, validation cost and the front door under load; written."""
    decisions = [
        decision_times(n, policy, args.rounds, holders)
        for holders in (4, None)
        for n in (10, 100, 1000)
        for policy in ("round_robin", "least_loaded", "cost_model")
    ]
    for row in decisions:
        print(json.dumps(row))
    validation = validation_cost(args.rounds)
    print(json.dumps(validation))
    load = None if args.decisions_only else under_load(args.load)
    if args.out:
        flags = args.load
        cmd = (
            f"pdserve bench router --decisions-only --rounds {args.rounds}"
            if args.decisions_only
            else f"pdserve bench router --concurrency {flags.concurrency} --requests "
            f"{flags.requests} --tokens {flags.tokens} --repeat {flags.repeat}"
            + ("" if flags.router_cpu is None else f" --router-cpu {flags.router_cpu}")
            + ("" if flags.protocol == "grpc" else f" --protocol {flags.protocol}")
            + ("" if flags.baseline is None else f" --baseline {flags.baseline}")
        )
        result = {"command": cmd, "decisions": decisions, "validation": validation, "load": load}
        write_json(Path(args.out), result)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=count, default=2000)
    p.add_argument(
        "--decisions-only",
        action="store_true",
        help="the decision and validation rows alone, in process: no cluster, no load runs",
    )
    p.add_argument("--concurrency", type=count, default=32)
    p.add_argument("--requests", type=count, default=4, help="per concurrent client")
    p.add_argument("--tokens", type=count, default=32)
    p.add_argument(
        "--router-cpu",
        type=int,
        default=None,
        help="also run with the router actor pinned to this core, the rest on the others",
    )
    p.add_argument("--repeat", type=count, default=1, help="load runs per placement, alternated")
    p.add_argument(
        "--protocol",
        choices=("grpc", "http", "both"),
        default="grpc",
        help="the front door the load speaks: gRPC Generate, OpenAI HTTP/SSE, or both in turn",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="a pdserve source tree (e.g. a git archive export) whose router the load also "
        "runs against, alternated with this tree's",
    )
    p.add_argument("--out", default="bench/out/router.json")
    p.set_defaults(func=run)
