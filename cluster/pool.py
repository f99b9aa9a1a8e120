"""The warm pool: instances started ahead of need, so a start skips start-up.

A region with ``warm_pool: N`` keeps N instances fully started (placement group,
rank processes, weights, KV cache, engine loop: every phase of
``pdserve_instance_start_seconds``) but paired with no one and unknown to the
router: they serve nothing and hold their resources. They are started as decode
instances, with the region's decode resources and engine options; one is flipped to
prefill only where the region's prefill role has the same options, layout and
resources (a flip keeps them: else prefill starts the slow way).

    Membership._add(region, role)
      take(region, role)   a pooled instance: pinged (one that does not answer is
                           killed), flipped to ``role`` if it is wanted as prefill
                           (weights kept, KV reallocated), then paired and
                           registered as any new instance; then the pool
                           refills on a thread of its own
      none ready           the instance starts the slow way
    the health loop        fill_due(): a pool short after a failed start is
                           refilled once the region's retry backoff has passed

Locks: the controller's ``_lock`` guards ``ready`` and ``filling``, held only to
read and change them, never while an instance starts or answers.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import ray

from pdserve.cluster.instance_spec import Role
from pdserve.cluster.instances import CALL_TIMEOUT_S, Instance, first_line

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from pdserve.cluster.config import ClusterConfig, HealthConfig, RegionConfig
    from pdserve.cluster.membership import Membership

logger = logging.getLogger(__name__)

POOL_ROLE: Role = "decode"  # the role pooled instances start in


class PoolHost(Protocol):
    """What the warm pool reads of the controller: the config and each region's spec,
    how to start an instance (membership), and the calls that log."""

    @property
    def config(self) -> ClusterConfig: ...
    @property
    def health(self) -> HealthConfig: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def specs(self) -> dict[str, RegionConfig]: ...
    @property
    def membership(self) -> Membership: ...
    @property
    def stopping(self) -> bool: ...
    def event(self, text: str) -> None: ...


class WarmPool:
    """The warm instances of every region of a :class:`~pdserve.cluster.controller.Controller`."""

    def __init__(self, controller: PoolHost) -> None:
        self.c = controller
        self.ready: dict[str, list[Instance]] = {name: [] for name in controller.specs}
        self.filling: dict[str, int] = dict.fromkeys(controller.specs, 0)
        self.failures: dict[str, int] = dict.fromkeys(controller.specs, 0)
        self.next_at: dict[str, float] = dict.fromkeys(controller.specs, 0.0)
        self.taken = 0  # instances that joined a region from the pool
        self.stopped = False  # stop() ran (the controller stops, or its version retired)

    def size(self, region: str) -> int:
        with self.c.lock:
            return len(self.ready[region])

    def fill(self, region: str) -> None:
        """Start, each on a thread of its own, what the region's pool lacks."""
        with self.c.lock:
            lacking = self.c.specs[region].warm_pool - len(self.ready[region])
            lacking -= self.filling[region]
            if lacking <= 0 or self.stopped or self.c.stopping:
                return
            self.filling[region] += lacking
        for _ in range(lacking):
            threading.Thread(target=self._start_one, args=(region,), daemon=True).start()

    def fill_due(self) -> None:
        """Refill the pools that are short, once a failed start's backoff has passed."""
        now = time.monotonic()
        for region in self.ready:
            if now >= self.next_at[region]:
                self.fill(region)

    def take(self, region: str, role: Role) -> Instance | None:
        """A ready instance of the region's pool, now of ``role``; None if none is ready.

        The caller refills the pool (``fill``) once the instance has joined, so the
        refill's process start does not compete with the join for the CPUs. None too
        where ``role`` is set up unlike the pool (other engine options, layout or
        resources): a flip keeps what the instance started with, so that role starts
        the slow way, as configured."""
        if not self.fits(region, role):
            return None
        with self.c.lock:
            instance = self.ready[region].pop(0) if self.ready[region] else None
        if instance is None:
            return None
        try:
            ray.get([w.ping.remote() for w in instance.group.workers], timeout=CALL_TIMEOUT_S)
            if role != instance.role:
                ray.get([w.flip_role.remote(role) for w in instance.group.workers])
                instance.role = role
        except Exception as e:
            instance.kill()
            self.c.event(f"warm pool {region}: {instance.instance_id} lost ({first_line(e)})")
            self.fill(region)
            return None
        with self.c.lock:
            self.taken += 1
        return instance

    def fits(self, region: str, role: Role) -> bool:
        """Whether a pooled instance flipped to ``role`` is what ``role`` would start as:
        the same engine options and layout, and the same resources per rank."""
        if role == POOL_ROLE:
            return True
        config, spec = self.c.config, self.c.specs[region]
        same_engine = config.engine_config(role, spec) == config.engine_config(POOL_ROLE, spec)
        return same_engine and config.instance_needs(role, spec) == config.instance_needs(
            POOL_ROLE, spec
        )

    def stop(self) -> None:
        """Shut every pooled instance down, for good: the controller is stopping, or its
        version retired (no refill, and a start still under way is shut down when up)."""
        with self.c.lock:
            self.stopped = True
            everyone = [i for pool in self.ready.values() for i in pool]
            for pool in self.ready.values():
                pool.clear()
        for instance in everyone:
            instance.shutdown()

    def _start_one(self, region: str) -> None:
        instance_id = self.c.membership.new_id(f"{region}-warm")
        try:
            instance = self.c.membership.start_new(self.c.specs[region], POOL_ROLE, instance_id)
        except Exception as e:
            with self.c.lock:
                self.filling[region] -= 1
                self.failures[region] += 1
                wait = self.c.health.backoff(self.failures[region])
                self.next_at[region] = time.monotonic() + wait
            self.c.event(f"warm pool {region}: starting {instance_id} failed: {first_line(e)}")
            return
        with self.c.lock:
            self.failures[region] = 0
            stopped = self.stopped or self.c.stopping
            if not stopped:
                self.ready[region].append(instance)
                self.filling[region] -= 1
        if stopped:  # still counted as filling: the controller's stop waits for this
            instance.shutdown()
            with self.c.lock:
                self.filling[region] -= 1
            return
        took = sum(instance.group.start_phases.values())
        self.c.event(f"warm pool {region}: {instance_id} ready in {took:.1f} s")
