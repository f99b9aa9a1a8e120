"""A pdserve cluster on this machine for a benchmark, with its ranks pinned to cores.

:func:`local_cluster` starts an embedded Ray instance and the controller from
a cluster config (YAML text), pins each instance's rank process to the cores
asked for, yields the endpoints, then stops the controller and shuts the Ray
instance down (only the one it started).

Pinning is done from outside the engine: each rank actor is asked, through
Ray's ``__ray_call__``, to set the CPU affinity of every thread of its own
process (``/proc/self/task``); threads it starts later inherit it. The torch
thread count of a rank is its ``num_cpus_per_rank``, set by the rank itself.

Cores named for a role are claimed before Ray starts (:func:`claim_cores`):
a process inherits its parent's affinity, so a shell confined to fewer cores
(``taskset``, or a tool that moved every process) would otherwise put every
Ray process, ranks included, on those few. A named core this process may not
use and cannot take is an error naming it, never a silent skip: a benchmark of
two engines that quietly share one core measures the wrong machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.core.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinnedRank:
    role: str
    pid: int
    cores: tuple[int, ...]
    threads: int


def _pin_threads(cores: set[int]) -> int:
    """Set the affinity of every thread of this process to ``cores``; threads pinned."""
    pinned = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)
            pinned += 1
    return pinned


def _pin_own_threads(_actor: Any, cores: tuple[int, ...]) -> tuple[int, int]:
    """Runs inside a rank actor: pin every thread of this process; (pid, threads pinned)."""
    return os.getpid(), _pin_threads(set(cores))


def claim_cores(cores: set[int]) -> set[int]:
    """Let this process (and so the Ray processes it starts) run on ``cores`` as well
    as on its own; the cores it may use now. An unknown core, or one the kernel
    will not give (a cpuset), is an :class:`InvalidArgumentError` naming it."""
    mine = os.sched_getaffinity(0)
    if cores <= mine:
        return mine
    unknown = sorted(c for c in cores if not 0 <= c < (os.cpu_count() or 1))
    if unknown:
        raise InvalidArgumentError(
            "cores", f"no core {unknown} on this machine ({os.cpu_count()} cores)"
        )
    try:
        _pin_threads(mine | cores)
    except OSError as e:
        raise InvalidArgumentError(
            "cores",
            f"cores {sorted(cores - mine)} are not usable by this process (it may "
            f"use {sorted(mine)}; a cpuset or container limit?): {e.strerror}",
        ) from None
    logger.warning(
        "this process could use cores %s only; it now uses %s as asked",
        sorted(mine),
        sorted(mine | cores),
    )
    return mine | cores


def pin_instances(controller: Any, cores_by_role: dict[str, tuple[int, ...]]) -> list[PinnedRank]:
    """Pin the leader rank of every instance of a role to ``cores_by_role[role]``
    (every named core must be usable here: see :func:`claim_cores`)."""
    usable = os.sched_getaffinity(0)
    pinned: list[PinnedRank] = []
    for role, leader in ray.get(controller.instance_handles.remote()):
        cores = cores_by_role.get(role, ())
        if not cores:
            continue
        if not set(cores) <= usable:
            raise InvalidArgumentError(
                "cores",
                f"{role} asks for cores {sorted(cores)}, this process may use "
                f"{sorted(usable)} (claim_cores first)",
            )
        pid, threads = ray.get(leader.__ray_call__.remote(_pin_own_threads, cores))
        pinned.append(PinnedRank(role, pid, cores, threads))
        logger.info("pinned %s rank (pid %d, %d threads) to cores %s", role, pid, threads, cores)
    return pinned


def local_cpus(config: Any) -> int:
    """The CPUs an embedded Ray instance offers a cluster of ``config`` here: the config's
    ``ray.num_cpus``, else this machine's, or more if its ranks ask for more."""
    import math

    needs = math.ceil(config.needs()["CPU"])
    return int(config.ray_num_cpus or max(os.cpu_count() or 1, needs))


@contextlib.contextmanager
def local_cluster(
    config_yaml: str,
    num_cpus: int,
    cores_by_role: dict[str, tuple[int, ...]] | None = None,
    capacity: Any = None,
) -> Iterator[tuple[Any, list[PinnedRank]]]:
    """Yield (endpoints, pinned ranks) of a cluster started from ``config_yaml``;
    ``capacity``: the latency model of a proactive planner (as ``pdserve serve``
    builds it from ``planner.profile``)."""
    from pdserve.cluster.config import parse_config
    from pdserve.cluster.connect import connect
    from pdserve.cluster.serve import start_controller

    config = parse_config(config_yaml, "<bench>")
    claim_cores({c for cores in (cores_by_role or {}).values() for c in cores})
    started_ray = not ray.is_initialized()
    connect("local", num_cpus)
    controller = None
    try:
        controller, endpoints = start_controller(config, capacity)
        pinned = pin_instances(controller, cores_by_role or {})
        yield endpoints, pinned
    finally:
        if controller is not None:
            with contextlib.suppress(Exception):
                ray.get(controller.stop.remote(), timeout=120)
            ray.kill(controller)
        if started_ray:
            ray.shutdown()
