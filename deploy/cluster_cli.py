"""``pdserve serve | submit | status | scale | demo``: the cluster commands.

A failure an operator can meet (no cluster at the address, a refused token,
a layout that does not fit, a bad argument) leaves these commands as a
:class:`PdserveError`, which the command line prints as one line with a
nonzero exit; errors raised inside the controller are unwrapped from Ray's.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from pdserve.core.errors import (
    InstanceFailedError,
    InvalidArgumentError,
    PdserveError,
    first_line,
)

LOCAL_CONFIG = "local.yaml"


def example_config(name: str) -> Path:
    """A config shipped with pdserve (``deploy/configs/<name>``)."""
    return Path(str(resources.files("pdserve.deploy") / "configs" / name))


@contextlib.contextmanager
def _operator_errors() -> Iterator[None]:
    """Turn Ray's errors into one-line pdserve errors (the cause, and what to do)."""
    from ray.exceptions import AuthenticationError, RayError, RayTaskError

    try:
        yield
    except RayTaskError as e:
        if isinstance(e.cause, PdserveError):
            raise e.cause from None
        raise InstanceFailedError(f"the controller failed: {first_line(e.cause or e)}") from None
    except AuthenticationError as e:
        raise InstanceFailedError(
            f"the Ray cluster refused pdserve's token ({first_line(e)}): run pdserve as the user "
            "who started the cluster, or set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to its token"
        ) from None
    except RayError as e:
        raise InstanceFailedError(f"Ray: {first_line(e)}") from None


def _get(ref: Any) -> Any:
    import ray

    with _operator_errors():
        return ray.get(ref)


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import load_config
    from pdserve.cluster.serve import serve
    from pdserve.sim.capacity import capacity_for

    config = load_config(args.config)
    capacity = capacity_for(config)  # a proactive planner's model, checked before Ray starts
    with _operator_errors():
        serve(config, args.ray_address, capacity=capacity)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit ``pdserve serve`` as a Ray job (the config travels in the job's working dir)."""
    from pdserve.cluster.config import load_config
    from pdserve.cluster.connect import use_ray_token
    from pdserve.sim.capacity import capacity_for

    config = Path(args.config).resolve()
    capacity_for(load_config(config))  # refuse a bad config here, not on the cluster
    use_ray_token()
    client = _job_client(args.address)
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
                raise InstanceFailedError(f"Ray refused the job: {first_line(e)}") from None
            time.sleep(2.0)
    print(f"submitted job {job_id} to {args.address}")
    print(f"follow it with: ray job logs --address {args.address} --follow {job_id}")
    return 0


def _job_client(address: str) -> Any:
    """The job client of the Ray cluster whose dashboard is at ``address``
    (``http(s)://HOST:PORT``), or whose GCS is (``HOST:PORT``, ``auto``: Ray asks
    it where the dashboard is, for half a minute when nobody answers)."""
    from ray.exceptions import RayError
    from ray.job_submission import JobSubmissionClient

    from pdserve.cluster.connect import is_host_port, listening

    hint = "pass the head's dashboard address, e.g. --address http://HEAD:8265"
    if address != "auto" and address.partition("://")[0] not in ("http", "https"):
        if address == "local" or "://" in address or not is_host_port(address):
            raise InvalidArgumentError(
                "--address", f"{address!r} is not http(s)://HOST:PORT nor HOST:PORT: {hint}"
            )
        if not listening(address):
            raise InstanceFailedError(f"no Ray cluster at {address} (nothing listens): {hint}")
    try:
        return JobSubmissionClient(address)
    except ConnectionError as e:
        raise InstanceFailedError(
            f"no Ray dashboard at {address} ({first_line(e)}): {hint}"
        ) from None
    except ValueError as e:
        raise InvalidArgumentError("--address", f"{first_line(e)}: {hint}") from None
    except RayError as e:
        raise InstanceFailedError(
            f"no Ray cluster at {address} ({first_line(e)}): {hint}"
        ) from None


def _controller(address: str) -> Any:
    """The running cluster's controller; never starts a Ray instance to ask an empty one."""
    from pdserve.cluster.connect import connect, find_controller

    with _operator_errors():
        connect(address, start_local=False)
        return find_controller()


def cmd_status(args: argparse.Namespace) -> int:
    status = _get(_controller(args.ray_address).status.remote())
    print(f"{'region':<12} {'P:D':>7} {'target':>8}")
    for r in status.regions:
        line = (
            f"{r.name:<12} {r.prefill:>3}:{r.decode:<3} {r.target_prefill:>4}:{r.target_decode:<3}"
        )
        if r.starting:
            line += f"  starting {r.starting}"
        if r.failed_starts:
            line += (
                f"  {r.failed_starts} failed start(s), retry in {r.retry_in_s:.0f} s: "
                f"{r.last_error}"
            )
        print(line)
    print(f"\n{'instance':<28} {'region':<10} {'role':<8} state")
    for i in status.instances:
        state = "draining" if i.draining else ("healthy" if i.healthy else "unhealthy")
        reason = f" ({i.reason})" if i.reason else ""
        print(f"{i.instance_id:<28} {i.region:<10} {i.role:<8} {state}{reason}")
    if len(status.models) > 1:
        print()
        print_versions(status.models)
    print(f"\nplanner: {status.planner_mode}")
    for d in status.decisions[-5:]:
        print(
            f"  {time.strftime('%H:%M:%S', time.localtime(d.at))} {d.region} {d.action}: {d.reason}"
        )
    return 0


def print_versions(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<16} {'version':<10} {'state':<10} {'traffic':>8}  instances (P:D per region)")
    for row in rows:
        regions = row.get("regions", {})
        pools = " ".join(f"{r}={c['prefill']}:{c['decode']}" for r, c in regions.items())
        share = f"{row['traffic']:.0%}" if "traffic" in row else "-"
        print(f"{row['model']:<16} {row['version']:<10} {row['state']:<10} {share:>8}  {pools}")


def cmd_scale(args: argparse.Namespace) -> int:
    if args.prefill is None and args.decode is None:  # a no-op that logged a decision
        raise InvalidArgumentError("scale", "give --prefill, --decode or both")
    controller = _controller(args.ray_address)
    if args.model:
        rows = _get(
            controller.models.remote(
                "scale",
                name=args.model,
                region=args.region,
                prefill=args.prefill,
                decode=args.decode,
            )
        )
        print_versions(rows)
        return 0
    region = _get(controller.scale.remote(args.region, args.prefill, args.decode))
    print(f"{region.name}: {region.prefill} prefill, {region.decode} decode")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the local two-region cluster, stream a few requests over gRPC, keep serving."""
    from pdserve.cluster.config import load_config
    from pdserve.cluster.connect import connect
    from pdserve.cluster.serve import describe, start_controller, stop_on_signals, wait_for_stop

    config = load_config(args.config or example_config(LOCAL_CONFIG))
    print(f"pdserve demo: {config.model} continues four Python prompts, streamed over gRPC;")
    print("the point is the path: router -> prefill -> KV pages -> decode -> stream.\n")
    from pdserve.sim.capacity import capacity_for

    capacity = capacity_for(config)
    connect("local", config.ray_num_cpus)
    stop = stop_on_signals()
    controller, endpoints = start_controller(config, capacity)
    print(describe(endpoints), "\n", flush=True)
    regions = [r.name for r in config.regions]
    for i, prompt in enumerate(DEMO_PROMPTS):
        if stop.is_set():  # Ctrl-C while the demo streams: stop now
            break
        _stream_one(endpoints, prompt, regions[i % len(regions)], config.router.api_keys)
    if not args.once or stop.is_set():
        if not stop.is_set():
            print("serving; Ctrl-C to stop", flush=True)
            wait_for_stop(stop)
        print("pdserve demo: stopping", flush=True)
    import ray

    ray.get(controller.stop.remote())
    return 0


DEMO_PROMPTS = [
    "def fibonacci(n):",
    "class Router:\n    def __init__(self, regions):",
    "import os\nimport sys\n\n\ndef main():",
    "    def __repr__(self):\n        return",
]


def _stream_one(endpoints: Any, prompt: str, region: str, keys: tuple[str, ...]) -> None:
    import grpc

    from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
    from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

    stub = pb_grpc.CompletionStub(grpc.insecure_channel(endpoints.grpc_address))
    metadata = (("x-pdserve-region", region),) + (
        (("authorization", f"Bearer {keys[0]}"),) if keys else ()
    )
    request = pb.CompletionRequest(
        prompt=prompt, sampling=pb.SamplingOptions(max_tokens=40, temperature=0.6, seed=7)
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


def add_cluster_parsers(sub: argparse._SubParsersAction) -> None:
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
    scale.add_argument(
        "--model", default=None, help="a model of the config's models list (its stable version)"
    )
    ray_address(scale)
    scale.set_defaults(func=cmd_scale)

    demo = sub.add_parser("demo", help="the local two-region cluster, with a few streamed requests")
    demo.add_argument("--config", default=None, help=f"default: the shipped {LOCAL_CONFIG}")
    demo.add_argument("--once", action="store_true", help="exit after the requests")
    demo.set_defaults(func=cmd_demo)
