"""What the controller reports: regions against their targets, instances and their health.

The dataclasses ``Controller.status`` returns (``pdserve status`` prints them),
and the controller's record of a region's failed instance starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.cluster.planner import PlannerDecision
from pdserve.core.snapshot import ScaleEvent
from pdserve.router.actor import Endpoints

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.fleet import Fleet
    from pdserve.cluster.planner import PlannerPolicy
    from pdserve.cluster.pool import WarmPool
    from pdserve.cluster.scale_log import ScaleLog
    from pdserve.cluster.topology import RegionInstances


@dataclass(frozen=True)
class InstanceStatus:
    instance_id: str
    region: str
    role: str
    healthy: bool
    draining: bool
    reason: str = ""  # why it is unhealthy (it is being replaced)


@dataclass(frozen=True)
class RegionStatus:
    name: str
    prefill: int
    decode: int
    target_prefill: int
    target_decode: int
    starting: int = 0  # instances being started (or flipped into this region's roles)
    failed_starts: int = 0  # failed starts in a row; retried with backoff
    last_error: str = ""  # the last failed start, until the region is whole again
    retry_in_s: float = 0.0
    warm: int = 0  # instances ready in the region's warm pool


@dataclass(frozen=True)
class ClusterStatus:
    endpoints: Endpoints | None
    regions: list[RegionStatus]
    instances: list[InstanceStatus]
    planner_mode: str
    decisions: list[PlannerDecision]
    events: list[str]
    scale_events: list[ScaleEvent]
    # Every served model version: state, traffic share, instances per region.
    models: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RetryState:
    """Failed starts in a row of one region, and when to try again."""

    failures: int = 0
    next_at: float = 0.0
    error: str = ""


class StatusSource(Protocol):
    """What a status is read from: a controller's config, instances, targets, starts,
    failed starts, draining and unhealthy sets, warm pools and logs (under ``lock``),
    its planner's decisions and the model versions it serves."""

    @property
    def config(self) -> ClusterConfig: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def endpoints(self) -> Endpoints | None: ...
    @property
    def regions(self) -> dict[str, RegionInstances]: ...
    @property
    def targets(self) -> dict[str, dict[str, int]]: ...
    @property
    def starting(self) -> dict[str, dict[str, int]]: ...
    @property
    def retries(self) -> dict[str, RetryState]: ...
    @property
    def draining(self) -> set[str]: ...
    @property
    def unhealthy(self) -> dict[str, InstanceStatus]: ...
    @property
    def pool(self) -> WarmPool: ...
    @property
    def planner(self) -> PlannerPolicy: ...
    @property
    def events(self) -> list[str]: ...
    @property
    def scale_log(self) -> ScaleLog: ...
    @property
    def fleet(self) -> Fleet | None: ...


def region_status(c: StatusSource, name: str) -> RegionStatus:
    """A region of ``c``'s model version against its targets (``c.lock`` held)."""
    r, t, retry = c.regions[name], c.targets[name], c.retries.get(name)
    return RegionStatus(
        name,
        len(r.prefill),
        len(r.decode),
        t["prefill"],
        t["decode"],
        sum(c.starting[name].values()),
        retry.failures if retry else 0,
        retry.error if retry else "",
        max(0.0, retry.next_at - time.monotonic()) if retry else 0.0,
        len(c.pool.ready[name]),
    )


def cluster_status(c: StatusSource) -> ClusterStatus:
    models = c.fleet.status() if c.fleet is not None else []
    with c.lock:
        regions = [region_status(c, name) for name in c.regions]
        instances = [
            InstanceStatus(i.instance_id, name, i.role, True, i.instance_id in c.draining)
            for name, r in c.regions.items()
            for i in r.prefill + r.decode
            if i.instance_id not in c.unhealthy
        ] + list(c.unhealthy.values())
        return ClusterStatus(
            c.endpoints,
            regions,
            instances,
            c.config.planner.mode,
            list(c.planner.history[-20:]),
            c.events[-50:],
            c.scale_log.events[-50:],
            models,
        )
