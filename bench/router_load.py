"""The latency the front doors add, under load on a real local cluster.

A router with one prefill and one decode instance of builtin:tiny on local Ray,
driven by ``concurrency`` concurrent streams (gRPC ``Generate`` with the
generated client in threads, or OpenAI HTTP streaming completions read as SSE
by an aiohttp client), ``requests`` each of ``tokens`` tokens. Reported: the
router's decision times and its door delay (a token delta ready at the router
-> the front door has written it), per protocol, on shared cores or with the
router actor alone on one core; each run followed by the bare library's floor
(:mod:`pdserve.bench.router_floor`). ``code``: a pdserve import tree the router
actor runs instead of this one (a before/after comparison in one session).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.router_floor import library_floor, percentile
from pdserve.router.config import RouterConfig

PROTOCOLS = ("grpc", "http")


def _tiny_cluster(code: str | None) -> tuple[Any, Any, Any]:
    """A router with one prefill and one decode instance of builtin:tiny on local Ray."""
    import ray

    from pdserve.cluster.topology import RegionInstances, add_instance, start_router
    from pdserve.core.config import DisaggregationConfig, build_engine_config
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model
    from pdserve.parallel.instance import RankResources

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    path = str(resolve_model("builtin:tiny"))
    model, engine = ModelConfig.from_dir(path), build_engine_config("builtin:tiny")
    options = None if code is None else {"runtime_env": {"env_vars": {"PYTHONPATH": code}}}
    # A fixed number of clients, none refused: the TTFT-driven cap (adaptive admission)
    # would shed them on a busy machine and leave too few streams to measure.
    config = RouterConfig(model_name="tiny", auth_disabled=True, adaptive_admission=False)
    router, doors = start_router(config, path, options)
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


def import_tree(source: Path) -> str:
    """A folder of links making ``import pdserve.X`` find the source tree ``source``
    (a checkout or ``git archive`` export; its pyproject's package map); for PYTHONPATH."""
    text = (source / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    where = Path(tempfile.mkdtemp(prefix="pdserve-tree-"))
    top = where / "pdserve"
    top.mkdir()
    for package, folder in re.findall(r'^"([\w.]+)"\s*=\s*"([\w/]+)"', section, re.MULTILINE):
        parts = package.split(".")
        if package == "pdserve":  # the top-level API: its files go into pdserve/ itself
            for path in (source / folder).glob("*.py"):
                (top / path.name).symlink_to(path.resolve())
        elif len(parts) == 2:  # nested packages live inside their parent's folder
            (top / parts[1]).symlink_to((source / folder).resolve(), target_is_directory=True)
    return str(where)


def router_source(router: Any) -> str:
    """The file the router actor imported its router module from (which tree it runs)."""
    import ray

    return str(
        ray.get(
            router.__ray_call__.remote(
                lambda a: __import__("sys").modules["pdserve.router.router"].__file__
            )
        )
    )


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


def _grpc_load(doors: Any, concurrency: int, requests: int, tokens: int) -> list[float]:
    """Client TTFTs of ``concurrency`` threads, each streaming ``requests`` completions."""
    import grpc

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    stub = pb_grpc.CompletionStub(grpc.insecure_channel(f"{doors.host}:{doors.grpc_port}"))
    client_ttft: list[float] = []

    def worker(w: int) -> None:
        for i in range(requests):
            req = pb.CompletionRequest(
                model="tiny",
                prompt=f"request {w} {i} " * 20,
                sampling=pb.SamplingOptions(max_tokens=tokens, temperature=0, ignore_eos=True),
            )
            start = time.monotonic()
            for n, _ in enumerate(stub.Generate(req)):
                if n == 0:
                    client_ttft.append(time.monotonic() - start)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return client_ttft


async def _http_clients(url: str, concurrency: int, requests: int, tokens: int) -> list[float]:
    import aiohttp

    client_ttft: list[float] = []

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        for i in range(requests):
            body = {
                "model": "tiny",
                "prompt": f"request {w} {i} " * 20,
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            start = time.monotonic()
            async with session.post(url, json=body) as resp:
                resp.raise_for_status()
                first = True
                async for line in resp.content:
                    if first and line.startswith(b"data: "):
                        client_ttft.append(time.monotonic() - start)
                        first = False

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session, w) for w in range(concurrency)))
    return client_ttft


def _http_load(doors: Any, concurrency: int, requests: int, tokens: int) -> list[float]:
    """Client TTFTs of ``concurrency`` streaming completions at a time (one aiohttp loop)."""
    url = f"http://{doors.host}:{doors.http_port}/v1/completions"
    return asyncio.run(_http_clients(url, concurrency, requests, tokens))


def _router_delays(router: Any) -> tuple[list[float], list[float]]:
    """The router's door delays and decision times so far (seconds), then cleared."""
    import ray

    def take(actor: Any) -> tuple[list[float], list[float]]:
        r = actor.router
        out = (list(r.door_delay_s), list(r.decision_s))
        r.door_delay_s.clear()
        r.decision_s.clear()
        return out

    return ray.get(router.__ray_call__.remote(take))


def _us(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {q: round(percentile(values, p) * 1e6, 1) for q, p in (("p50", 0.5), ("p99", 0.99))}


def front_door_under_load(
    concurrency: int,
    requests: int,
    tokens: int,
    router_cpu: int | None = None,
    protocols: tuple[str, ...] = ("grpc",),
    code: str | None = None,
) -> list[dict[str, Any]]:
    """One cluster, the load over each of ``protocols`` in turn; a row per protocol.
    ``router_cpu``: pin the router actor to that core and the rest to the others."""
    import ray

    router, doors, region = _tiny_cluster(code)
    source = router_source(router)
    if router_cpu is not None:
        pin_router(router, router_cpu)
    rows = []
    try:
        _router_delays(router)  # start-up has no deltas; from here each protocol its own
        for protocol in protocols:
            load = _grpc_load if protocol == "grpc" else _http_load
            start = time.monotonic()
            client_ttft = load(doors, concurrency, requests, tokens)
            elapsed = time.monotonic() - start
            door, decisions = _router_delays(router)
            rows.append(
                {
                    "protocol": protocol,
                    "code": "current" if code is None else code,
                    "router_module": source,
                    "router_cpu": "shared" if router_cpu is None else router_cpu,
                    "concurrency": concurrency,
                    "requests": concurrency * requests,
                    "tokens_per_request": tokens,
                    "seconds": round(elapsed, 2),
                    "door_delay_us": _us(door),
                    "decision_us": _us(decisions),
                    "client_ttft_ms_p50": round(statistics.median(client_ttft) * 1e3, 1),
                }
            )
    finally:
        for instance in region.prefill + region.decode:
            instance.shutdown()
        ray.kill(router)
    return rows


def _floor_key(protocol: str) -> str:
    return f"{protocol}_only_delay_us"


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over the runs of each (protocol, placement, code) of every p50 and p99."""
    groups: dict[str, list[dict[str, Any]]] = {}
    plain = all(r["protocol"] == "grpc" and r["code"] == "current" for r in runs)
    for r in runs:
        where = "shared" if r["router_cpu"] == "shared" else f"cpu{r['router_cpu']}"
        key = where if plain else f"{r['protocol']} {where} {r['code']}"
        groups.setdefault(key, []).append(r)
    medians = {}
    for key, mine in groups.items():
        names = ("door_delay_us", "decision_us", _floor_key(mine[0]["protocol"]))
        medians[key] = {
            f"{name}_{q}": round(statistics.median(r[name][q] for r in mine if name in r), 1)
            for name in names
            for q in ("p50", "p99")
            if any(name in r for r in mine)
        }
    return medians


@dataclass(frozen=True)
class LoadFlags:
    """The load flags of ``pdserve bench router``."""

    concurrency: int = 32  # concurrent clients
    requests: int = 4  # requests per concurrent client
    tokens: int = 32  # tokens of each answer
    router_cpu: int | None = None  # also run with the router actor pinned to this core
    repeat: int = 1  # load runs per placement, alternated
    protocol: str = "grpc"  # grpc, http, or both in turn
    baseline: str | None = None  # a pdserve source tree whose router the load also runs


def under_load(args: LoadFlags) -> dict[str, Any]:
    """The load runs, shared cores and (with ``--router-cpu``) pinned, alternated
    ``--repeat`` times, over each protocol (their order alternated too) and, with
    ``--baseline``, the baseline tree and this one alternated; each run followed by
    the bare library's floor for each protocol."""
    placements = [None] if args.router_cpu is None else [None, args.router_cpu]
    protocols = PROTOCOLS if args.protocol == "both" else (args.protocol,)
    codes = [None] if args.baseline is None else [import_tree(Path(args.baseline)), None]
    runs = []
    for repeat in range(args.repeat):
        for cpu in placements:
            order = protocols if repeat % 2 == 0 else protocols[::-1]
            for code in codes if repeat % 2 == 0 else codes[::-1]:
                rows = front_door_under_load(
                    args.concurrency, args.requests, args.tokens, cpu, order, code
                )
                for row in rows:
                    floor = library_floor(row["protocol"], args.concurrency, 100, cpu)
                    row[_floor_key(row["protocol"])] = floor
                    print(json.dumps(row), flush=True)
                    runs.append(row)
    medians = _medians(runs)
    print(json.dumps({"medians": medians}))
    return {"runs": runs, "medians": medians}
