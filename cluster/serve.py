"""Run a cluster from its config: the body of ``pdserve serve``.

``pdserve serve`` connects to the Ray cluster it finds (``RAY_ADDRESS``, or
one started on this machine with ``ray start``), or starts an embedded local
one; it starts the controller (a named actor, so ``pdserve status`` and
``pdserve scale`` can find it), prints where the front doors listen, and
serves until it gets SIGINT or SIGTERM. Submitted as a Ray job, the job's
driver is this same command.

What an operator can get wrong ends in a :class:`PdserveError` that says what
is wrong and what to do (the command line prints it as one line): no Ray
cluster at the address, a pdserve cluster already running there, a layout
the cluster's CPUs or GPUs cannot hold (refused before any actor starts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

import ray
from ray.exceptions import ActorAlreadyExistsError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.connect import CONTROLLER, NAMESPACE, connect
from pdserve.cluster.controller import Controller
from pdserve.cluster.proactive import CapacityModel
from pdserve.core.errors import InstanceFailedError, PdserveError, first_line
from pdserve.core.layout import check_fits
from pdserve.router.actor import Endpoints

logger = logging.getLogger(__name__)


def start_controller(
    config: ClusterConfig, capacity: CapacityModel | None = None
) -> tuple[Any, Endpoints]:
    """Start the controller on this node (the head, for a Ray job), so the router
    it starts beside it listens where ``pdserve serve`` says it does.

    Refuses, before any actor starts, a layout the cluster's CPUs or GPUs cannot
    hold and a Ray cluster that runs a pdserve controller already; if the
    cluster fails to start, the controller is removed and the error says why.
    ``capacity`` is the latency model a proactive planner sizes regions with.
    """
    with contextlib.suppress(ValueError):
        ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        raise _already_running()
    check_fits(config.needs(), ray.cluster_resources())  # before any actor starts
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    try:
        actor: Any = (
            ray.remote(Controller)
            .options(
                name=CONTROLLER,
                namespace=NAMESPACE,
                num_cpus=0,
                max_concurrency=16,
                scheduling_strategy=here,
            )
            .remote(config, capacity)
        )
    except ActorAlreadyExistsError:  # started meanwhile
        raise _already_running() from None
    try:
        return actor, ray.get(actor.start.remote())
    except BaseException as e:
        ray.kill(actor)
        if isinstance(e, RayTaskError) and isinstance(e.cause, PdserveError):
            raise e.cause from None
        if isinstance(e, RayTaskError):
            raise InstanceFailedError(
                f"the cluster failed to start: {first_line(e.cause or e)}; "
                "check the config's resources against ray status"
            ) from None
        raise


def _already_running() -> InstanceFailedError:
    address = ray.get_runtime_context().gcs_address
    return InstanceFailedError(
        f"a pdserve cluster is already running on the Ray cluster at {address}: "
        f"see it with pdserve status --ray-address {address}, or stop it "
        "(Ctrl-C its pdserve serve, or ray job stop) before serving another"
    )


def describe(endpoints: Endpoints) -> str:
    base = endpoints.http_url
    return (
        f"gRPC      {endpoints.grpc_address}\n"
        f"HTTP      {base}/v1 (OpenAI-compatible)\n"
        f"metrics   {base}/metrics\n"
        f"dashboard {base}/dashboard"
    )


def auth_warning(config: ClusterConfig) -> str | None:
    """What to tell an operator whose config disables auth while keys are set."""
    if not config.router.auth_disabled:
        return None
    where = [
        name
        for name, keys in (
            ("auth.api_keys", config.router.api_keys),
            ("$PDSERVE_API_KEYS", os.environ.get("PDSERVE_API_KEYS", "").strip()),
            ("$PDSERVE_ADMIN_API_KEYS", os.environ.get("PDSERVE_ADMIN_API_KEYS", "").strip()),
        )
        if keys
    ]
    if not where:
        return None
    return (
        f"auth.disabled is true: the keys in {' and '.join(where)} are ignored and every "
        "request is served without one; remove auth.disabled to require them"
    )


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event that SIGINT or SIGTERM sets from now on (then the caller stops the cluster
    itself, rather than Ray's handlers tearing the process down). Called after Ray starts
    and before the command says it serves, so a signal sent on that line is ours."""
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(stop: threading.Event) -> None:
    """Block until ``stop`` is set, waking twice a second. A signal's Python handler runs on
    the main thread only once that thread runs again; a process signal delivered to one of
    Ray's or gRPC's threads does not wake a main thread blocked in ``Event.wait()``."""
    while not stop.wait(0.5):
        pass


def serve(
    config: ClusterConfig,
    address: str,
    stop: threading.Event | None = None,
    capacity: CapacityModel | None = None,
) -> None:
    """Start the cluster and block until ``stop`` is set or a signal arrives."""
    if (warning := auth_warning(config)) is not None:
        logger.warning(warning)
    if address == "local" and config.ray_num_cpus is not None:
        # the embedded Ray instance gets the config's CPUs: refuse before it starts
        check_fits({"CPU": config.needs()["CPU"]}, {"CPU": config.ray_num_cpus})
    connect(address, config.ray_num_cpus)
    stop = stop_on_signals(stop)
    controller, endpoints = start_controller(config, capacity)
    print(f"pdserve: serving {config.model} from {config.source}")
    print(describe(endpoints))
    print(
        f"ray       {ray.get_runtime_context().gcs_address} (pdserve status --ray-address ...)",
        flush=True,
    )
    wait_for_stop(stop)
    print("pdserve: stopping", flush=True)
    ray.get(controller.stop.remote())
    ray.kill(controller)
