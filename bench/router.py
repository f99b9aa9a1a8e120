"""The router's own cost: placement decisions, and the latency the front door adds.

    pdserve bench router

1. Decision time with 10, 100 and 1,000 instances (half prefill, half decode,
   one region, every prefill instance holding part of a shared prefix), for
   every policy: the router's region choice plus the policy, in process.
2. Under load, on a real local cluster (builtin:tiny, one prefill and one
   decode instance) driven over gRPC by many concurrent streams: the router's
   recorded decision times, and the time from a token being ready at the
   router to the front door having written it to the client; with
   ``--router-cpu N`` also with the router actor alone on core N and every
   other process on the remaining cores, alternated ``--repeat`` times.
3. After each load run, the floor gRPC sets: a bare grpc.aio server whose
   streams are all woken at once and each write one chunk (no router).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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


def _threads_on(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (``taskset -a -p``; threads started later
    inherit their creator's set)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended
            os.sched_setaffinity(int(tid), cpus)


def pin_router(router: Any, router_cpu: int) -> None:
    """The router actor on core ``router_cpu`` alone; this process (the clients) and
    every other process of the local Ray session (engines, raylet) on the others."""
    import psutil
    import ray

    router_pid = ray.get(router.__ray_call__.remote(lambda _: os.getpid()))
    others = os.sched_getaffinity(0) - {router_cpu}
    if not others:
        raise SystemExit(f"--router-cpu {router_cpu}: no other core is left for the engines")
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(FileNotFoundError):  # a process that ended meanwhile
            _threads_on(proc.pid, {router_cpu} if proc.pid == router_pid else others)


def front_door_under_load(
    concurrency: int, requests: int, tokens: int, router_cpu: int | None = None
) -> dict[str, Any]:
    """``router_cpu``: pin the router actor to that core and the rest to the others."""
    import grpc
    import ray

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    router, doors, region = _tiny_cluster()
    if router_cpu is not None:
        pin_router(router, router_cpu)
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
        "router_cpu": "shared" if router_cpu is None else router_cpu,
        "concurrency": concurrency,
        "requests": concurrency * requests,
        "tokens_per_request": tokens,
        "seconds": round(elapsed, 2),
        "door_delay_us": stats.door_delay_us,
        "decision_us": stats.decision_us,
        "client_ttft_ms_p50": round(statistics.median(client_ttft) * 1e3, 1),
    }


class _FloorService:
    """``Generate`` streams on a bare grpc.aio server, woken together each step."""

    def __init__(self, concurrency: int, steps: int) -> None:
        self.concurrency, self.steps = concurrency, steps
        self.waiters: list[Any] = []
        self.parked = asyncio.Event()  # every stream waits for the next step
        self.delays: list[float] = []

    async def Generate(self, request: Any, context: Any) -> Any:
        from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb

        for _ in range(self.steps):
            woken = asyncio.get_running_loop().create_future()
            self.waiters.append(woken)
            if len(self.waiters) == self.concurrency:
                self.parked.set()
            ready_at = await woken
            yield pb.CompletionChunk(request_id="r", text="ab", token_ids=[1], model="tiny")
            self.delays.append(time.monotonic() - ready_at)


def _floor_clients(port: int, concurrency: int, cpus: set[int] | None) -> None:
    import grpc

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    stub = pb_grpc.CompletionStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def one() -> None:
        for _ in stub.Generate(pb.CompletionRequest(prompt="x")):
            pass

    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


async def _serve_floor(concurrency: int, steps: int, others: set[int] | None) -> list[float]:
    import multiprocessing

    import grpc

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb

    server = grpc.aio.server()
    service = _FloorService(concurrency, steps)
    generate = grpc.unary_stream_rpc_method_handler(
        service.Generate,
        request_deserializer=pb.CompletionRequest.FromString,
        response_serializer=pb.CompletionChunk.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.v1.Completion", {"Generate": generate}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ctx = multiprocessing.get_context("spawn")
    clients = ctx.Process(target=_floor_clients, args=(port, concurrency, others))
    clients.start()
    for _ in range(steps):
        await service.parked.wait()
        service.parked.clear()
        woken, service.waiters = service.waiters, []
        now = time.monotonic()
        for future in woken:
            future.set_result(now)
        await asyncio.sleep(0.01)  # the next engine step
    await asyncio.to_thread(clients.join)
    await server.stop(None)
    return service.delays


def grpc_floor(concurrency: int, steps: int, router_cpu: int | None) -> dict[str, Any]:
    """gRPC alone, no router: ``concurrency`` streams woken together every 10 ms (as
    one token batch wakes them), one chunk each; the time from the wake-up to the
    chunk written, the floor under ``door_delay_us``. Clients in another process."""
    mine = os.sched_getaffinity(0)
    others = None if router_cpu is None else mine - {router_cpu}
    if router_cpu is not None:
        os.sched_setaffinity(0, {router_cpu})
    try:
        delays = asyncio.run(_serve_floor(concurrency, steps, others))
    finally:
        os.sched_setaffinity(0, mine)
    return {
        "router_cpu": "shared" if router_cpu is None else router_cpu,
        "concurrency": concurrency,
        "grpc_only_delay_us": {
            "p50": round(_percentile(delays, 0.5) * 1e6, 1),
            "p99": round(_percentile(delays, 0.99) * 1e6, 1),
        },
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


def under_load(args: argparse.Namespace) -> dict[str, Any]:
    """The load runs, shared cores and (with ``--router-cpu``) pinned, alternated
    ``--repeat`` times; each with the gRPC-only floor measured right after it."""
    placements = [None] if args.router_cpu is None else [None, args.router_cpu]
    runs = []
    for _ in range(args.repeat):
        for cpu in placements:
            row = front_door_under_load(args.concurrency, args.requests, args.tokens, cpu)
            row["grpc_only_delay_us"] = grpc_floor(args.concurrency, 100, cpu)["grpc_only_delay_us"]
            print(json.dumps(row))
            runs.append(row)
    medians = {}
    for cpu in placements:
        mine = [r for r in runs if r["router_cpu"] == ("shared" if cpu is None else cpu)]
        medians["shared" if cpu is None else f"cpu{cpu}"] = {
            f"{key}_{q}": statistics.median(r[key][q] for r in mine)
            for key in ("door_delay_us", "decision_us", "grpc_only_delay_us")
            for q in ("p50", "p99")
        }
    print(json.dumps({"medians": medians}))
    return {"runs": runs, "medians": medians}


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
    load = under_load(args)
    if args.out:
        cmd = (
            f"pdserve bench router --concurrency {args.concurrency} --requests {args.requests}"
            f" --tokens {args.tokens} --repeat {args.repeat}"
            + ("" if args.router_cpu is None else f" --router-cpu {args.router_cpu}")
        )
        result = {"command": cmd, "decisions": decisions, "validation": validation, "load": load}
        write_json(Path(args.out), result)
    return 0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("router", help="router decision time and front-door latency")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=4, help="per concurrent client")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument(
        "--router-cpu",
        type=int,
        default=None,
        help="also run with the router actor pinned to this core, the rest on the others",
    )
    p.add_argument("--repeat", type=int, default=1, help="load runs per placement, alternated")
    p.add_argument("--out", default="bench/out/router.json")
    p.set_defaults(func=run)
