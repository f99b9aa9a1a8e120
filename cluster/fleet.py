"""The cluster's models and versions: several models at once, and rollouts between versions.

Each served version is a *deployment*: its own instances in its own per-region
pools, run by a :class:`~pdserve.cluster.controller.Controller` (targets,
health, pairing, draining) behind the one router. The cluster's own ``model``
is the root controller's deployment; every entry of the YAML's ``models`` and
every version a rollout starts gets a controller of its own, in the root
controller's process, sharing its router.

A rollout of ``NAME`` to ``V``:

    start V's instances (canary: one prefill and one decode per region of the
        stable version; blue/green: the stable version's counts)
    the router serves V with no traffic, then
      canary      V takes ``canary``% of NAME's new requests; judged every
                  check_interval_s against the stable version: a worse error
                  rate or p90 TTFT/TPOT past the thresholds rolls it back
      blue/green  V takes all new requests at once
    promote       V takes all new requests; the old version is retired
    rollback      the stable version takes all new requests; V is retired

A request is pinned to the version picked when it was admitted (see
:mod:`pdserve.router.models`), so no stream mixes versions. Retiring a version
waits ``drain_grace_s`` (for requests admitted just before the switch to reach
its instances), then drains them: they take no new request and finish what
they hold before they stop; what they still hold after ``health.drain_timeout_s``
the router moves to the version that took the traffic (see
:meth:`~pdserve.router.models.ModelCatalog.heir`). No request is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray

from pdserve.cluster.config_models import ModelSpec, RolloutConfig
from pdserve.cluster.instances import CALL_TIMEOUT_S
from pdserve.cluster.membership import in_parallel
from pdserve.core.adapters import adapter_pairs
from pdserve.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pdserve.cluster.config import RegionConfig
    from pdserve.cluster.controller import Controller
    from pdserve.router.models import VersionHealth

logger = logging.getLogger(__name__)


@dataclass
class Deployment:
    spec: ModelSpec
    controller: Controller
    state: str = "stable"  # starting, stable, canary, promoting or retiring


def judge(stable: VersionHealth, canary: VersionHealth, config: RolloutConfig) -> str | None:
    """Why the canary must be rolled back, or None while it does as well as the stable one."""
    if canary.requests < config.min_requests:
        return None
    if canary.error_rate > stable.error_rate + config.max_error_rate_increase:
        return (
            f"error rate {canary.error_rate:.1%} against {stable.error_rate:.1%} "
            f"(allowed +{config.max_error_rate_increase:.1%})"
        )
    limit = 1.0 + config.max_latency_regression
    for what, new, old in (
        ("TTFT", canary.ttft_p90_s, stable.ttft_p90_s),
        ("TPOT", canary.tpot_p90_s, stable.tpot_p90_s),
    ):
        if new is not None and old is not None and new > old * limit:
            return f"{what} p90 {new * 1e3:.0f} ms against {old * 1e3:.0f} ms (allowed x{limit:g})"
    return None


def canary_regions(regions: tuple[RegionConfig, ...]) -> tuple[RegionConfig, ...]:
    """The stable version's regions at one instance per role (none where it has none)."""
    out = []
    for region in regions:
        p, d = (region.role(role) for role in ("prefill", "decode"))
        p = replace(p, count=min(p.count, 1), min=min(p.min, p.count, 1))
        d = replace(d, count=min(d.count, 1), min=min(d.min, d.count, 1))
        out.append(replace(region, prefill=p, decode=d, warm_pool=0))
    return tuple(out)


class Fleet:
    def __init__(self, root: Controller) -> None:
        self.root = root
        self.config = root.config.rollout
        own = ModelSpec(
            root.config.router.model_name,
            root.config.version,
            root.config.model,
            {},
            root.config.regions,
        )
        self.models: dict[str, dict[str, Deployment]] = {
            own.name: {own.version: Deployment(own, root)}
        }
        self.shares: dict[str, dict[str, float]] = {}  # the traffic shares set, per model
        self._lock = threading.RLock()
        self._stop = threading.Event()

    def start(self) -> None:
        """Start every model of the config's ``models`` list, all at once (the root
        controller runs this beside its own regions' starts), then the canary judge."""
        specs = list(self.root.config.models)
        with self._lock:
            for spec in specs:
                self.models[spec.name] = {}
        in_parallel(lambda spec: self._launch(spec, "stable"), specs, "models")
        threading.Thread(target=self._judge_loop, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            subs = [d.controller for v in self.models.values() for d in v.values()]
        for controller in subs:
            if controller is not self.root:
                controller.stop()

    # -- rollouts ------------------------------------------------------------------------------

    def rollout(
        self,
        name: str,
        version: str,
        source: str | None = None,
        canary: float = 10.0,
        blue_green: bool = False,
    ) -> list[dict[str, Any]]:
        """Start ``name@version`` and give it ``canary``% of the traffic (all of it with
        ``blue_green``, retiring the old version)."""
        if not blue_green and not 0 < canary < 100:
            raise InvalidArgumentError("canary", f"must be a percentage in (0, 100), got {canary}")
        with self._lock:
            stable = self._stable(name)
            if version in self.models[name]:
                raise InvalidArgumentError(
                    "version", f"{name}@{version} is served already; versions are immutable"
                )
            if any(
                d.state in ("starting", "canary", "promoting") for d in self.models[name].values()
            ):
                raise InvalidArgumentError(
                    "model", f"a rollout of {name} is in progress: promote or roll it back first"
                )
            regions = stable.spec.regions if blue_green else canary_regions(stable.spec.regions)
            model = source or _next_source(stable.spec.model, name, version)
            spec = ModelSpec(name, version, model, stable.spec.engine, regions)
            self.models[name][version] = placeholder = Deployment(spec, self.root, "starting")
        try:
            new = self._launch(spec, "starting")  # no traffic until it is given some
        except BaseException:
            with self._lock:
                if self.models[name].get(version) is placeholder:
                    del self.models[name][version]
            raise
        mode = "blue/green" if blue_green else f"canary {canary:g}%"
        self.root.event(f"rollout {name} to {version} ({mode}): instances up")
        if blue_green:
            self._switch(name, new, stable, "blue/green")
        else:
            new.state = "canary"
            share = canary / 100
            self._traffic(name, {stable.spec.version: 1 - share, version: share})
        return self.status()

    def promote(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            canary, stable = self._canary(name), self._stable(name)
            if canary is None:
                raise InvalidArgumentError("model", f"{name} has no canary to promote")
            canary.state = "promoting"  # not judged (nor rolled back) any more
        self._switch(name, canary, stable, "promoted")
        return self.status()

    def rollback(
        self, name: str, reason: str = "pdserve rollout --rollback"
    ) -> list[dict[str, Any]]:
        with self._lock:
            canary, stable = self._canary(name), self._stable(name)
            if canary is None:
                raise InvalidArgumentError("model", f"{name} has no canary to roll back")
            canary.state = "retiring"
        self._traffic(name, {stable.spec.version: 1.0})
        self.root.event(f"rollback {name} from {canary.spec.version}: {reason}")
        self._retire(canary)
        return self.status()

    def scale(
        self, name: str, region: str, prefill: int | None = None, decode: int | None = None
    ) -> list[dict[str, Any]]:
        """Set the targets of ``name``'s stable version in ``region`` (``pdserve scale --model``)."""
        with self._lock:
            controller = self._stable(name).controller
        controller.scale(region, prefill, decode)
        return self.status()

    def status(self) -> list[dict[str, Any]]:
        """Every served version: its state, traffic share and instances per region."""
        try:
            traffic = ray.get(self.root.router.traffic.remote(), timeout=CALL_TIMEOUT_S)
        except Exception:  # the router is restarting (or down): shares unknown meanwhile
            traffic = {}
        with self._lock:
            out: list[dict[str, Any]] = []
            for name, versions in self.models.items():
                for version, d in versions.items():
                    if d.state == "starting":
                        out.append({"model": name, "version": version, "state": d.state})
                        continue
                    counts = {
                        r: {"prefill": len(i.prefill), "decode": len(i.decode)}
                        for r, i in d.controller.regions.items()
                    }
                    share = traffic.get(name, {}).get(version, 0.0)
                    out.append(
                        {
                            "model": name,
                            "version": version,
                            "state": d.state,
                            "traffic": round(share, 4),
                            "regions": counts,
                        }
                    )
            return out

    # -- internals -----------------------------------------------------------------------------

    def _launch(self, spec: ModelSpec, state: str) -> Deployment:
        """Start a version's controller and instances; the router serves it once they
        are up (a further version of a model with no traffic yet)."""
        config = self.root.config.deployment(spec)
        # one event log for every deployment
        controller = type(self.root)(
            config, None, router=self.root.router, key=spec.key, events=self.root.events
        )
        try:
            controller.start()
            self._serve_version(spec, controller)
        except BaseException:
            controller.stop()
            raise
        deployment = Deployment(spec, controller, state)
        with self._lock:
            self.models.setdefault(spec.name, {})[spec.version] = deployment
        self.root.event(f"serving {spec.key} from {spec.model}")
        return deployment

    def _switch(self, name: str, new: Deployment, old: Deployment, why: str) -> None:
        """All of ``name``'s traffic to ``new``; ``old`` retired."""
        old.state = "retiring"
        self._traffic(name, {new.spec.version: 1.0})
        new.state = "stable"
        self.root.event(f"rollout {name}: {new.spec.version} takes all traffic ({why})")
        self._retire(old)

    def _retire(self, deployment: Deployment) -> None:
        """Drain a version that takes no traffic any more, then stop serving it."""
        time.sleep(self.config.drain_grace_s)
        spec = deployment.spec
        deployment.controller.retire()
        if deployment.controller is not self.root:
            deployment.controller.stop()
        ray.get(self.root.router.remove_version.remote(spec.name, spec.version))
        with self._lock:
            self.models[spec.name].pop(spec.version, None)
        self.root.event(f"retired {spec.key}")

    def _traffic(self, name: str, shares: dict[str, float]) -> None:
        ray.get(self.root.router.set_traffic.remote(name, shares))
        with self._lock:
            self.shares[name] = dict(shares)

    def _serve_version(self, spec: ModelSpec, controller: Controller) -> None:
        """Tell the router of a further version (its instances register under its key)."""
        engine = self.root.config.deployment(spec).engine
        adapters = tuple(n for n, _ in adapter_pairs(engine.get("lora_adapters") or ()))
        ray.get(
            self.root.router.add_version.remote(
                spec.name, spec.version, spec.key, controller.model_path, adapters
            )
        )

    def rejoin_router(self) -> None:
        """The router restarted and knows only the root's version: serve every further
        version again, with the traffic shares last set (before their instances register)."""
        with self._lock:
            further = [
                d
                for versions in self.models.values()
                for d in versions.values()
                if d.controller is not self.root and d.state != "starting"
            ]
            shares = {name: dict(s) for name, s in self.shares.items()}
        for d in further:
            self._serve_version(d.spec, d.controller)
        for name, s in shares.items():
            ray.get(self.root.router.set_traffic.remote(name, s))

    def _stable(self, name: str) -> Deployment:
        if name not in self.models:
            raise InvalidArgumentError(
                "model", f"unknown model {name!r}; served: {sorted(self.models)}"
            )
        stable = [d for d in self.models[name].values() if d.state == "stable"]
        if not stable:
            raise InvalidArgumentError("model", f"{name} has no stable version now")
        return stable[0]

    def _canary(self, name: str) -> Deployment | None:
        return next((d for d in self.models[name].values() if d.state == "canary"), None)

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.config.check_interval_s):
            with self._lock:
                pairs = [
                    (name, self._stable(name), canary)
                    for name in self.models
                    if (canary := self._canary(name)) is not None
                ]
            for name, stable, canary in pairs:
                try:
                    self._judge(name, stable, canary)
                except Exception:
                    logger.exception("judging the canary of %s failed", name)

    def _judge(self, name: str, stable: Deployment, canary: Deployment) -> None:
        router = self.root.router
        old, new = ray.get(
            [router.version_health.remote(d.controller.key) for d in (stable, canary)]
        )
        reason = judge(old, new, self.config)
        if reason is not None and canary.state == "canary":
            self.rollback(name, f"automatic: {reason}")


def _next_source(stable: str, name: str, version: str) -> str:
    """Where ``version``'s weights are when the rollout names none: the registry's next
    version of a registry model."""
    if stable.startswith("registry:"):
        return f"{stable.rpartition('@')[0]}@{version}"
    raise InvalidArgumentError(
        "source",
        f"{name} is served from {stable!r}, not the registry: name the weights of "
        f"{name}@{version} with --source (a folder, builtin:NAME or registry:NAME@VERSION)",
    )
