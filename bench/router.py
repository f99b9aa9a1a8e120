"""The router's own cost: placement decisions, and the latency the front door adds.

    pdserve bench router

1. Decision time with 10, 100 and 1,000 instances (half prefill, half decode,
   one region, every prefill instance holding part of a shared prefix), for
   every policy: the router's region choice plus the policy, in process.
2. Under load, on a real local cluster (builtin:tiny, one prefill and one
   decode instance) driven over gRPC by many concurrent streams: the router's
   recorded decision times, and the time from a token being ready at the
   router to the front door having written it to the client.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.bench.report import write_json
from pdserve.core.messages import LoadReport
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.prefix_index import prompt_block_hashes
from pdserve.router.router import CompletionInput, InstanceInfo, Router


def _percentile(values: list[float], p: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(p * len(data)))]


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


def _tiny_cluster() -> tuple[Any, Any, Any]:
    """A router with one prefill and one decode instance of builtin:tiny on local Ray."""
    import ray

    from pdserve.cluster.topology import RegionInstances, add_instance, start_router
    from pdserve.core.builtin_models import resolve_model
    from pdserve.core.config import DisaggregationConfig, build_engine_config
    from pdserve.core.model_config import ModelConfig
    from pdserve.parallel.instance import RankResources

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    path = str(resolve_model("builtin:tiny"))
    model, engine = ModelConfig.from_dir(path), build_engine_config("builtin:tiny")
    router, doors = start_router(RouterConfig(model_name="tiny", auth_disabled=True), path)
    region = RegionInstances("local")
    for role in ("decode", "prefill"):
        add_instance(
            router,
            region,
            role,
            model,
            engine,
            "shm",
            RankResources(num_cpus=0.5),
            DisaggregationConfig(),
        )
    return router, doors, region


def front_door_under_load(concurrency: int, requests: int, tokens: int) -> dict[str, Any]:
    import grpc
    import ray

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    router, doors, region = _tiny_cluster()
    stub = pb_grpc.CompletionStub(grpc.insecure_channel(f"{doors.host}:{doors.grpc_port}"))
    client_ttft: list[float] = []

    def worker(w: int) -> None:
        for i in range(requests):
            req = pb.CompletionRequest(
                model="tiny", prompt=f"request {w} {i} " * 20,
                sampling=pb.SamplingOptions(max_tokens=tokens, temperature=0, ignore_eos=True),
            )  # fmt: skip
            start = time.monotonic()
            for n, _ in enumerate(stub.Generate(req)):
                if n == 0:
                    client_ttft.append(time.monotonic() - start)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    stats = ray.get(router.stats.remote())
    for instance in region.prefill + region.decode:
        instance.shutdown()
    ray.kill(router)
    return {
        "concurrency": concurrency,
        "requests": concurrency * requests,
        "tokens_per_request": tokens,
        "seconds": round(elapsed, 2),
        "door_delay_us": stats.door_delay_us,
        "decision_us": stats.decision_us,
        "client_ttft_ms_p50": round(statistics.median(client_ttft) * 1e3, 1),
    }


def validation_cost(rounds: int) -> dict[str, Any]:
    """The checks the front doors run on every request, on a typical one, in process.

    Times the whole admission path of a text request (sampling parameters,
    Unicode and range checks, tokenizing, the context check, the id and region
    checks) and, separately, the checks alone (no tokenizing), per request.
    """
    from pdserve.core.builtin_models import resolve_model
    from pdserve.core.tokenizer import Tokenizer
    from pdserve.router.frontdoor.requests import (
        completion_input,
        fit_context,
        prompt_tokens,
        sampling_params,
    )

    tokenizer = Tokenizer.from_dir(resolve_model("builtin:tiny"))
    prompt = "The router sees the whole cluster and places every request. " * 32  # ~2 KB
    fields = {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
              "stop": ["\n\n", "###", "END", "</s>"], "stop_token_ids": [2, 3]}  # fmt: skip
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
    load = front_door_under_load(args.concurrency, args.requests, args.tokens)
    print(json.dumps(load))
    if args.out:
        cmd = f"pdserve bench router --concurrency {args.concurrency} --requests {args.requests} --tokens {args.tokens}"
        result = {"command": cmd, "decisions": decisions, "validation": validation, "load": load}
        write_json(Path(args.out), result)
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("router", help="router decision time and front-door latency")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=4, help="per concurrent client")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default="bench/out/router.json")
    p.set_defaults(func=run)
