"""The controller's health loop: find instances that cannot serve, and replace them.

Every ``health.interval_s`` each leader is asked for its health (answered on
its own concurrency group, never through its engine loop). A leader that does
not answer within ``health.ping_timeout_s``, whose leader died, or whose
engine loop died or stalled is marked unhealthy (status shows why), killed,
reported to the router (which moves its requests) and replaced, on a thread
of its own. The same loop reads the instances' counters for the metrics,
retries failed starts that are due, and sends the router the cluster's
snapshot; every few rounds it also reads MoE instances' expert counters from
all their ranks.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray.exceptions import RayActorError

from pdserve.cluster.expert_load import ExpertLoadReader
from pdserve.cluster.instances import Instance, best_effort, first_line
from pdserve.cluster.status import InstanceStatus
from pdserve.cluster.topology import register
from pdserve.core.snapshot import ExpertLoad

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from pdserve.cluster.config import HealthConfig
    from pdserve.cluster.fleet import Fleet
    from pdserve.cluster.membership import Membership
    from pdserve.cluster.scale_log import ScaleLog
    from pdserve.cluster.topology import RegionInstances
    from pdserve.core.model_config import ModelConfig

logger = logging.getLogger(__name__)

EXPERT_LOAD_EVERY = 5  # health rounds between reads of the MoE ranks' expert counters


class HealthHost(Protocol):
    """What the health checks read and change of the controller: its lock, instances,
    unhealthy set and the router (whose incarnation they follow; the root's fleet
    rejoins a restarted one), and the calls that replace an instance."""

    router_incarnation: str | None  # the router's, as last seen: a restart re-registers

    @property
    def key(self) -> str: ...
    @property
    def owns_router(self) -> bool: ...
    @property
    def fleet(self) -> Fleet | None: ...
    @property
    def health(self) -> HealthConfig: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def regions(self) -> dict[str, RegionInstances]: ...
    @property
    def unhealthy(self) -> dict[str, InstanceStatus]: ...
    @property
    def router(self) -> Any: ...
    @property
    def scale_log(self) -> ScaleLog: ...
    @property
    def membership(self) -> Membership: ...
    @property
    def stopping(self) -> bool: ...
    def converge(self, region: str, raise_errors: bool = False) -> None: ...
    def retry_due(self) -> None: ...
    def push_snapshot(self) -> None: ...
    def decision(self, region: str, action: str, cause: str, reason: str, source: str) -> None: ...
    def event(self, text: str) -> None: ...


class HealthChecks:
    """The health work of a :class:`~pdserve.cluster.controller.Controller`,
    on its state (``c``) and under its locks."""

    def __init__(self, controller: HealthHost) -> None:
        self.c = controller
        self._reader = ExpertLoadReader()
        self._experts: dict[str, ExpertLoad] = {}
        self._rounds = 0

    def check(self) -> None:
        self._rejoin_restarted_router()
        with self.c.lock:
            everyone = [
                (name, i)
                for name, r in self.c.regions.items()
                for i in r.prefill + r.decode
                if i.instance_id not in self.c.unhealthy
            ]
        checks = [i.leader.health.remote(self.c.health.stall_timeout_s) for _, i in everyone]
        stats = [i.leader.stats.remote() for _, i in everyone]
        ready, _ = ray.wait(checks, num_returns=len(checks), timeout=self.c.health.ping_timeout_s)
        answered = set(ready)
        for (name, instance), ref in zip(everyone, checks, strict=True):
            problem = self._problem(ref, ref in answered)
            if problem is not None:
                self._unhealthy(name, instance, problem)
        counted, _ = ray.wait(stats, num_returns=len(stats), timeout=self.c.health.interval_s)
        read = [
            self.c.scale_log.read(name, instance.role, s)
            for (name, instance), ref in zip(everyone, stats, strict=True)
            if ref in counted and (s := best_effort([ref])[0]) is not None
        ]
        self._expert_load(everyone, read)
        self.c.scale_log.counters = read
        self.c.retry_due()
        self.c.push_snapshot()

    def _rejoin_restarted_router(self) -> None:
        """Ray restarted the router (it died): it knows no instance, so every instance of
        this controller registers again, and the root's demand for cold starts is watched
        again. Nothing is done while the router does not answer: the next round asks."""
        c = self.c
        if c.router is None or c.router_incarnation is None:
            return
        try:
            now = ray.get(c.router.incarnation.remote(), timeout=c.health.ping_timeout_s)
        except Exception:
            return
        if now == c.router_incarnation:
            return
        if c.owns_router and c.fleet is not None:
            c.fleet.rejoin_router()
        with c.lock:
            listed = [(name, i) for name, r in c.regions.items() for i in r.prefill + r.decode]
        for name, instance in listed:
            register(c.router, instance, name, c.key)
        if c.owns_router:
            ray.get(c.router.watch_demand.remote(ray.get_runtime_context().current_actor))
        c.router_incarnation = now
        c.event(f"the router restarted: {len(listed)} instance(s) registered with it again")

    def _expert_load(self, everyone: list[tuple[str, Instance]], read: list[Any]) -> None:
        """Every ``EXPERT_LOAD_EVERY`` rounds, MoE instances' expert counters from all ranks."""
        if not self.c.model.is_moe:
            return
        if self._rounds % EXPERT_LOAD_EVERY == 0:
            self._experts = self._reader.read([i for _, i in everyone], self.c.health.interval_s)
        self._rounds += 1
        for counters in read:
            counters.expert_load = self._experts.get(counters.instance_id)

    def _problem(self, ref: Any, answered: bool) -> str | None:
        """Why a leader's health answer says it cannot serve, or None."""
        if not answered:
            return f"no answer to a health check within {self.c.health.ping_timeout_s:g} s"
        try:
            return ray.get(ref, timeout=0)
        except RayActorError:
            return "its leader died"
        except Exception as e:
            return f"health check failed: {first_line(e)}"

    def _unhealthy(self, region: str, instance: Instance, reason: str) -> None:
        """Mark an instance unhealthy (status shows why) and replace it on a thread of its own."""
        with self.c.lock:
            listed = instance in self.c.regions[region].of(instance.role)
            if not listed or instance.instance_id in self.c.unhealthy:
                return
            self.c.unhealthy[instance.instance_id] = InstanceStatus(
                instance.instance_id, region, instance.role, False, False, reason
            )
        self.c.event(f"{instance.instance_id} is unhealthy ({reason}): replacing it")
        threading.Thread(target=self._replace, args=(region, instance, reason), daemon=True).start()

    def _replace(self, region: str, instance: Instance, reason: str) -> None:
        """Kill it, move its requests, take it out, start another (no lock held).

        Status lists it (unhealthy, with the reason) until the replacement is up.
        """
        try:
            instance.kill()  # nothing it does from now on reaches a client twice
            ray.get(self.c.router.instance_lost.remote(instance.instance_id))
            self.c.membership.detach(region, instance)
        except Exception:
            logger.exception("taking out %s failed", instance.instance_id)
        with self.c.lock:
            self.c.scale_log.restarted(region, instance.role)
            self.c.decision(
                region,
                f"replace_{instance.role}",
                "instance_lost",
                f"{instance.instance_id}: {reason}",
                "health",
            )
        try:
            if not self.c.stopping:
                self.c.converge(region)  # a failed start is retried by the health loop
        finally:
            with self.c.lock:
                self.c.unhealthy.pop(instance.instance_id, None)
