"""The controller: one Ray actor that owns the cluster's state.

It starts the router and every region's instances from a :class:`ClusterConfig`,
then keeps the cluster at its targets:

- ``scale(region, prefill, decode)`` sets a region's targets and reconciles:
  new instances are started, paired and registered; surplus ones are drained
  first (the router stops sending them work, they finish what they hold) and
  only then removed, so scaling fails or restarts no request;
- a health loop pings every instance leader; one that does not answer is
  reported to the router (which moves its requests to other instances), its
  remains are torn down, and a replacement is started;
- a planner loop reads the router's region metrics and, per its mode, records
  or applies its decisions. When it wants more of a role and the cluster has
  no room for a new instance, an idle instance of the other role flips.

Topology changes are serialized by one lock, which is not held while an
instance drains (status, health checks and other regions' scaling go on); the
loops run on their own threads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.config import ClusterConfig, RegionConfig
from pdserve.cluster.instances import Instance, pair
from pdserve.cluster.planner import Planner, PlannerDecision, RegionMetrics
from pdserve.cluster.scale_log import ScaleLog
from pdserve.cluster.topology import RegionInstances, add_instance, register, start_router
from pdserve.cluster.worker import Role
from pdserve.core.builtin_models import resolve_model
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.logs import setup_logging
from pdserve.core.metrics import ScaleEvent
from pdserve.core.model_config import ModelConfig
from pdserve.parallel.instance import RankResources
from pdserve.router.actor import Endpoints

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
PING_TIMEOUT_S = 5.0
DRAIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class InstanceStatus:
    instance_id: str
    region: str
    role: str
    healthy: bool
    draining: bool


@dataclass(frozen=True)
class RegionStatus:
    name: str
    prefill: int
    decode: int
    target_prefill: int
    target_decode: int


@dataclass(frozen=True)
class ClusterStatus:
    endpoints: Endpoints | None
    regions: list[RegionStatus]
    instances: list[InstanceStatus]
    planner_mode: str
    decisions: list[PlannerDecision]
    events: list[str]
    scale_events: list[ScaleEvent]


class Controller:
    """Ray actor body (started by :func:`pdserve.cluster.serve.start_controller`)."""

    def __init__(self, config: ClusterConfig) -> None:
        setup_logging()
        self.config = config
        self.model_path = str(resolve_model(config.model))
        self.model = ModelConfig.from_dir(self.model_path)
        self.regions = {r.name: RegionInstances(r.name) for r in config.regions}
        self.specs = {r.name: r for r in config.regions}
        self.targets = {
            r.name: {"prefill": r.prefill.count, "decode": r.decode.count} for r in config.regions
        }
        self.planner = Planner(
            config.planner, config.router.ttft_slo_s, config.router.tpot_slo_s, self.specs
        )
        self.router: Any = None
        self.endpoints: Endpoints | None = None
        self.draining: set[str] = set()
        self.events: list[str] = []
        self.scale_log = ScaleLog()  # for the metrics and the dashboard
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ids = 0

    # -- start ------------------------------------------------------------------------

    def start(self) -> Endpoints:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.router, self.endpoints = start_router(
            self.config.router, self.model_path, {"scheduling_strategy": here}
        )
        with self._lock:
            for name in self.regions:
                self._reconcile(name)  # only starts instances: nothing exists to drain yet
        threading.Thread(
            target=self._loop, args=(HEALTH_INTERVAL_S, self._check_health), daemon=True
        ).start()
        if self.config.planner.mode != "off":
            threading.Thread(
                target=self._loop, args=(self.config.planner.interval_s, self._plan), daemon=True
            ).start()
        self._event("cluster started")
        return self.endpoints

    def router_handle(self) -> Any:
        return self.router

    # -- status and scaling --------------------------------------------------------------

    def status(self) -> ClusterStatus:
        with self._lock:
            regions = [
                RegionStatus(
                    name,
                    len(r.prefill),
                    len(r.decode),
                    self.targets[name]["prefill"],
                    self.targets[name]["decode"],
                )
                for name, r in self.regions.items()
            ]
            instances = [
                InstanceStatus(i.instance_id, name, i.role, True, i.instance_id in self.draining)
                for name, r in self.regions.items()
                for i in r.prefill + r.decode
            ]
        return ClusterStatus(
            self.endpoints,
            regions,
            instances,
            self.config.planner.mode,
            list(self.planner.history[-20:]),
            self.events[-50:],
            self.scale_log.events[-50:],
        )

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
        with self._lock:
            for role, want in (("prefill", prefill), ("decode", decode)):
                if want is None:
                    continue
                bounds = spec.role(role)
                if not bounds.min <= want <= bounds.max:
                    raise InvalidArgumentError(
                        role,
                        f"{want} is outside [{bounds.min}, {bounds.max}] for region {region!r}",
                    )
                self.targets[region][role] = want
            t = self.targets[region]
            self._event(f"scale {region} to {t['prefill']}P:{t['decode']}D ({reason})")
            if source == "operator":
                self._decision(region, "set", cause, reason, source)
            leaving = self._reconcile(region)
        self._drain(region, leaving)  # without the lock: status and health go on meanwhile
        with self._lock:
            r = self.regions[region]
            return RegionStatus(
                region,
                len(r.prefill),
                len(r.decode),
                self.targets[region]["prefill"],
                self.targets[region]["decode"],
            )

    def flip(self, region: str, src: str, dst: str) -> bool:
        """Operator command: turn an idle ``src`` instance of the region into ``dst``."""
        if region not in self.regions:
            raise InvalidArgumentError("region", f"unknown region {region!r}")
        with self._lock:
            if not self._flip(region, src, dst):
                return False
            self.targets[region][dst] += 1
            self.targets[region][src] -= 1
            self._decision(region, f"flip_to_{dst}", "operator", "pdserve flip", "operator")
            return True

    def instance_handles(self) -> list[tuple[str, Any]]:
        """(role, leader actor handle) of every instance."""
        with self._lock:
            return [(i.role, i.leader) for r in self.regions.values() for i in r.prefill + r.decode]

    def all_idle(self) -> bool:
        """Every instance holds no request and no page (a check for tests and drains)."""
        with self._lock:
            leaders = [i.leader for r in self.regions.values() for i in r.prefill + r.decode]
        try:
            ray.get([leader.check_idle.remote() for leader in leaders])
            return True
        except Exception:
            return False

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for r in self.regions.values():
                for instance in r.prefill + r.decode:
                    instance.shutdown()
                r.prefill.clear()
                r.decode.clear()
        if self.router is not None:
            ray.get(self.router.stop.remote())
            ray.kill(self.router)

    # -- reconciling -----------------------------------------------------------------------

    def _reconcile(self, region: str) -> list[Instance]:
        """Start what is missing; mark the surplus draining and return it.

        Called with the lock held; the caller then waits for the returned
        instances to go idle without it (:meth:`_drain`).
        """
        spec, instances = self.specs[region], self.regions[region]
        leaving = []
        for role in ("decode", "prefill"):  # decode first: prefill instances pair with them

            def staying(role: str = role) -> list[Instance]:
                return [i for i in instances.of(role) if i.instance_id not in self.draining]

            while len(staying()) < self.targets[region][role]:
                self._add(spec, role)
            while len(staying()) > self.targets[region][role]:
                instance = self._least_busy(staying())
                self.draining.add(instance.instance_id)
                ray.get(self.router.set_draining.remote(instance.instance_id, True))
                leaving.append(instance)
        return leaving

    def _add(self, spec: RegionConfig, role: Role) -> Instance:
        role_spec = spec.role(role)
        resources = RankResources(
            num_cpus=role_spec.num_cpus_per_rank,
            num_gpus=role_spec.num_gpus_per_rank,
            labels=dict(spec.node_labels) or None,
        )
        self._ids += 1
        instance_id = f"{spec.name}-{role}-{self._ids}"
        engine = self.config.engine_config(role, spec)
        instance = add_instance(
            self.router, self.regions[spec.name], role, self.model, engine, self.config.connector,
            resources, self.config.disaggregation, instance_id,
        )  # fmt: skip
        self._event(f"started {instance_id}")
        return instance

    def _drain(self, region: str, leaving: list[Instance]) -> None:
        """Wait (lock not held) for draining instances to finish their work, then remove them."""
        waits = [i.leader.wait_idle.remote(DRAIN_TIMEOUT_S) for i in leaving]
        for instance, ref in zip(leaving, waits, strict=True):
            try:
                idle = ray.get(ref, timeout=DRAIN_TIMEOUT_S + PING_TIMEOUT_S)
            except Exception:  # it died while draining: the health loop tears it down
                idle = False
            if not idle:
                logger.warning(
                    "%s still busy after %.0f s of draining; stopping it",
                    instance.instance_id,
                    DRAIN_TIMEOUT_S,
                )
            with self._lock:
                if instance in self.regions[region].of(instance.role):
                    self._detach(region, instance)
                    instance.shutdown()
                    self._event(f"removed {instance.instance_id} after draining")
                self.draining.discard(instance.instance_id)

    def _detach(self, region: str, instance: Instance) -> None:
        ray.get(self.router.unregister.remote(instance.instance_id))
        r = self.regions[region]
        r.of(instance.role).remove(instance)
        peers = r.decode if instance.role == "prefill" else r.prefill
        calls = [p.leader.forget_peer.remote(instance.instance_id) for p in peers]
        if instance.role == "decode":
            calls += [
                w.unpair_ranks.remote(instance.instance_id) for p in peers for w in p.group.workers
            ]
        _best_effort(calls)

    @staticmethod
    def _least_busy(instances: list[Instance]) -> Instance:
        stats = _best_effort([i.leader.stats.remote() for i in instances])
        used = [(s.num_blocks - s.free_blocks) if s is not None else 0 for s in stats]
        return instances[used.index(min(used))]

    # -- health -----------------------------------------------------------------------------

    def _check_health(self) -> None:
        with self._lock:
            everyone = [(name, i) for name, r in self.regions.items() for i in r.prefill + r.decode]
        pings = [i.leader.ping.remote() for _, i in everyone]
        stats = [i.leader.stats.remote() for _, i in everyone]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_TIMEOUT_S)
        for (name, instance), ref in zip(everyone, pings, strict=True):
            alive = ref in ready and _best_effort([ref])[0] is not None
            if not alive:
                self._replace(name, instance)
        counted, _ = ray.wait(stats, num_returns=len(stats), timeout=HEALTH_INTERVAL_S)
        read = [
            self.scale_log.read(name, instance.role, s)
            for (name, instance), ref in zip(everyone, stats, strict=True)
            if ref in counted and (s := _best_effort([ref])[0]) is not None
        ]
        self.scale_log.counters = read
        self._push_snapshot()

    def _push_snapshot(self) -> None:
        """Send the router the cluster's state (metrics, dashboard); never waits for it."""
        if self.router is not None:
            with self._lock:
                snapshot = self.scale_log.snapshot(self.regions, self.targets, self.draining)
            self.router.cluster_snapshot.remote(snapshot)

    def _replace(self, region: str, instance: Instance) -> None:
        with self._lock:
            if instance not in self.regions[region].of(instance.role):
                return
            self._event(
                f"{instance.instance_id} stopped answering: moving its requests, replacing it"
            )
            ray.get(self.router.instance_lost.remote(instance.instance_id))
            self._detach(region, instance)
            instance.shutdown()
            self.scale_log.restarted(region, instance.role)
            self._decision(
                region,
                f"replace_{instance.role}",
                "instance_lost",
                f"{instance.instance_id} stopped answering",
                "health",
            )
            leaving = self._reconcile(region)
        self._drain(region, leaving)

    # -- planner -------------------------------------------------------------------------------

    def _plan(self) -> None:
        metrics = ray.get(self.router.region_metrics.remote(self.config.planner.interval_s * 4))
        for m in metrics:
            decision = self.planner.decide(
                RegionMetrics(**{k: m[k] for k in RegionMetrics.__dataclass_fields__})
            )
            if decision is None:
                continue
            logger.info("planner: %s %s: %s", decision.region, decision.action, decision.reason)
            self._event(
                f"planner {decision.region} {decision.action} ({decision.reason}){'' if decision.applied else ' [advisory]'}"
            )
            if decision.applied:
                self._apply(decision)
            self._decision(
                decision.region,
                decision.action,
                decision.cause,
                decision.reason,
                "planner" if decision.applied else "planner-advisory",
            )

    def _apply(self, decision: PlannerDecision) -> None:
        verb, role = decision.action.split("_")
        region = decision.region
        with self._lock:
            targets = dict(self.targets[region])
            targets[role] += 1 if verb == "add" else -1
            other = "decode" if role == "prefill" else "prefill"
            if (
                verb == "add"
                and not self._room_for(region, role)
                and self._flip(region, other, role)
            ):
                self.targets[region][role] += 1
                self.targets[region][other] -= 1
                return
        self.scale(
            region,
            targets["prefill"],
            targets["decode"],
            reason=f"planner: {decision.reason}",
            source="planner",
        )

    def _room_for(self, region: str, role: str) -> bool:
        spec = self.specs[region].role(role)
        ranks = 1
        for size in spec.parallel.values():
            ranks *= size
        free = ray.available_resources()
        return (
            free.get("CPU", 0.0) >= spec.num_cpus_per_rank * ranks
            and free.get("GPU", 0.0) >= spec.num_gpus_per_rank * ranks
        )

    def _flip(self, region: str, src: str, dst: str) -> bool:
        """Turn an idle instance of role ``src`` into ``dst`` (no room for a new one)."""
        r, spec = self.regions[region], self.specs[region]
        if len(r.of(src)) <= spec.role(src).min or len(r.of(dst)) >= spec.role(dst).max:
            return False
        instance = self._least_busy(r.of(src))
        self.draining.add(instance.instance_id)
        ray.get(self.router.set_draining.remote(instance.instance_id, True))
        if not ray.get(instance.leader.wait_idle.remote(60.0)):
            ray.get(self.router.set_draining.remote(instance.instance_id, False))
            self.draining.discard(instance.instance_id)
            return False
        self._detach(region, instance)
        ray.get([w.flip_role.remote(dst) for w in instance.group.workers])
        instance.role = dst  # type: ignore[assignment]
        peers = r.prefill if dst == "decode" else r.decode
        for peer in peers:
            pair(peer, instance) if dst == "decode" else pair(instance, peer)
        r.of(dst).append(instance)
        register(self.router, instance, region)
        self.draining.discard(instance.instance_id)
        self._event(
            f"flipped {instance.instance_id} from {src} to {dst} (no room for a new instance)"
        )
        return True

    # -- helpers -----------------------------------------------------------------------------

    def _loop(self, interval_s: float, step: Any) -> None:
        while not self._stop.wait(interval_s):
            try:
                step()
            except Exception:
                logger.exception("controller loop %s failed", getattr(step, "__name__", step))

    def _decision(self, region: str, action: str, cause: str, reason: str, source: str) -> None:
        """Count a scaling decision and keep it for the dashboard's log."""
        self.scale_log.decision(region, action, cause, reason, source, self.targets[region])
        self._push_snapshot()  # on the dashboard now, not after the change completes

    def _event(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        logger.info(line)
        self.events.append(line)
        del self.events[:-500]


def _best_effort(refs: list[Any]) -> list[Any]:
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=PING_TIMEOUT_S))
        except Exception:
            out.append(None)
    return out
