"""What the controller reports: regions against their targets, instances and their health.

The dataclasses ``Controller.status`` returns (``pdserve status`` prints them),
and the controller's record of a region's failed instance starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.planner import PlannerDecision
from pdserve.core.snapshot import ScaleEvent
from pdserve.router.actor import Endpoints


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


@dataclass
class RetryState:
    """Failed starts in a row of one region, and when to try again."""

    failures: int = 0
    next_at: float = 0.0
    error: str = ""
