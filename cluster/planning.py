"""The controller's planner loop: read the router's region metrics, decide, apply.

In ``advisory`` mode decisions are only logged and counted; in ``on`` mode an
``add_<role>`` raises the region's target, unless the cluster has no room for
another instance of that role: then an idle instance of the other role flips
role without reloading its weights. Every decision is kept for the dashboard.

``wake`` is the router's call for a region scaled to zero: a request waits
there for a role it has no instance of, and the role's target goes to 1,
whatever the planner's mode (the planner only takes instances away again).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import ray

from pdserve.cluster.instance_spec import Role
from pdserve.cluster.planner import PlannerDecision, RegionMetrics

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from pdserve.cluster.config import ClusterConfig, RegionConfig
    from pdserve.cluster.instances import Instance
    from pdserve.cluster.membership import Membership
    from pdserve.cluster.planner import PlannerPolicy
    from pdserve.cluster.status import RegionStatus
    from pdserve.cluster.topology import RegionInstances

logger = logging.getLogger(__name__)

FLIP_IDLE_WAIT_S = 60.0


class PlanningHost(Protocol):
    """What the planner's work reads and changes of the controller: the config, the
    planner, each region's spec, instances, targets and starts in flight (under
    ``lock``; a flip under ``topology``), and the calls that scale and log."""

    @property
    def config(self) -> ClusterConfig: ...
    @property
    def key(self) -> str: ...
    @property
    def planner(self) -> PlannerPolicy: ...
    @property
    def retired(self) -> bool: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def topology(self) -> AbstractContextManager[Any]: ...
    @property
    def specs(self) -> dict[str, RegionConfig]: ...
    @property
    def regions(self) -> dict[str, RegionInstances]: ...
    @property
    def targets(self) -> dict[str, dict[str, int]]: ...
    @property
    def starting(self) -> dict[str, dict[str, int]]: ...
    @property
    def draining(self) -> set[str]: ...
    @property
    def router(self) -> Any: ...
    @property
    def membership(self) -> Membership: ...
    def scale(
        self,
        region: str,
        prefill: int | None,
        decode: int | None,
        reason: str = ...,
        source: str = ...,
        cause: str = ...,
    ) -> RegionStatus: ...
    def staying(self, region: str, role: Role) -> list[Instance]: ...
    def pages_used(self, instances: list[Instance]) -> dict[str, int]: ...
    def decision(self, region: str, action: str, cause: str, reason: str, source: str) -> None: ...
    def event(self, text: str) -> None: ...


class Planning:
    """The planner work of a :class:`~pdserve.cluster.controller.Controller`,
    on its state (``c``) and under its locks."""

    def __init__(self, controller: PlanningHost) -> None:
        self.c = controller

    def plan(self) -> None:
        if self.c.retired:
            return  # its version was retired: nothing to size
        window = self.c.config.planner.interval_s * 4
        metrics = ray.get(self.c.router.region_metrics.remote(window, self.c.key))
        for m in metrics:
            if m["region"] not in self.c.regions:
                continue  # a region this model version has no pools in
            with self.c.lock:
                starting = dict(self.c.starting[m["region"]])
            values = {k: m[k] for k in RegionMetrics.__dataclass_fields__ if k in m}
            decision = self.c.planner.decide(
                RegionMetrics(
                    **values,
                    prefill_starting=starting.get("prefill", 0),
                    decode_starting=starting.get("decode", 0),
                )
            )
            if decision is None:
                continue
            what = decision.action + (f" x{decision.count}" if decision.count > 1 else "")
            logger.info("planner: %s %s: %s", decision.region, what, decision.reason)
            self.c.event(
                f"planner {decision.region} {what} ({decision.reason}){'' if decision.applied else ' [advisory]'}"
            )
            if decision.applied:
                self._apply(decision)
            self.c.decision(
                decision.region,
                decision.action,
                decision.cause,
                decision.reason,
                "planner" if decision.applied else "planner-advisory",
            )

    def wake(self, region: str, roles: list[Role]) -> None:
        """Raise the region's target of each of ``roles`` that is at 0 to 1 (cold start)."""
        spec = self.c.specs[region]
        with self.c.lock:
            targets = dict(self.c.targets[region])
        want = {role: 1 for role in roles if targets[role] < 1 and spec.role(role).max >= 1}
        if not want:  # already wanted (starting, or retried by the health loop), or max 0
            return
        reason = f"cold start: a request waits for a {' and '.join(want)} instance"
        for role in want:
            self.c.decision(region, f"add_{role}", "cold_start", reason, "router")
        try:
            self.c.scale(
                region, want.get("prefill"), want.get("decode"), reason=reason, source="router"
            )
        except Exception as e:  # the health loop retries a failed start; the request times out
            logger.warning("cold start in %s failed: %s", region, e)

    def _apply(self, decision: PlannerDecision) -> None:
        verb, name = decision.action.split("_")
        region = decision.region
        role: Role = "prefill" if name == "prefill" else "decode"
        other: Role = "decode" if role == "prefill" else "prefill"
        if verb == "add" and not self._room_for(region, role) and self.flip(region, other, role):
            return
        with self.c.lock:
            targets = dict(self.c.targets[region])
        targets[role] += decision.count if verb == "add" else -decision.count
        self.c.scale(
            region,
            targets["prefill"],
            targets["decode"],
            reason=f"planner: {decision.reason}",
            source="planner",
        )

    def _room_for(self, region: str, role: str) -> bool:
        needs = self.c.config.instance_needs(role, self.c.specs[region])
        free = ray.available_resources()
        return all(free.get(key, 0.0) >= amount for key, amount in needs.items())

    def flip(self, region: str, src: Role, dst: Role) -> bool:
        """Turn an idle instance of role ``src`` into ``dst`` (no room for a new one).

        The targets move at once (one ``src`` fewer, one ``dst`` more, the
        flipping instance counted as starting), so no reconcile meanwhile starts
        a ``src`` to replace it; they move back if it does not go idle.
        """
        r, spec = self.c.regions[region], self.c.specs[region]
        with self.c.lock:
            if len(r.of(src)) <= spec.role(src).min or len(r.of(dst)) >= spec.role(dst).max:
                return False
            candidates = self.c.staying(region, src)
        if not candidates:
            return False
        used = self.c.pages_used(candidates)
        instance = min(candidates, key=lambda i: used[i.instance_id])
        with self.c.lock:
            if instance not in self.c.staying(region, src):
                return False
            self.c.draining.add(instance.instance_id)
            self._move_target(region, src, dst, 1)
        flipped = False
        try:
            ray.get(self.c.router.set_draining.remote(instance.instance_id, True))
            if not ray.get(instance.leader.wait_idle.remote(FLIP_IDLE_WAIT_S)):
                ray.get(self.c.router.set_draining.remote(instance.instance_id, False))
                return False
            with self.c.topology:
                self.c.membership.detach(region, instance)
                ray.get([w.flip_role.remote(dst) for w in instance.group.workers])
                instance.role = dst
                self.c.membership.join(region, instance)
            flipped = True
        except Exception:
            logger.exception("flipping %s failed; stopping it", instance.instance_id)
            self.c.membership.detach(region, instance)  # if it is still listed
            instance.kill()  # the region, one short, is refilled by the health loop
            return False
        finally:
            with self.c.lock:
                self.c.draining.discard(instance.instance_id)
                self.c.starting[region][dst] -= 1
                if not flipped:
                    self.c.targets[region][src] += 1
                    self.c.targets[region][dst] -= 1
        self.c.event(
            f"flipped {instance.instance_id} from {src} to {dst} (no room for a new instance)"
        )
        return True

    def _move_target(self, region: str, src: Role, dst: Role, n: int) -> None:
        self.c.targets[region][src] -= n
        self.c.targets[region][dst] += n
        self.c.starting[region][dst] += n
