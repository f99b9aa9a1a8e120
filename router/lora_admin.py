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

Placement (``router/placement.py``) sends a request under an adapter only to
instances holding it with the content the cluster serves under that name, so
an instance that lacks it (a load that failed there, an instance started after
the load) never gets one; a prefill/decode pair both hold it, and their
pairing handshake compares the content of every name both hold. Instances
started later (scale-up, restarts) hold the start-up adapters only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from pdserve.core.adapters import AdapterConflictError, UnknownAdapterError, check_adapter_name
from pdserve.core.errors import InvalidArgumentError, PdserveError
from pdserve.router.models import ModelCatalog
from pdserve.router.placement import AdapterUnavailableError
from pdserve.router.state import ClusterView, InstanceView

logger = logging.getLogger(__name__)


class LoraAdmin:
    def __init__(
        self, cluster: ClusterView, catalog: ModelCatalog, timeout_s: float = 120.0
    ) -> None:
        self.cluster = cluster
        self.catalog = catalog
        self.timeout_s = timeout_s

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
        if everywhere:
            self.catalog.remove_adapter(base, name)  # new requests naming it: 404
        results = await self._call(holders, lambda v: v.handle.unload_lora_adapter.remote(name))
        failed = {}
        for view, result in zip(holders, results, strict=True):
            if isinstance(result, UnknownAdapterError) or not isinstance(result, BaseException):
                self.cluster.set_adapter(view.instance_id, name, None)
            else:
                failed[view.instance_id] = result
        if failed and everywhere:
            self.catalog.add_adapter(base, name)  # still served by those that refused
        unloaded = [v.instance_id for v in holders if v.instance_id not in failed]
        if failed:
            detail = "; ".join(f"{k}: {e}" for k, e in failed.items())
            raise AdapterConflictError(
                "lora_name",
                f"adapter {name!r} unloaded from {unloaded}, not from {sorted(failed)} ({detail}); retry when their requests have finished",
            )
        logger.info("LoRA adapter %r unloaded from %s", name, unloaded)
        return {"lora_name": name, "unloaded_from": unloaded}

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
