"""What an instance is to the cluster that runs it: its role, the spec its ranks are
started with, and the stats its leader reports.

Light on purpose (no torch), like :mod:`pdserve.cluster.instance_actor`: the
controller starts instances and reads their stats without the rank's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.core.config import DisaggregationConfig
from pdserve.core.snapshot import KVTierCounters, SpeculationCounters

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class InstanceSpec:
    """What kind of instance a rank belongs to."""

    instance_id: str
    role: Role
    connector: str = "auto"  # pdserve.transfer.resolve_connector
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)


@dataclass(frozen=True)
class InstanceStats:
    instance_id: str
    role: str
    leases: dict[str, int]
    sent: dict[str, Any]
    received: dict[str, Any]
    free_blocks: int
    num_blocks: int
    prefix_queries: int = 0
    prefix_hits: int = 0
    kv_tiers: KVTierCounters | None = None
    speculation: SpeculationCounters | None = None
    across_nodes: tuple[dict[str, Any], ...] = ()  # ``auto``'s connector between nodes
    node_id: str = ""  # the Ray node the leader runs on
    node_ip: str = ""
