"""The simulated cluster's planner side: decisions, new and drained instances, counts.

Every planner interval :meth:`SimScaling.on_plan` hands each region's metrics
to the planner policy. An applied "add" makes an instance that joins the
router's tables after ``startup_s`` (the ``ready`` event); a "remove" drains
one (no new requests) and it leaves once idle. Every change of the instance
counts is recorded as a row of :attr:`~pdserve.sim.cluster.SimRun.counts`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.cluster.planner import PlannerDecision
from pdserve.sim.instance import SimInstance
from pdserve.sim.metrics import region_metrics

if TYPE_CHECKING:
    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.planner import PlannerPolicy
    from pdserve.router.prefix_index import PrefixIndex
    from pdserve.router.state import ClusterView
    from pdserve.sim.clock import EventQueue, VirtualClock
    from pdserve.sim.metrics import RegionWindow
    from pdserve.sim.options import SimOptions, SimRun


class ScalingHost(Protocol):
    """What the planner side reads and changes of a simulated cluster: its clock and
    event queue, config, planner and options, the instances (joined, starting) and
    each region's metric windows, the router's tables and prefix index, the requests
    in flight and still to come, and the run's record of decisions and counts."""

    @property
    def clock(self) -> VirtualClock: ...
    @property
    def queue(self) -> EventQueue: ...
    @property
    def config(self) -> ClusterConfig: ...
    @property
    def options(self) -> SimOptions: ...
    @property
    def planner(self) -> PlannerPolicy: ...
    @property
    def regions(self) -> list[str]: ...
    @property
    def instances(self) -> dict[str, SimInstance]: ...
    @property
    def starting(self) -> Counter[tuple[str, str]]: ...
    @property
    def windows(self) -> dict[str, RegionWindow]: ...
    @property
    def view(self) -> ClusterView: ...
    @property
    def prefixes(self) -> PrefixIndex: ...
    @property
    def tracks(self) -> dict[str, Any]: ...
    @property
    def arrivals_left(self) -> bool: ...
    @property
    def run_info(self) -> SimRun: ...
    def new_instance(self, region: str, role: str) -> SimInstance: ...
    def join(self, inst: SimInstance) -> None: ...


class SimScaling:
    """The planner work of a :class:`~pdserve.sim.cluster.SimCluster`, on the part of
    its state it may touch (``c``: :class:`ScalingHost`)."""

    def __init__(self, cluster: ScalingHost) -> None:
        self.c = cluster

    def on_plan(self, _: Any) -> None:
        c = self.c
        now = c.clock.now()
        for region in c.regions:
            members = [x for x in c.instances.values() if x.region == region and not x.draining]
            starting = {role: c.starting[(region, role)] for role in ("prefill", "decode")}
            m = region_metrics(
                region, members, c.windows[region], now, starting, c.config.router.ttft_slo_s
            )
            decision = c.planner.decide(m, now)
            if decision is not None:
                self.apply(decision, now)
        if c.tracks or c.arrivals_left or c.queue.peek_time() < math.inf:
            c.queue.push(now + c.config.planner.interval_s, "plan")

    def apply(self, d: PlannerDecision, now: float) -> None:
        c = self.c
        c.run_info.decisions.append(
            {
                "t_s": round(now, 3),
                "region": d.region,
                "action": d.action,
                "count": d.count,
                "reason": d.reason,
                "applied": d.applied,
            }
        )
        if not d.applied:
            return
        verb, role = d.action.split("_", 1)
        for _ in range(d.count):
            if verb == "add":
                inst = c.new_instance(d.region, role)
                c.starting[(d.region, role)] += 1
                c.queue.push(now + c.options.startup_s, "ready", inst)
            else:
                self.drain_one(d.region, role)
        if verb == "remove":
            self.count(d.action)

    def drain_one(self, region: str, role: str) -> None:
        members = [
            x
            for x in self.c.instances.values()
            if x.region == region and x.role == role and not x.draining
        ]
        if len(members) <= 1:
            return
        victim = min(members, key=lambda x: x.view.inflight)
        victim.draining = True
        self.c.view.set_available(victim.instance_id, True)
        if victim.idle:
            self.remove(victim)

    def on_ready(self, inst: SimInstance) -> None:
        self.c.starting[(inst.region, inst.role)] -= 1
        self.c.join(inst)
        self.count("ready")

    def remove(self, inst: SimInstance) -> None:
        self.c.instances.pop(inst.instance_id, None)
        self.c.view.remove(inst.instance_id)
        self.c.prefixes.forget(inst.instance_id)
        self.count("removed")

    def count(self, why: str) -> None:
        c = self.c
        row: dict[str, Any] = {"t_s": round(c.clock.now(), 3), "event": why}
        for region in c.regions:
            for role in ("prefill", "decode"):
                row[f"{region}.{role}"] = sum(
                    1
                    for x in c.instances.values()
                    if x.region == region and x.role == role and not x.draining
                )
        c.run_info.counts.append(row)
