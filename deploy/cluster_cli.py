"""``pdserve serve | submit | status | scale | demo``: the cluster commands."""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

LOCAL_CONFIG = "local.yaml"


def example_config(name: str) -> Path:
    """A config shipped with pdserve (``deploy/configs/<name>``)."""
    return Path(str(resources.files("pdserve.deploy").joinpath("configs", name)))


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import load_config
    from pdserve.cluster.serve import serve

    serve(load_config(args.config), args.ray_address)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit ``pdserve serve`` as a Ray job (the config travels in the job's working dir)."""
    from ray.job_submission import JobSubmissionClient

    from pdserve.cluster.config import load_config

    config = Path(args.config).resolve()
    load_config(config)  # refuse a bad config here, not on the cluster
    _use_ray_token()
    client = JobSubmissionClient(args.address)
    deadline = time.monotonic() + 60
    while True:
        try:
            job_id = client.submit_job(
                entrypoint=f"pdserve serve --config {config.name}",
                runtime_env={"working_dir": str(config.parent)},
                submission_id=args.job_id,
            )
            break
        except RuntimeError as e:
            # A head that just started has no job agent yet; Ray says to try again.
            if "try again later" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)
    print(f"submitted job {job_id} to {args.address}")
    print(f"follow it with: ray job logs --address {args.address} --follow {job_id}")
    return 0


def _use_ray_token() -> None:
    """Send the Ray cluster token when one is available (``ray start`` turns token auth on)."""
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if "RAY_AUTH_TOKEN" in os.environ or token_file.is_file():
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def _controller(address: str) -> Any:
    from pdserve.cluster.serve import connect, find_controller

    if address not in ("auto", "local"):
        _use_ray_token()
    connect(address)
    return find_controller()


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    status = ray.get(_controller(args.ray_address).status.remote())
    print(f"{'region':<12} {'P:D':>7} {'target':>8}")
    for r in status.regions:
        print(
            f"{r.name:<12} {r.prefill:>3}:{r.decode:<3} {r.target_prefill:>4}:{r.target_decode:<3}"
        )
    print(f"\n{'instance':<28} {'region':<10} {'role':<8} state")
    for i in status.instances:
        state = "draining" if i.draining else ("healthy" if i.healthy else "unhealthy")
        print(f"{i.instance_id:<28} {i.region:<10} {i.role:<8} {state}")
    print(f"\nplanner: {status.planner_mode}")
    for d in status.decisions[-5:]:
        print(
            f"  {time.strftime('%H:%M:%S', time.localtime(d.at))} {d.region} {d.action}: {d.reason}"
        )
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    import ray

    region = ray.get(
        _controller(args.ray_address).scale.remote(args.region, args.prefill, args.decode)
    )
    print(f"{region.name}: {region.prefill} prefill, {region.decode} decode")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the local two-region cluster, stream a few requests over gRPC, keep serving."""
    from pdserve.cluster.config import load_config
    from pdserve.cluster.serve import connect, describe, start_controller

    config = load_config(args.config or example_config(LOCAL_CONFIG))
    print("pdserve demo: builtin:tiny has random weights, so the text is meaningless;")
    print("the point is the path: router -> prefill -> KV pages -> decode -> stream.\n")
    connect("local", config.ray_num_cpus)
    controller, endpoints = start_controller(config)
    print(describe(endpoints), "\n", flush=True)
    regions = [r.name for r in config.regions]
    for i, prompt in enumerate(DEMO_PROMPTS):
        _stream_one(endpoints, prompt, regions[i % len(regions)], config.router.api_keys)
    if not args.once:
        print("serving; Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    import ray

    ray.get(controller.stop.remote())
    return 0


DEMO_PROMPTS = [
    "The router sees the whole cluster.",
    "What is a block table? It maps the logical blocks of a sequence to physical pages.",
    "Once upon a time there was a small server",
    "Prefill is heavy on arithmetic and short. Decode is light on arithmetic, heavy on memory.",
]


def _stream_one(endpoints: Any, prompt: str, region: str, keys: tuple[str, ...]) -> None:
    import grpc

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    stub = pb_grpc.CompletionStub(grpc.insecure_channel(f"{endpoints.host}:{endpoints.grpc_port}"))
    metadata = (("x-pdserve-region", region),) + (
        (("authorization", f"Bearer {keys[0]}"),) if keys else ()
    )
    request = pb.CompletionRequest(
        prompt=prompt, sampling=pb.SamplingOptions(max_tokens=24, temperature=0.8, seed=7)
    )
    print(f"[{region}] {prompt!r}\n  -> ", end="", flush=True)
    start = time.monotonic()
    times: list[float] = []
    for chunk in stub.Generate(request, metadata=metadata):
        times.append(time.monotonic())
        print(chunk.text, end="", flush=True)
    ttft = (times[0] - start) * 1e3
    tpot = (times[-1] - times[0]) / max(len(times) - 1, 1) * 1e3
    print(f"\n  TTFT {ttft:.0f} ms, TPOT {tpot:.1f} ms, {len(times)} chunks\n", flush=True)


def add_cluster_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    def ray_address(p: argparse.ArgumentParser, default: str = "auto") -> None:
        p.add_argument(
            "--ray-address", default=default, help="auto, local (embedded) or a Ray address"
        )

    serve = sub.add_parser("serve", help="run a serving cluster from a config file")
    serve.add_argument("--config", required=True)
    ray_address(serve)
    serve.set_defaults(func=cmd_serve)

    submit = sub.add_parser("submit", help="submit pdserve serve as a Ray job")
    submit.add_argument(
        "--address", required=True, help="Ray dashboard address, e.g. http://HEAD:8265"
    )
    submit.add_argument("--config", required=True)
    submit.add_argument("--job-id", default=None)
    submit.set_defaults(func=cmd_submit)

    status = sub.add_parser("status", help="regions, instances, roles, health and P:D")
    ray_address(status)
    status.set_defaults(func=cmd_status)

    scale = sub.add_parser("scale", help="change a region's prefill and decode counts")
    scale.add_argument("--region", required=True)
    scale.add_argument("--prefill", type=int, default=None)
    scale.add_argument("--decode", type=int, default=None)
    ray_address(scale)
    scale.set_defaults(func=cmd_scale)

    demo = sub.add_parser("demo", help="the local two-region cluster, with a few streamed requests")
    demo.add_argument("--config", default=None, help=f"default: the shipped {LOCAL_CONFIG}")
    demo.add_argument("--once", action="store_true", help="exit after the requests")
    demo.set_defaults(func=cmd_demo)
