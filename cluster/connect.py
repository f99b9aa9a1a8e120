"""Find the Ray cluster and the pdserve controller on it: what ``pdserve serve``,
``pdserve status`` and ``pdserve scale`` share.

This module imports Ray and nothing of the engine, so a command that only asks a
running cluster (``status``, ``scale``) starts without torch (``pdserve status``
with no cluster to find: 1.7 s, from 4.4 s); the controller itself, and with it
torch, is ``pdserve.cluster.serve``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import ray

from pdserve.core.errors import InstanceFailedError, InvalidArgumentError, first_line

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve"
CONTROLLER = "pdserve-controller"
PROBE_TIMEOUT_S = 3.0  # a Ray address that does not accept a connection in this has no cluster
RAY_STARTED = "ray_current_cluster"  # in Ray's temp folder: the cluster `ray start` started
EMBEDDED = "pdserve_current_cluster"  # beside it: the embedded Ray of a running pdserve serve


def connect(address: str, num_cpus: int | None = None, start_local: bool = True) -> None:
    """``address``: "local" (embedded), "auto" (found, else embedded) or a Ray address.

    "auto" is ``RAY_ADDRESS``, else the cluster a local ``ray start`` or a running
    embedded ``pdserve serve`` announced in Ray's temp folder (:func:`found_address`),
    never any Ray found running on the machine: another program's embedded Ray lives
    and dies with that program. With ``start_local=False`` (status, scale: there must
    be a cluster to ask) "auto" finding nothing is an error, not a new empty Ray instance.
    """
    if ray.is_initialized():
        return
    if address == "local":
        _start_local(num_cpus)
        return
    use_ray_token()
    source = "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "--ray-address"
    named = os.environ.get("RAY_ADDRESS") or address  # what ray.init will dial
    check_ray_address(named, source)
    dial = found_address() if named == "auto" else named
    try:
        if dial is None:
            raise ConnectionError(f"none announced in {ray_temp_dir()}")
        if named != "auto" and not listening(dial):  # Ray would retry for minutes
            raise ConnectionError(f"nothing listens at {dial}")
        ray.init(address=dial, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as e:
        if named != "auto" or not start_local:
            where = "on this machine" if named == "auto" else f"at {named}"
            raise InstanceFailedError(
                f"no Ray cluster {where} ({first_line(e)}): start one with pdserve serve "
                "(or ray start), or pass the address pdserve serve printed with --ray-address"
            ) from None
        logger.info("no Ray cluster found: starting an embedded local one")
        _start_local(num_cpus)


def ray_temp_dir() -> Path:
    """Ray's temp folder on this machine, as Ray picks it: where ``ray start`` leaves the
    address of the cluster it started."""
    if "RAY_TMPDIR" in os.environ:
        return Path(os.environ["RAY_TMPDIR"]) / "ray"
    if sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        return Path(os.environ["TMPDIR"]) / "ray"
    return Path("/tmp") / "ray"


def found_address() -> str | None:
    """The local cluster "auto" joins: the one a ``ray start`` announced (Ray's own file),
    else a running embedded ``pdserve serve``'s; None when neither listens."""
    for name in (RAY_STARTED, EMBEDDED):
        try:
            address = (ray_temp_dir() / name).read_text().strip()
        except OSError:
            continue
        if address and is_host_port(address) and listening(address):
            return address
    return None


def check_ray_address(address: str, source: str = "--ray-address") -> None:
    """Refuse an address Ray cannot dial before Ray sees it (Ray raises a bare
    ``ValueError`` for them): ``auto``, ``local``, ``HOST:PORT`` (the Ray cluster's
    GCS, which ``pdserve serve`` prints) or ``ray://HOST:PORT`` (a Ray client
    server) are the forms; ``source`` names the flag or variable it came from."""
    if address in ("auto", "local"):
        return
    scheme, sep, rest = address.rpartition("://")
    if sep and scheme in ("http", "https"):
        raise InvalidArgumentError(
            source,
            f"{address!r} is an HTTP address (a Ray dashboard's?); give the Ray cluster's "
            "HOST:PORT as pdserve serve prints it (e.g. 10.0.0.1:6379), auto or local",
        )
    if sep and scheme != "ray":
        raise InvalidArgumentError(source, f"{address!r}: the only scheme Ray dials is ray://")
    if not is_host_port(rest):
        raise InvalidArgumentError(
            source, f"{address!r} is not HOST:PORT (a port from 1 to 65535), auto or local"
        )


def is_host_port(address: str) -> bool:
    host, colon, port = address.rpartition(":")
    return bool(host and colon and port.isdigit() and 0 < int(port) < 65536)


def _start_local(num_cpus: int | None) -> None:
    """Start an embedded Ray instance (never join one: "local" says so) and announce it
    to "auto" (:func:`found_address`) until this process exits."""
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
        )
    except Exception as e:  # Ray raises a bare Exception when its processes do not come up
        raise InstanceFailedError(
            f"could not start an embedded Ray instance ({first_line(e)}): try again once the "
            "machine is less busy, or start Ray with ray start and pass --ray-address"
        ) from None
    announce(ray.get_runtime_context().gcs_address)


def announce(address: str) -> None:
    """Leave ``address`` where "auto" looks (:data:`EMBEDDED`), removed at exit if it is
    still this process's (a later embedded Ray may have taken the file)."""
    path = ray_temp_dir() / EMBEDDED
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(address)
    except OSError as e:
        logger.warning("could not write %s (%s): pass --ray-address to status", path, e)
        return

    def withdraw() -> None:
        with contextlib.suppress(OSError):
            if path.read_text().strip() == address:
                path.unlink()

    atexit.register(withdraw)


def listening(address: str) -> bool:
    """Whether a ``host:port`` address accepts connections (other forms: assumed so)."""
    if "://" in address or not is_host_port(address):
        return True
    host, _, port = address.rpartition(":")
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


def find_controller() -> Any:
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        address = ray.get_runtime_context().gcs_address
        raise InstanceFailedError(
            f"no pdserve cluster is running on the Ray cluster at {address} "
            "(start one with pdserve serve --config ...)"
        ) from None
