"""What the controller tells the router for the metrics and the dashboard.

Scaling decisions (the planner's, the operator's, the health loop's
replacements) are counted by region, action and cause and kept as a log;
with each instance's counters, as its leader last read them, and every
region's targets and instance counts they make the
:class:`~pdserve.core.metrics.ClusterSnapshot` sent to the router.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pdserve.core.snapshot import ClusterSnapshot, InstanceCounters, RegionState, ScaleEvent

if TYPE_CHECKING:
    from pdserve.cluster.topology import RegionInstances

KEEP = 500  # decisions kept for the dashboard's log


class ScaleLog:
    def __init__(self) -> None:
        self.events: list[ScaleEvent] = []
        self.counts: dict[tuple[str, str, str], int] = {}  # (region, action, cause) -> n
        self.restarts: dict[tuple[str, str], int] = {}  # (region, role) -> n
        # (region, role) -> seconds per start-up phase of its latest instance
        self.start_phases: dict[tuple[str, str], dict[str, float]] = {}
        self.counters: list[InstanceCounters] = []

    def decision(
        self,
        region: str,
        action: str,
        cause: str,
        reason: str,
        source: str,
        targets: dict[str, int],
    ) -> None:
        key = (region, action, cause)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.events.append(
            ScaleEvent(
                time.time(), region, action, reason, source, targets["prefill"], targets["decode"]
            )
        )
        del self.events[:-KEEP]

    def started(self, region: str, role: str, phases: dict[str, float]) -> None:
        """An instance came up; ``phases``: seconds per start-up phase."""
        self.start_phases[(region, role)] = dict(phases)

    def restarted(self, region: str, role: str) -> None:
        self.restarts[(region, role)] = self.restarts.get((region, role), 0) + 1

    def read(self, region: str, role: str, stats: Any) -> InstanceCounters:
        """An instance's counters from its leader's ``InstanceStats``."""
        transfers = [
            {**stats.sent, "direction": "sent"},
            {**stats.received, "direction": "received"},
            *stats.across_nodes,  # the leader's only, as the two above
        ]
        return InstanceCounters(
            stats.instance_id,
            region,
            role,
            stats.prefix_queries,
            stats.prefix_hits,
            transfers,
            dict(stats.leases),
            stats.kv_tiers,
            speculation=stats.speculation,
            node_id=stats.node_id,
            node_ip=stats.node_ip,
        )

    def snapshot(
        self,
        regions: dict[str, RegionInstances],
        targets: dict[str, dict[str, int]],
        draining: set[str],
    ) -> ClusterSnapshot:
        states = []
        for name, r in regions.items():
            serving: dict[str, int] = {}
            drains: dict[str, int] = {}
            for i in r.prefill + r.decode:
                side = drains if i.instance_id in draining else serving
                side[i.role] = side.get(i.role, 0) + 1
            restarts = {role: n for (reg, role), n in self.restarts.items() if reg == name}
            t = targets[name]
            starts = {role: p for (reg, role), p in self.start_phases.items() if reg == name}
            states.append(
                RegionState(name, t["prefill"], t["decode"], serving, drains, restarts, starts)
            )
        return ClusterSnapshot(
            time.time(), states, list(self.counters), dict(self.counts), self.events[-100:]
        )
