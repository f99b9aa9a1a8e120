"""Cold starts: request arrival to first token in a region scaled to zero.

    pdserve bench coldstart --repeats 3

One embedded Ray instance, two local clusters one after the other (one region,
no prefill instance: the decode instance prefills; planner off), and one
greedy gRPC request at a time, timed at the client from sending it to its
first token:

- ``running``: the region has its decode instance (the baseline);
- ``cold``: the region was scaled to zero (``min: 0``); the request waits in
  the router's cold-start queue while the controller starts an instance
  (placement group, rank process, weights, KV cache, engine loop);
- ``warm pool``: the same, with ``warm_pool: 1``: the controller takes the
  pooled instance (started, not joined) and only pairs and registers it.

Between two repeats the region is scaled to zero again (and, with the pool,
waits for the pool to refill). Written: one row per case (median, min, max of
the times to first token, and the controller's start phases of the last cold
start) and the JSON of every sample.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import grpc
import ray

from pdserve.bench.flags import add_embedded_ray_flags
from pdserve.bench.local import local_cluster
from pdserve.bench.report import write_with_args
from pdserve.core.options import options_from

CONFIG = """\
model: {model}
connector: shm
engine: {{dtype: float32, max_num_batched_tokens: 256}}
regions:
  - name: east
    prefill: {{count: 0, min: 0, max: 0, num_cpus_per_rank: 0.5}}
    decode: {{count: {count}, min: 0, max: 1, num_cpus_per_rank: 0.5}}
    warm_pool: {pool}
server: {{host: 127.0.0.1, grpc_port: 0, http_port: 0}}
auth: {{disabled: true}}
planner: {{mode: "off"}}
router: {{cold_start_queue: 8, cold_start_timeout_s: 300}}
"""


@dataclass(frozen=True)
class ColdstartOptions:
    """``pdserve bench coldstart``'s options, in the order of its flags."""

    model: str = "builtin:tiny"  # the model served
    repeats: int = 3  # first tokens timed per case
    max_tokens: int = 8  # tokens of each request
    num_cpus: int = 4  # the embedded Ray instance's CPUs
    out: str = "bench/out/coldstart.json"  # the result file


def _first_token_s(endpoints: Any, prompt: str, max_tokens: int) -> float:
    """Seconds from sending one greedy request to its first token (the whole stream is read)."""
    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoints.grpc_address) as channel:
        stub = pb_grpc.CompletionStub(channel)
        request = pb.CompletionRequest(prompt=prompt)
        request.sampling.CopyFrom(
            pb.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
        sent = time.monotonic()
        first: float | None = None
        for chunk in stub.Generate(request, timeout=600):
            if first is None and chunk.token_ids:
                first = time.monotonic() - sent
    assert first is not None, "no token came back"
    return first


def _controller() -> Any:
    from pdserve.cluster.connect import CONTROLLER, NAMESPACE

    return ray.get_actor(CONTROLLER, namespace=NAMESPACE)


def _wait(check: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not reach the state the benchmark waits for")
        time.sleep(0.2)


def _last_start(controller: Any) -> str:
    """The controller's event line of the last instance it started."""
    events = ray.get(controller.status.remote()).events
    return next((e for e in reversed(events) if " started " in e), "")


def _cases(args: ColdstartOptions, pool: int) -> dict[str, dict[str, Any]]:
    """Run one cluster: ``running`` and ``cold`` without a pool, ``warm pool`` with one."""
    prompt = "a region scaled to zero wakes up for this request"
    count = 0 if pool else 1
    text = CONFIG.format(model=args.model, count=count, pool=pool)
    out: dict[str, dict[str, Any]] = {}
    with local_cluster(text, args.num_cpus) as (endpoints, _):
        controller = _controller()

        def region() -> Any:
            return ray.get(controller.status.remote()).regions[0]

        names = ["warm pool"] if pool else ["running", "cold"]
        for name in names:
            samples = []
            for _ in range(args.repeats):
                if name != "running":
                    ray.get(controller.scale.remote("east", 0, 0, reason="bench: to zero"))
                    _wait(lambda: region().decode == 0 and region().warm == pool)
                samples.append(_first_token_s(endpoints, prompt, args.max_tokens))
            out[name] = {"ttft_s": samples, "last_start": _last_start(controller)}
    return out


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(ColdstartOptions, args))


def benchmark(args: ColdstartOptions) -> int:
    """The three cases, timed and printed; written with the options."""
    cases = {**_cases(args, 0), **_cases(args, 1)}
    print(f"{'case':<10} {'TTFT median':>12} {'min':>8} {'max':>8}  last start (controller)")
    for name, case in cases.items():
        s = case["ttft_s"]
        start = case["last_start"].split(" ", 1)[-1] if name != "running" else "-"
        print(f"{name:<10} {statistics.median(s):>11.2f}s {min(s):>7.2f}s {max(s):>7.2f}s  {start}")
    write_with_args(args.out, args, {"cases": cases})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    counts = {"--repeats": 3, "--max-tokens": 8}
    add_embedded_ray_flags(p, run, counts, "bench/out/coldstart.json")
