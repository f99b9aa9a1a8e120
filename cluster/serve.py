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
import socket
import threading
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorAlreadyExistsError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.config import ClusterConfig, check_fits
from pdserve.cluster.controller import Controller
from pdserve.cluster.proactive import CapacityModel
from pdserve.core.errors import InstanceFailedError, PdserveError
from pdserve.router.actor import Endpoints

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve"
CONTROLLER = "pdserve-controller"
PROBE_TIMEOUT_S = 3.0  # a Ray address that does not accept a connection in this has no cluster


def connect(address: str, num_cpus: int | None = None, start_local: bool = True) -> None:
    """``address``: "local" (embedded), "auto" (found, else embedded) or a Ray address.

    With ``start_local=False`` (status, scale: there must be a cluster to ask)
    "auto" finding nothing is an error, not a new empty Ray instance.
    """
    if ray.is_initialized():
        return
    if address == "local":
        _start_local(num_cpus)
        return
    use_ray_token()
    named = os.environ.get("RAY_ADDRESS") or address  # what ray.init will dial
    try:
        if named != "auto" and not _listening(named):  # Ray itself would retry for minutes
            raise ConnectionError(f"nothing listens at {named}")
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as e:
        if address != "auto" or not start_local:
            where = "on this machine" if named == "auto" else f"at {named}"
            raise InstanceFailedError(
                f"no Ray cluster {where} ({_first_line(e)}): start one with pdserve serve "
                "(or ray start), or pass the address pdserve serve printed with --ray-address"
            ) from None
        logger.info("no Ray cluster found: starting an embedded local one")
        _start_local(num_cpus)


def _start_local(num_cpus: int | None) -> None:
    try:
        ray.init(
            num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False
        )
    except Exception as e:  # Ray raises a bare Exception when its processes do not come up
        raise InstanceFailedError(
            f"could not start an embedded Ray instance ({_first_line(e)}): try again once the "
            "machine is less busy, or start Ray with ray start and pass --ray-address"
        ) from None


def _listening(address: str) -> bool:
    """Whether a ``host:port`` address accepts connections (other forms: assumed so)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return True
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def use_ray_token() -> None:
    """Send the Ray cluster's token when one is available.

    Ray turns token auth on for every cluster it starts (``ray start``, and an
    embedded ``pdserve serve``) and keeps the token in ``~/.ray/auth_token``;
    a client must then say ``RAY_AUTH_MODE=token`` itself, so pdserve does.
    """
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if "RAY_AUTH_MODE" in os.environ:
        return  # the operator's choice
    if "RAY_AUTH_TOKEN" in os.environ or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        # Ray read its settings when it was imported (pdserve imports it early);
        # reload them as Ray's own token set-up does, or the token is never sent.
        with contextlib.suppress(ImportError, AttributeError):
            from ray._raylet import Config  # type: ignore[attr-defined]

            Config.initialize("")


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
                f"the cluster failed to start: {_first_line(e.cause or e)}; "
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


def find_controller() -> Any:
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        address = ray.get_runtime_context().gcs_address
        raise InstanceFailedError(
            f"no pdserve cluster is running on the Ray cluster at {address} "
            "(start one with pdserve serve --config ...)"
        ) from None


def describe(endpoints: Endpoints) -> str:
    base = f"http://{endpoints.host}:{endpoints.http_port}"
    return (
        f"gRPC      {endpoints.host}:{endpoints.grpc_port}\n"
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
        )
        if keys
    ]
    if not where:
        return None
    return (
        f"auth.disabled is true: the keys in {' and '.join(where)} are ignored and every "
        "request is served without one; remove auth.disabled to require them"
    )


def serve(
    config: ClusterConfig, address: str, stop: threading.Event | None = None,
    capacity: CapacityModel | None = None,
) -> None:  # fmt: skip
    """Start the cluster and block until ``stop`` is set or a signal arrives."""
    if (warning := auth_warning(config)) is not None:
        logger.warning(warning)
    connect(address, config.ray_num_cpus)
    controller, endpoints = start_controller(config, capacity)
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


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
