"""A pdserve cluster on this machine for a benchmark, with its ranks pinned to cores.

:func:`local_cluster` starts an embedded Ray instance and the controller from
a cluster config (YAML text), pins each instance's rank process to the cores
asked for, yields the endpoints, then stops the controller and shuts the Ray
instance down (only the one it started).

Pinning is done from outside the engine: each rank actor is asked, through
Ray's ``__ray_call__``, to set the CPU affinity of every thread of its own
process (``/proc/self/task``); threads it starts later inherit it. The torch
thread count of a rank is its ``num_cpus_per_rank``, set by the rank itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinnedRank:
    role: str
    pid: int
    cores: tuple[int, ...]
    threads: int


def _pin_own_threads(_actor: Any, cores: tuple[int, ...]) -> tuple[int, int]:
    """Runs inside a rank actor: pin every thread of this process; (pid, threads pinned)."""
    pinned = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), set(cores))
            pinned += 1
    return os.getpid(), pinned


def pin_instances(controller: Any, cores_by_role: dict[str, tuple[int, ...]]) -> list[PinnedRank]:
    """Pin the leader rank of every instance of a role to ``cores_by_role[role]``."""
    usable = os.sched_getaffinity(0)
    pinned: list[PinnedRank] = []
    for role, leader in ray.get(controller.instance_handles.remote()):
        cores = tuple(c for c in cores_by_role.get(role, ()) if c in usable)
        if not cores:
            continue
        pid, threads = ray.get(leader.__ray_call__.remote(_pin_own_threads, cores))
        pinned.append(PinnedRank(role, pid, cores, threads))
        logger.info("pinned %s rank (pid %d, %d threads) to cores %s", role, pid, threads, cores)
    return pinned


@contextlib.contextmanager
def local_cluster(
    config_yaml: str, num_cpus: int, cores_by_role: dict[str, tuple[int, ...]] | None = None
) -> Iterator[tuple[Any, list[PinnedRank]]]:
    """Yield (endpoints, pinned ranks) of a cluster started from ``config_yaml``."""
    from pdserve.cluster.config import parse_config
    from pdserve.cluster.serve import connect, start_controller

    config = parse_config(config_yaml, "<bench>")
    started_ray = not ray.is_initialized()
    connect("local", num_cpus)
    controller = None
    try:
        controller, endpoints = start_controller(config)
        pinned = pin_instances(controller, cores_by_role or {})
        yield endpoints, pinned
    finally:
        if controller is not None:
            with contextlib.suppress(Exception):
                ray.get(controller.stop.remote(), timeout=120)
            ray.kill(controller)
        if started_ray:
            ray.shutdown()
