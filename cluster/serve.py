"""Run a cluster from its config: the body of ``pdserve serve``.

``pdserve serve`` connects to the Ray cluster it finds (``RAY_ADDRESS``, or
one started on this machine with ``ray start``), or starts an embedded local
one; it starts the controller (a named actor, so ``pdserve status`` and
``pdserve scale`` can find it), prints where the front doors listen, and
serves until it gets SIGINT or SIGTERM. Submitted as a Ray job, the job's
driver is this same command.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.controller import Controller
from pdserve.core.errors import InstanceFailedError
from pdserve.router.actor import Endpoints

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve"
CONTROLLER = "pdserve-controller"


def connect(address: str, num_cpus: int | None = None) -> None:
    """``address``: "local" (embedded), "auto" (found, else embedded) or a Ray address."""
    if ray.is_initialized():
        return
    if address == "local":
        ray.init(
            num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False
        )
        return
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError:
        if address != "auto":
            raise
        logger.info("no Ray cluster found: starting an embedded local one")
        ray.init(
            num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False
        )


def start_controller(config: ClusterConfig) -> tuple[Any, Endpoints]:
    """Start the controller on this node (the head, for a Ray job), so the router
    it starts beside it listens where ``pdserve serve`` says it does."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = (
        ray.remote(Controller)
        .options(
            name=CONTROLLER,
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=16,
            scheduling_strategy=here,
        )
        .remote(config)
    )
    return actor, ray.get(actor.start.remote())


def find_controller() -> Any:
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise InstanceFailedError(
            "no pdserve cluster is running on this Ray cluster (start one with pdserve serve)"
        ) from None


def describe(endpoints: Endpoints) -> str:
    base = f"http://{endpoints.host}:{endpoints.http_port}"
    return (
        f"gRPC      {endpoints.host}:{endpoints.grpc_port}\n"
        f"HTTP      {base}/v1 (OpenAI-compatible)\n"
        f"metrics   {base}/metrics\n"
        f"dashboard {base}/dashboard"
    )


def serve(config: ClusterConfig, address: str, stop: threading.Event | None = None) -> None:
    """Start the cluster and block until ``stop`` is set or a signal arrives."""
    connect(address, config.ray_num_cpus)
    controller, endpoints = start_controller(config)
    print(f"pdserve: serving {config.model} from {config.source}")
    print(describe(endpoints))
    print(
        f"ray       {ray.get_runtime_context().gcs_address} (pdserve status --ray-address ...)",
        flush=True,
    )
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("pdserve: stopping", flush=True)
    ray.get(controller.stop.remote())
    ray.kill(controller)
