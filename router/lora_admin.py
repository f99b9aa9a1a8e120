"""Loading and unloading LoRA adapters across a serving cluster, while it serves.

    load(name, folder)   every instance of the model (or those named) loads the
                         adapter between two of its steps, on all its ranks
                         (``InstanceWorker.load_lora_adapter``), prefill and
                         decode alike; each acknowledgement names the adapter's
                         content fingerprint, which the router records per
                         instance; once one instance holds it the catalog serves
                         the name (``/v1/models``, gRPC ListModels)
    unload(name)         the catalog stops serving the name (new requests: 404),
                         then every holder unloads it; a holder whose requests
                         still use it refuses (409), keeps it, and the name is
                         served again until a retry succeeds
    instance_added(view) the router remembers each model's runtime adapters
                         (name, folder, fingerprint; forgotten on unload) and
                         loads them, in a background task, on every instance of
                         the model that registers later (scale-up, a replaced
                         instance), which serves the base model and its
                         start-up adapters at once; a load that fails there is
                         logged and counted (``pdserve_lora_replay_failures_total``)

Placement (``router/placement.py``) sends a request under an adapter only to
instances holding it with the content the cluster serves under that name, so
an instance that lacks it (a load that failed there, an instance started later
whose load is not acknowledged yet) never gets one; a prefill/decode pair both
hold it, and their pairing handshake compares the content of every name both hold.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.core.adapters import AdapterConflictError, UnknownAdapterError, check_adapter_name
from pdserve.core.errors import InvalidArgumentError, PdserveError
from pdserve.router.models import ModelCatalog
from pdserve.router.placement import AdapterUnavailableError
from pdserve.router.state import ClusterView, InstanceView

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeAdapter:
    """An adapter loaded at runtime, as instances that register later load it."""

    name: str
    folder: str
    fingerprint: str  # the content the cluster serves under ``name``


class LoraAdmin:
    def __init__(
        self,
        cluster: ClusterView,
        catalog: ModelCatalog,
        timeout_s: float = 120.0,
        metrics: Any = None,
    ) -> None:
        self.cluster = cluster
        self.catalog = catalog
        self.timeout_s = timeout_s
        self.metrics = metrics  # pdserve.core.metrics.Metrics (None: not counted)
        # model name -> adapter name -> what later instances of the model load
        self.runtime: dict[str, dict[str, RuntimeAdapter]] = {}
        self.replays: set[asyncio.Task[None]] = set()  # loads on instances started later

    def targets(
        self, model: str | None, instances: list[str] | None
    ) -> tuple[str, list[InstanceView]]:
        """(model name, its instances) a load or unload applies to; ``instances`` narrows them."""
        name = model or self.catalog.default or ""
        if name not in self.catalog.models:
            raise InvalidArgumentError(
                "model", f"unknown model {name!r}; served: {list(self.catalog.models)}"
            )
        keys = {v.key for v in self.catalog.models[name].versions.values()}
        views = [v for v in self.cluster.instances.values() if v.model in keys]
        if instances is not None:
            known = {v.instance_id for v in views}
            unknown = sorted(set(instances) - known)
            if unknown:
                raise InvalidArgumentError(
                    "instances", f"{unknown} are not instances of {name}; known: {sorted(known)}"
                )
            views = [v for v in views if v.instance_id in instances]
        return name, views

    async def load(
        self, name: str, folder: str, model: str | None = None, instances: list[str] | None = None
    ) -> dict[str, Any]:
        """Load ``folder`` as adapter ``name`` on the target instances; what each answered."""
        check_adapter_name("lora_name", name)
        if name in self.catalog.models:
            raise InvalidArgumentError("lora_name", f"{name!r} is the name of a served model")
        base, views = self.targets(model, instances)
        before = {v.instance_id for v in self.targets(base, None)[1]}
        if not views:
            raise AdapterUnavailableError(f"model {base!r} has no instance to load {name!r} on")
        todo = [v for v in views if name not in v.adapters]
        if not todo:
            held = sorted(v.instance_id for v in views)
            raise AdapterConflictError(
                "lora_name",
                f"adapter {name!r} is already loaded on {held or 'no instance'}; unload it first",
            )
        results = await self._call(todo, lambda v: v.handle.load_lora_adapter.remote(name, folder))
        loaded, failed = [], {}
        for view, result in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                failed[view.instance_id] = result
            else:
                self.cluster.set_adapter(view.instance_id, name, result[1])
                loaded.append(view.instance_id)
        if not loaded:
            raise _first(failed)
        self.catalog.add_adapter(base, name)
        first = self.cluster.instances[loaded[0]]  # the content its model version serves
        served = self.cluster.adapter_fingerprints[(first.model, name)]
        self.runtime.setdefault(base, {})[name] = RuntimeAdapter(name, folder, served)
        for view in self.targets(base, None)[1]:  # registered while it loaded: load it there
            if view.instance_id not in before and name not in view.adapters:
                self._replay_on(view, base, [self.runtime[base][name]])
        logger.info("LoRA adapter %r loaded from %s on %s", name, folder, loaded)
        return {
            "lora_name": name,
            "loaded_on": loaded,
            "failed": {k: str(e) for k, e in failed.items()},
        }

    async def unload(
        self, name: str, model: str | None = None, instances: list[str] | None = None
    ) -> dict[str, Any]:
        """Unload adapter ``name`` from the target instances holding it."""
        check_adapter_name("lora_name", name)
        base, views = self.targets(model, instances)
        holders = [v for v in views if name in v.adapters]
        if not holders:
            raise UnknownAdapterError(
                name, tuple(self.catalog.names()[1:]), base=self.catalog.default
            )
        everywhere = len(holders) == sum(
            name in v.adapters for v in self.cluster.instances.values()
        )
        remembered = self.runtime.get(base, {}).get(name)
        if everywhere:
            self.catalog.remove_adapter(base, name)  # new requests naming it: 404
            self.runtime.get(base, {}).pop(name, None)  # instances started later: not loaded
        results = await self._call(holders, lambda v: v.handle.unload_lora_adapter.remote(name))
        failed = {}
        for view, result in zip(holders, results, strict=True):
            if isinstance(result, UnknownAdapterError) or not isinstance(result, BaseException):
                self.cluster.set_adapter(view.instance_id, name, None)
            else:
                failed[view.instance_id] = result
        if failed and everywhere:
            self.catalog.add_adapter(base, name)  # still served by those that refused
            if remembered is not None:
                self.runtime.setdefault(base, {})[name] = remembered
        unloaded = [v.instance_id for v in holders if v.instance_id not in failed]
        if failed:
            detail = "; ".join(f"{k}: {e}" for k, e in failed.items())
            raise AdapterConflictError(
                "lora_name",
                f"adapter {name!r} unloaded from {unloaded}, not from {sorted(failed)} ({detail}); retry when their requests have finished",
            )
        logger.info("LoRA adapter %r unloaded from %s", name, unloaded)
        return {"lora_name": name, "unloaded_from": unloaded}

    def instance_added(self, view: InstanceView) -> None:
        """A new instance registered: load the runtime adapters of its model that it
        lacks, in a background task; placement counts it as a holder of each once its
        load is acknowledged with the content the cluster serves."""
        served = self.catalog.by_key(view.model)
        known = self.runtime.get(served.name, {}) if served is not None else {}
        todo = [a for a in known.values() if a.name not in view.adapters]
        if served is not None and todo:
            self._replay_on(view, served.name, todo)

    def _replay_on(self, view: InstanceView, base: str, todo: list[RuntimeAdapter]) -> None:
        task = asyncio.get_running_loop().create_task(self._replay(view, base, todo))
        self.replays.add(task)
        task.add_done_callback(lambda t: self._replay_done(view.instance_id, t))

    async def replayed(self) -> None:
        """Wait for the replays under way (each ends when its loads are answered)."""
        while self.replays:
            await asyncio.wait(list(self.replays))

    async def _replay(self, view: InstanceView, base: str, todo: list[RuntimeAdapter]) -> None:
        for adapter in todo:  # one at a time, in the order they were loaded
            if adapter.name in view.adapters:
                continue  # loaded there meanwhile (an admin load that reached it)
            [result] = await self._call(
                [view], lambda v, a=adapter: v.handle.load_lora_adapter.remote(a.name, a.folder)
            )
            if self.cluster.instances.get(view.instance_id) is not view:
                return  # it left the cluster while loading
            wanted = self.runtime.get(base, {}).get(adapter.name)
            if isinstance(result, BaseException):
                if wanted is None or view.adapters.get(adapter.name) != wanted.fingerprint:
                    self._replay_failed(view, adapter, str(result))  # (else: an admin load won)
                continue
            if wanted is not None and wanted.fingerprint == result[1]:
                self.cluster.set_adapter(view.instance_id, adapter.name, result[1])
                logger.info("LoRA adapter %r loaded on %s", adapter.name, view.instance_id)
                continue
            # Unloaded meanwhile, or the folder's content changed: take it off again.
            await self._call(
                [view], lambda v, a=adapter: v.handle.unload_lora_adapter.remote(a.name)
            )
            if wanted is not None:
                self._replay_failed(view, adapter, f"its folder now has content {result[1]}")

    def _replay_failed(self, view: InstanceView, adapter: RuntimeAdapter, why: str) -> None:
        logger.warning(
            "LoRA adapter %r (%s) not loaded on %s, which started after it was: %s",
            adapter.name,
            adapter.folder,
            view.instance_id,
            why,
        )
        if self.metrics is not None:
            self.metrics["pdserve_lora_replay_failures_total"].inc()

    def _replay_done(self, instance_id: str, task: asyncio.Task[None]) -> None:
        self.replays.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("LoRA replay on %s failed", instance_id, exc_info=task.exception())

    async def _call(self, views: list[InstanceView], call: Any) -> list[Any]:
        """Each view's answer to ``call(view)`` (a Ray ref), or the pdserve error it raised."""

        async def one(view: InstanceView) -> Any:
            try:
                return await asyncio.wait_for(call(view), self.timeout_s)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, PdserveError):
                    return e.cause
                return PdserveError(f"instance {view.instance_id} failed: {e.cause or e}")
            except (ray.exceptions.RayActorError, TimeoutError) as e:
                return PdserveError(
                    f"instance {view.instance_id} did not answer: {type(e).__name__}"
                )

        return list(await asyncio.gather(*(one(v) for v in views)))


def _first(failed: dict[str, BaseException]) -> BaseException:
    """The error to answer with when no instance loaded the adapter: a bad adapter's own."""
    errors = list(failed.values())
    return next(
        (e for e in errors if isinstance(e, InvalidArgumentError)),
        errors[0] if errors else PdserveError("no instance to load the adapter on"),
    )
