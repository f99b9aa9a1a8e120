"""A region's instances started one after another against all at once, and a whole
cluster's start.

    pdserve bench startup --instances 3 --repeats 3

One embedded Ray instance; each repeat starts ``--instances`` instances of
``--model`` (one prefill, the rest decode) one after another, shuts them down,
then starts them at once as the controller starts a region's missing instances
(``pdserve.cluster.membership.in_parallel``), and shuts them down again. A time
runs from the first start call to the last instance up (placement groups, rank
processes, weights, KV cache, engine loop), not paired or registered. Then it
starts a cluster of the same instances as ``pdserve serve`` does
(``start_controller``: the controller, the router, the instances, paired and
registered) and stops it; that time runs until the cluster answers with its
endpoints. Written: each repeat's three times, and the first two's ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from pdserve.bench.flags import add_embedded_ray_flags
from pdserve.bench.report import write_with_args
from pdserve.core.options import options_from

if TYPE_CHECKING:
    from pdserve.cluster.instance_spec import Role


@dataclass(frozen=True)
class StartupOptions:
    """``pdserve bench startup``'s options, in the order of its flags."""

    model: str = "builtin:tiny"  # the model of every instance
    instances: int = 3  # instances started (one prefill, the rest decode)
    repeats: int = 3  # rounds timed
    num_cpus: int = 4  # the embedded Ray instance's CPUs
    out: str = "bench/out/startup.json"  # the result file


def _timed(start: Any, roles: list[Role], at_once: bool) -> float:
    from pdserve.cluster.membership import in_parallel

    began = time.monotonic()
    started = in_parallel(start, roles, "bench") if at_once else [start(r) for r in roles]
    took = time.monotonic() - began
    for instance in started:
        instance.shutdown()
    time.sleep(2.0)  # their processes exit before the next case starts
    return took


CLUSTER = """\
model: {model}
connector: shm
engine: {{max_num_batched_tokens: 256}}
regions:
  - name: east
    prefill: {{count: 1, num_cpus_per_rank: 0.25}}
    decode: {{count: {decode}, num_cpus_per_rank: 0.25}}
server: {{host: 127.0.0.1, grpc_port: 0, http_port: 0}}
auth: {{disabled: true}}
"""


def _cluster(args: StartupOptions) -> float:
    """Seconds from ``start_controller`` to the cluster's endpoints (then stopped)."""
    from pdserve.cluster.config import parse_config
    from pdserve.cluster.serve import start_controller

    config = parse_config(CLUSTER.format(model=args.model, decode=args.instances - 1), "bench")
    began = time.monotonic()
    controller, _ = start_controller(config)
    took = time.monotonic() - began
    ray.get(controller.stop.remote())
    ray.kill(controller)
    time.sleep(2.0)
    return took


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(StartupOptions, args))


def benchmark(args: StartupOptions) -> int:
    """Instances started one after another and at once, and a whole cluster; written."""
    from pdserve.cluster.instances import start_instance
    from pdserve.core.config import build_engine_config
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model
    from pdserve.parallel.instance import RankResources

    model = ModelConfig.from_dir(str(resolve_model(args.model)))
    engine = build_engine_config(args.model, max_num_batched_tokens=256)
    roles: list[Role] = ["prefill"]
    roles += ["decode"] * (args.instances - 1)

    def start(role: Role) -> Any:
        return start_instance(role, model, engine, "shm", RankResources(num_cpus=0.25))

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        rows = [
            {
                "one_after_another_s": _timed(start, roles, False),
                "at_once_s": _timed(start, roles, True),
                "cluster_s": _cluster(args),
            }
            for _ in range(args.repeats)
        ]
    finally:
        ray.shutdown()
    for i, row in enumerate(rows):
        row["ratio"] = row["at_once_s"] / row["one_after_another_s"]
        print(
            f"repeat {i}: {args.instances} instances one after another "
            f"{row['one_after_another_s']:.2f} s, at once {row['at_once_s']:.2f} s "
            f"({row['ratio']:.2f}x); a cluster of them {row['cluster_s']:.2f} s"
        )
    print(
        f"median ratio {statistics.median(r['ratio'] for r in rows):.2f}x; median cluster "
        f"start {statistics.median(r['cluster_s'] for r in rows):.2f} s"
    )
    write_with_args(args.out, args, {"repeats": rows})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    counts = {"--instances": 3, "--repeats": 3}
    add_embedded_ray_flags(p, run, counts, "bench/out/startup.json")
