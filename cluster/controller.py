"""The controller: one Ray actor that owns the cluster's state.

It starts the router and every region's instances from a :class:`ClusterConfig`,
all at once (an instance registers with the router once the router listens),
then keeps the cluster at its targets:

- ``scale(region, prefill, decode)`` sets a region's targets and reconciles:
  new instances are started, paired and registered; surplus ones are drained
  first (the router stops sending them work, they finish what they hold) and
  only then removed, so scaling fails or restarts no request;
- a health loop asks every instance leader for its health: one that does not
  answer, or whose engine loop died or stalled, is reported unhealthy (in
  ``status``), killed, reported to the router (which moves its requests to
  other instances), and replaced;
- a region below its targets (a replacement or a scale-up failed to start) is
  retried by the health loop with exponential backoff until it is whole;
  each failure is counted in the metrics and shown in ``status``;
- a planner loop reads the router's region metrics and, per its mode, records
  or applies its decisions. When it wants more of a role and the cluster has
  no room for a new instance, an idle instance of the other role flips;
- ``wake`` (called by the router when a request waits for a region scaled to
  zero) starts the role the region lacks, from its warm pool when one is ready
  (:mod:`pdserve.cluster.pool`).

Locks: ``_lock`` guards the state (lists, targets, draining, starting,
unhealthy) and is only held for reads and writes of it, never while an
instance starts, drains, flips or shuts down, so status and health checks
always answer. ``_topology`` serializes the short RPCs that join an instance
to its peers (pairing, registering) or take it out, so two instances starting
at once always pair with each other. Work that takes time runs on the thread
of the call that asked for it (scale, flip) or on a thread of its own
(replacements, retries).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.fleet import Fleet
from pdserve.cluster.health import HealthChecks
from pdserve.cluster.instance_spec import Role
from pdserve.cluster.instances import CALL_TIMEOUT_S, Instance, best_effort
from pdserve.cluster.membership import Membership, in_parallel
from pdserve.cluster.planning import Planning
from pdserve.cluster.pool import WarmPool
from pdserve.cluster.proactive import CapacityModel, make_planner
from pdserve.cluster.scale_log import ScaleLog
from pdserve.cluster.status import (
    ClusterStatus,
    InstanceStatus,
    RegionStatus,
    RetryState,
    cluster_status,
    region_status,
)
from pdserve.cluster.topology import RegionInstances, launch_router
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.layout import check_fits
from pdserve.core.logs import setup_logging
from pdserve.core.model_config import ModelConfig
from pdserve.models.builtin import resolve_model
from pdserve.router.actor import Endpoints

logger = logging.getLogger(__name__)

ROLES: tuple[Role, Role] = ("decode", "prefill")  # decode first: prefill instances pair with them
MODEL_ACTIONS = ("status", "rollout", "promote", "rollback", "scale")


def _router_up_future(owns_router: bool) -> Future[None]:
    """Set once the router listens: instances start beside it and register after. A
    further model version's controller shares a router that is up already."""
    up: Future[None] = Future()
    if not owns_router:
        up.set_result(None)
    return up


class Controller:
    """Ray actor body (started by :func:`pdserve.cluster.serve.start_controller`)."""

    def __init__(
        self,
        config: ClusterConfig,
        capacity: CapacityModel | None = None,
        router: Any = None,
        key: str = "",
        events: list[str] | None = None,
    ) -> None:
        """``router``, ``key`` and ``events``: a further model version's controller, in
        the root controller's process, shares its router and its event log; its
        instances register with ``key``."""
        setup_logging()
        self.config = config
        self.key = key  # the deployment key of the model version it serves (router.models)
        self.health = config.health
        self.model_path = str(resolve_model(config.model))
        self.model = ModelConfig.from_dir(self.model_path)
        self.regions = {r.name: RegionInstances(r.name) for r in config.regions}
        self.specs = {r.name: r for r in config.regions}
        self.targets = {
            r.name: {"prefill": r.prefill.count, "decode": r.decode.count} for r in config.regions
        }
        self.starting = {r.name: {"prefill": 0, "decode": 0} for r in config.regions}
        self.planner = make_planner(
            config.planner,
            config.router.ttft_slo_s,
            config.router.tpot_slo_s,
            self.specs,
            capacity,
        )
        self.router: Any = router
        self.owns_router = router is None  # the root: it runs the router and the fleet
        self.router_up = _router_up_future(self.owns_router)
        self.router_incarnation: str | None = None  # the router's, as this controller last saw it
        self.retired = False  # its version takes no traffic any more: all targets 0
        self.endpoints: Endpoints | None = None
        self.draining: set[str] = set()
        # Instances found unhealthy, shown by status until their replacement is up.
        self.unhealthy: dict[str, InstanceStatus] = {}
        self.retries: dict[str, RetryState] = {}  # region -> its failed starts
        self.events: list[str] = [] if events is None else events
        self.scale_log = ScaleLog()  # for the metrics and the dashboard
        self.lock = threading.RLock()
        self.topology = threading.RLock()
        self._stop = threading.Event()
        self.health_checks = HealthChecks(self)
        self.planning = Planning(self)
        self.membership = Membership(self)
        self.pool = WarmPool(self)
        self.fleet = Fleet(self) if self.owns_router else None

    # -- start ------------------------------------------------------------------------

    def start(self) -> Endpoints | None:
        also: list[Callable[[], None]] = []  # beside the regions' instances
        if not self.owns_router:  # the root's router, up: its instances register with it
            self.router_incarnation = ray.get(self.router.incarnation.remote())
        if self.owns_router:
            node = ray.get_runtime_context().get_node_id()
            here = NodeAffinitySchedulingStrategy(node, soft=False)
            self.router, started = launch_router(
                self.config.router, self.model_path, {"scheduling_strategy": here}
            )
            also.append(partial(self._router_started, started))
        self.membership.start_all(also)
        for name in self.regions:
            self.pool.fill(name)  # in the background
        threading.Thread(
            target=self._loop, args=(self.health.interval_s, self.health_checks.check), daemon=True
        ).start()
        if self.config.planner.mode != "off":
            plan = (self.config.planner.interval_s, self.planning.plan)
            threading.Thread(target=self._loop, args=plan, daemon=True).start()
        self.event("cluster started" if self.owns_router else f"{self.key} started")
        return self.endpoints

    def _router_started(self, started: ray.ObjectRef) -> None:
        """Wait for the router's servers (a started instance waits for this before it
        registers), then start the config's further models, which register with it."""
        try:
            self.endpoints = ray.get(started)
            ray.get(self.router.watch_demand.remote(ray.get_runtime_context().current_actor))
            self.router_incarnation = ray.get(self.router.incarnation.remote())
        except BaseException as e:
            self.router_up.set_exception(e)
            raise
        self.router_up.set_result(None)
        if self.fleet is not None:
            self.fleet.start()

    def router_handle(self) -> Any:
        return self.router

    # -- status and scaling --------------------------------------------------------------

    def status(self) -> ClusterStatus:
        return cluster_status(self)

    def models(self, action: str = "status", **args: Any) -> list[dict[str, Any]]:
        """Every served model version (``status``), after ``action`` if it is one of
        ``MODEL_ACTIONS`` (:mod:`pdserve.cluster.fleet`)."""
        if self.fleet is None or action not in MODEL_ACTIONS:
            raise InvalidArgumentError("action", f"no models action {action!r} here")
        result: list[dict[str, Any]] = getattr(self.fleet, action)(**args)
        return result

    def retire(self) -> None:
        """Drain and remove every instance: this version takes no new request any more."""
        with self.lock:
            self.retired = True
            for targets in self.targets.values():
                targets.update(prefill=0, decode=0)
        self.pool.stop()
        for name in self.regions:
            self.converge(name)

    def scale(
        self,
        region: str,
        prefill: int | None,
        decode: int | None,
        reason: str = "pdserve scale",
        source: str = "operator",
        cause: str = "operator",
    ) -> RegionStatus:
        """Set a region's targets and reach them (draining what goes)."""
        if region not in self.regions:
            raise InvalidArgumentError(
                "region", f"unknown region {region!r}; known: {sorted(self.regions)}"
            )
        spec = self.specs[region]
        used = self.pages_used(self._listed(region))  # RPCs: before the lock
        with self.lock:
            wanted = {name: dict(t) for name, t in self.targets.items()}
            for role, want in (("prefill", prefill), ("decode", decode)):
                if want is None:
                    continue
                bounds = spec.role(role)
                if not bounds.min <= want <= bounds.max:
                    raise InvalidArgumentError(
                        role,
                        f"{want} is outside [{bounds.min}, {bounds.max}] for region {region!r}",
                    )
                wanted[region][role] = want
            check_fits(self.config.needs(wanted), ray.cluster_resources())
            self.targets[region] = wanted[region]
            t = self.targets[region]
            self.event(f"scale {region} to {t['prefill']}P:{t['decode']}D ({reason})")
            if source == "operator":
                self.decision(region, "set", cause, reason, source)
            # Claimed with the targets, so the health loop's retries never take them.
            roles, leaving = self._plan_region(region, used)
        self.membership.reach(region, roles, leaving, raise_errors=True)  # status and health go on
        with self.lock:
            return region_status(self, region)

    def wake(self, region: str, roles: list[Role]) -> None:
        """The router holds requests for ``region``, which has no instance of ``roles``."""
        self.planning.wake(region, roles)

    def flip(self, region: str, src: Role, dst: Role) -> bool:
        """Operator command: turn an idle ``src`` instance of the region into ``dst``."""
        if region not in self.regions:
            raise InvalidArgumentError("region", f"unknown region {region!r}")
        if not self.planning.flip(region, src, dst):
            return False
        self.decision(region, f"flip_to_{dst}", "operator", "pdserve flip", "operator")
        return True

    def instance_handles(self) -> list[tuple[str, Any]]:
        """(role, leader actor handle) of every instance."""
        with self.lock:
            return [(i.role, i.leader) for r in self.regions.values() for i in r.prefill + r.decode]

    def all_idle(self) -> bool:
        """Every instance holds no request and no page (a check for tests and drains)."""
        with self.lock:
            leaders = [i.leader for r in self.regions.values() for i in r.prefill + r.decode]
        try:
            ray.get([leader.check_idle.remote() for leader in leaders])
            return True
        except Exception:
            return False

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self.fleet is not None:
            self.fleet.stop()
        self.pool.stop()
        self._wait_for_starts()
        with self.lock:
            everyone = [i for r in self.regions.values() for i in r.prefill + r.decode]
            for r in self.regions.values():
                r.prefill.clear()
                r.decode.clear()
        if everyone:  # at once: each waits on its ranks' shutdown calls
            in_parallel(lambda instance: instance.shutdown(), everyone, "stop")
        if self.router is not None and self.owns_router:
            # a router that is restarting (or gone) has no servers to stop gracefully
            with contextlib.suppress(Exception):
                ray.get(self.router.stop.remote(), timeout=CALL_TIMEOUT_S)
            ray.kill(self.router)

    def _wait_for_starts(self) -> None:
        """Let the instance starts under way end (a replacement, a scale-up, a pool's
        refill): each shuts its instance down once up, the controller having stopped. A
        start cut short by the controller's end would leave its ranks and their placement
        group held in Ray until the job ends."""
        deadline = time.monotonic() + self.health.start_timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                under_way = sum(n for roles in self.starting.values() for n in roles.values())
                under_way += sum(self.pool.filling.values())
            if not under_way:
                return
            time.sleep(0.1)
        logger.warning(
            "stopping with instance starts still under way after %g s", self.health.start_timeout_s
        )

    # -- reconciling -----------------------------------------------------------------------

    def converge(self, region: str, raise_errors: bool = False) -> None:
        """Start what is missing, then drain and remove the surplus (lock not held)."""
        used = self.pages_used(self._listed(region))
        with self.lock:
            roles, leaving = self._plan_region(region, used)
        self.membership.reach(region, roles, leaving, raise_errors)

    def _listed(self, region: str) -> list[Instance]:
        with self.lock:
            return self.regions[region].prefill + self.regions[region].decode

    def staying(self, region: str, role: Role) -> list[Instance]:
        gone = self.draining | self.unhealthy.keys()
        return [i for i in self.regions[region].of(role) if i.instance_id not in gone]

    def _missing(self, region: str, role: Role) -> int:
        have = len(self.staying(region, role)) + self.starting[region][role]
        return self.targets[region][role] - have

    def _plan_region(
        self, region: str, used: dict[str, int] | None = None
    ) -> tuple[list[Role], list[Instance]]:
        """Claim the starts a region is missing; mark its surplus draining (lock held).

        The surplus to drain are the instances using the fewest KV pages
        (``used``: instance id -> pages, read before the lock). The caller tells
        the router, starts the claimed roles and waits for the returned instances
        to go idle (:class:`~pdserve.cluster.membership.Membership`), all without
        the lock.
        """
        roles: list[Role] = []
        leaving: list[Instance] = []
        if self.stopping:  # no start begins once the stop waits for those under way
            return roles, leaving
        for role in ROLES:
            missing = self._missing(region, role)
            if missing > 0:
                self.starting[region][role] += missing
                roles += [role] * missing
            while len(staying := self.staying(region, role)) > self.targets[region][role]:
                instance = min(staying, key=lambda i: (used or {}).get(i.instance_id, 0))
                self.draining.add(instance.instance_id)
                leaving.append(instance)
        return roles, leaving

    def short(self, region: str) -> bool:
        return any(self._missing(region, role) > 0 for role in ROLES)

    def retry_due(self) -> None:
        """Start what regions below their targets miss, once their backoff has passed."""
        now = time.monotonic()
        self.pool.fill_due()
        for region in self.regions:
            with self.lock:
                retry = self.retries.get(region)
                replacing = any(u.region == region for u in self.unhealthy.values())
                if self._stop.is_set() or replacing or not self.short(region):
                    continue  # (a replacement converges its region itself)
                if retry is not None and now < retry.next_at:
                    continue
                roles, leaving = self._plan_region(region)
            threading.Thread(
                target=self.membership.start_roles, args=(region, roles, False), daemon=True
            ).start()
            if leaving:  # a role above its target while the other is short
                threading.Thread(
                    target=self.membership.drain, args=(region, leaving), daemon=True
                ).start()

    @staticmethod
    def pages_used(instances: list[Instance]) -> dict[str, int]:
        """KV pages each instance holds (0 when it does not answer)."""
        stats = best_effort([i.leader.stats.remote() for i in instances])
        return {
            i.instance_id: (s.num_blocks - s.free_blocks) if s is not None else 0
            for i, s in zip(instances, stats, strict=True)
        }

    def push_snapshot(self) -> None:
        """Send the router the cluster's state (metrics, dashboard); never waits for it."""
        if self.router is not None:
            with self.lock:
                snapshot = self.scale_log.snapshot(self.regions, self.targets, self.draining)
            self.router.cluster_snapshot.remote(snapshot)

    # -- helpers -----------------------------------------------------------------------------

    def _loop(self, interval_s: float, step: Any) -> None:
        while not self._stop.wait(interval_s):
            try:
                step()
            except Exception:
                logger.exception("controller loop %s failed", getattr(step, "__name__", step))

    def decision(self, region: str, action: str, cause: str, reason: str, source: str) -> None:
        """Count a scaling decision and keep it for the dashboard's log."""
        with self.lock:
            self.scale_log.decision(region, action, cause, reason, source, self.targets[region])
        self.push_snapshot()  # on the dashboard now, not after the change completes

    def event(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        logger.info(line)
        with self.lock:
            self.events.append(line)
            del self.events[:-500]
