"""How instances join and leave a region: the starts and drains the controller plans.

The controller claims what a region is missing and marks its surplus draining
under its lock (``Controller._plan_region``); this module carries that out with
the lock not held:

- each claimed role gets a new instance, started, paired with the region's
  instances of the other role and registered with the router
  (:meth:`Membership.join`); the claimed roles start at once, each loading its
  weights while the others load theirs, and join one at a time (the join holds
  the controller's topology lock); a start that fails is recorded in the region's
  :class:`~pdserve.cluster.status.RetryState`, and the health loop retries it
  once its backoff has passed;
- a role is taken from the region's warm pool when one is ready there
  (:class:`~pdserve.cluster.pool.WarmPool`: started, not joined), so only the
  join remains;
- each draining instance is taken off the router's choices, waited for until it
  holds no work (at most ``health.drain_timeout_s``), then taken out of the region
  and the router (:meth:`Membership.detach`) and shut down; what it still holds
  at the timeout the router moves to other instances first, as it moves a lost
  instance's requests (:meth:`Membership.move_off`), so a drain loses no request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import ray

from pdserve.cluster.config import RegionConfig
from pdserve.cluster.instance_spec import Role
from pdserve.cluster.instances import (
    CALL_TIMEOUT_S,
    Instance,
    best_effort,
    first_line,
    pair_in_region,
    start_instance,
)
from pdserve.cluster.status import RetryState
from pdserve.cluster.topology import register
from pdserve.core.errors import InstanceFailedError
from pdserve.parallel.instance import RankResources

if TYPE_CHECKING:
    from concurrent.futures import Future
    from contextlib import AbstractContextManager

    from pdserve.cluster.config import ClusterConfig, HealthConfig
    from pdserve.cluster.pool import WarmPool
    from pdserve.cluster.scale_log import ScaleLog
    from pdserve.cluster.status import InstanceStatus
    from pdserve.cluster.topology import RegionInstances
    from pdserve.core.model_config import ModelConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def in_parallel(call: Callable[[T], R], items: Sequence[T], name: str) -> list[R]:
    """``call`` on every item, each in a thread of its own; the results in order (the
    first error raised once all are done). Starting instances is mostly waiting on
    their actors (spawning, importing, loading weights), so they overlap."""
    if len(items) <= 1:
        return [call(x) for x in items]
    with ThreadPoolExecutor(len(items), thread_name_prefix=name) as pool:
        return list(pool.map(call, items))


class MembershipHost(Protocol):
    """What membership reads and changes of the controller: the config and each region's
    spec, instances, starts in flight, draining and unhealthy sets and failed starts
    (under ``lock``; pairing and registering under ``topology``), the router, the warm
    pool it takes instances from, and the calls that log and reconcile."""

    @property
    def config(self) -> ClusterConfig: ...
    @property
    def key(self) -> str: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def health(self) -> HealthConfig: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def topology(self) -> AbstractContextManager[Any]: ...
    @property
    def specs(self) -> dict[str, RegionConfig]: ...
    @property
    def regions(self) -> dict[str, RegionInstances]: ...
    @property
    def starting(self) -> dict[str, dict[str, int]]: ...
    @property
    def draining(self) -> set[str]: ...
    @property
    def unhealthy(self) -> dict[str, InstanceStatus]: ...
    @property
    def retries(self) -> dict[str, RetryState]: ...
    @property
    def scale_log(self) -> ScaleLog: ...
    @property
    def router(self) -> Any: ...
    @property
    def router_up(self) -> Future[None]: ...
    @property
    def pool(self) -> WarmPool: ...
    @property
    def stopping(self) -> bool: ...
    def converge(self, region: str, raise_errors: bool = False) -> None: ...
    def short(self, region: str) -> bool: ...
    def decision(self, region: str, action: str, cause: str, reason: str, source: str) -> None: ...
    def event(self, text: str) -> None: ...


class Membership:
    """The starts and drains of a :class:`~pdserve.cluster.controller.Controller`,
    on its state (``c``) and under its locks."""

    def __init__(self, controller: MembershipHost) -> None:
        self.c = controller
        self._ids = 0  # instances started, for their ids

    def reach(
        self, region: str, roles: list[Role], leaving: list[Instance], raise_errors: bool
    ) -> None:
        """Start the claimed roles, then drain and remove the surplus (lock not held)."""
        try:
            self.start_roles(region, roles, raise_errors)
        finally:
            self.drain(region, leaving)

    def start_all(self, also: list[Callable[[], None]]) -> None:
        """At start-up: every region's instances at once (only starts, nothing to drain
        yet), beside ``also`` (the config's further models)."""
        starts: list[Callable[[], None]] = [
            partial(self.c.converge, r, True) for r in self.c.regions
        ]
        in_parallel(lambda start: start(), [*starts, *also], "start")

    def start_roles(self, region: str, roles: list[Role], raise_errors: bool) -> None:
        """Start one instance per entry of ``roles`` (claimed by ``Controller._plan_region``),
        all at once: a region of N instances starts in about the time of its slowest
        start, not of N starts one after another."""
        errors = in_parallel(lambda role: self._start_one(region, role), roles, f"start-{region}")
        error = next((e for e in errors if e is not None), None)
        with self.c.lock:
            if error is None and region in self.c.retries and not self.c.short(region):
                retry = self.c.retries.pop(region)
                self.c.event(f"{region} is whole again after {retry.failures} failed start(s)")
        if error is not None and raise_errors:
            raise error

    def _start_one(self, region: str, role: Role) -> Exception | None:
        """Start and join one claimed ``role``; its error, recorded for a retry, or None."""
        try:
            self._add(self.c.specs[region], role)
            return None
        except Exception as e:
            self._start_failed(region, role, e)
            return e
        finally:
            with self.c.lock:
                self.c.starting[region][role] -= 1

    def _start_failed(self, region: str, role: Role, error: Exception) -> None:
        with self.c.lock:
            retry = self.c.retries.setdefault(region, RetryState())
            retry.failures += 1
            wait = self.c.health.backoff(retry.failures)
            retry.next_at = time.monotonic() + wait
            retry.error = f"starting a {role} instance failed: {first_line(error)}"
            self.c.event(f"{region}: {retry.error}; retrying in {wait:.0f} s")
            self.c.decision(region, f"retry_{role}", "start_failed", retry.error, "health")

    def _add(self, spec: RegionConfig, role: Role) -> Instance:
        """A warm instance of the region's pool, else a new one; paired and registered."""
        began = time.monotonic()
        instance = self.c.pool.take(spec.name, role)
        if instance is not None:
            phases, how = {"pool": time.monotonic() - began}, " from the warm pool"
        else:
            instance_id = self.new_id(f"{spec.name}-{role}")
            instance = self.start_new(spec, role, instance_id)
            phases, how = instance.group.start_phases, ""
        if self.c.stopping:  # the controller stopped while it started: nobody would stop it
            instance.shutdown()
            raise InstanceFailedError(f"the cluster stopped while {instance.instance_id} started")
        try:
            self.join(spec.name, instance)
        except BaseException:
            instance.kill()
            raise
        with self.c.lock:
            self.c.scale_log.started(spec.name, role, phases)
        took = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
        self.c.event(
            f"started {instance.instance_id}{how} in {sum(phases.values()):.1f} s ({took})"
        )
        self.c.pool.fill(spec.name)  # after the join: a refill's start competes for CPUs
        return instance

    def join(self, region: str, instance: Instance) -> None:
        """Pair a started instance with the region's other role, register it, list it."""
        self.c.router_up.result()  # raises the router's start error
        with self.c.topology:
            with self.c.lock:
                r = self.c.regions[region]
                prefills, decodes = (
                    [p for p in role if p.instance_id not in self.c.unhealthy]
                    for role in (r.prefill, r.decode)
                )
            pair_in_region(instance, prefills, decodes)
            register(self.c.router, instance, region, self.c.key)
            with self.c.lock:
                r.of(instance.role).append(instance)

    def detach(self, region: str, instance: Instance) -> bool:
        """Take an instance out of the region and the router; False if it was out already."""
        with self.c.topology:
            with self.c.lock:
                r = self.c.regions[region]
                if instance not in r.of(instance.role):
                    return False
                r.of(instance.role).remove(instance)
                peers = list(r.decode if instance.role == "prefill" else r.prefill)
                senders = list(r.prefill)  # the instances with routes to it
                if instance.role == "prefill":
                    peers += senders  # its prefill peers forget it too
            ray.get(self.c.router.unregister.remote(instance.instance_id))
            calls = [p.leader.forget_peer.remote(instance.instance_id) for p in peers]
            calls += [
                w.unpair_ranks.remote(instance.instance_id)
                for p in senders
                for w in p.group.workers
            ]
            best_effort(calls)
            return True

    def new_id(self, stem: str) -> str:
        """A new instance id, unique in the cluster: a further model version's instances
        carry its deployment key (``code@v1-east-decode-3``)."""
        with self.c.lock:
            self._ids += 1
            return f"{self.c.key}-{stem}-{self._ids}" if self.c.key else f"{stem}-{self._ids}"

    def start_new(self, spec: RegionConfig, role: Role, instance_id: str) -> Instance:
        """Start an instance of ``role`` with the region's resources (not joined to it)."""
        role_spec = spec.role(role)
        resources = RankResources(
            num_cpus=role_spec.num_cpus_per_rank,
            num_gpus=role_spec.num_gpus_per_rank,
            labels=dict(spec.node_labels) or None,
            start_timeout_s=self.c.health.start_timeout_s,
            place_timeout_s=self.c.health.place_timeout_s,
        )
        engine = self.c.config.engine_config(role, spec)
        return start_instance(
            role,
            self.c.model,
            engine,
            self.c.config.connector,
            resources,
            self.c.config.disaggregation,
            instance_id,
        )

    def drain(self, region: str, leaving: list[Instance]) -> None:
        """Wait (lock not held) for draining instances to finish their work, then remove
        them; what one still holds after ``health.drain_timeout_s`` moves elsewhere."""
        timeout_s = self.c.health.drain_timeout_s
        for instance in leaving:  # the router sends them nothing new
            ray.get(self.c.router.set_draining.remote(instance.instance_id, True))
        waits = [i.leader.wait_idle.remote(timeout_s) for i in leaving]
        for instance, ref in zip(leaving, waits, strict=True):
            try:
                idle = ray.get(ref, timeout=timeout_s + CALL_TIMEOUT_S)
            except Exception:  # it died while draining: its requests move all the same
                idle = False
            if not idle:
                self.move_off(instance, timeout_s)
            if self.detach(region, instance):
                instance.shutdown()
                self.c.event(f"removed {instance.instance_id} after draining")
            with self.c.lock:
                self.c.draining.discard(instance.instance_id)

    def move_off(self, instance: Instance, timeout_s: float) -> None:
        """A drain outlived its timeout: the router moves every request the instance
        still holds to other instances (aborting each there), then it has a moment
        to let go of their pages before it stops."""
        ref = self.c.router.drain_timed_out.remote(instance.instance_id)
        try:
            done = f"moved {ray.get(ref, timeout=CALL_TIMEOUT_S)} request(s) to other instances"
        except Exception as e:
            done = f"moving its requests failed: {first_line(e)}"
        self.c.event(f"{instance.instance_id} still busy after {timeout_s:g} s of draining: {done}")
        best_effort([instance.leader.wait_idle.remote(CALL_TIMEOUT_S / 2)])
