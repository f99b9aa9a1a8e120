"""Regions of paired prefill and decode instances behind one router actor.

Every prefill instance is paired with every decode instance of its region
(the router may choose any pair) and with the region's other prefill
instances (each may pull a prompt's prefix from another's cache), and every
instance is registered with the router, which subscribes to its load reports
and KV events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from pdserve.cluster.instance_spec import Role
from pdserve.cluster.instances import Instance, pair_in_region, start_instance
from pdserve.core.config import DisaggregationConfig, EngineConfig
from pdserve.core.model_config import ModelConfig
from pdserve.parallel.instance import RankResources
from pdserve.router.actor import Endpoints, RouterActor
from pdserve.router.config import RouterConfig
from pdserve.router.router import InstanceInfo


@dataclass
class RegionInstances:
    name: str
    prefill: list[Instance] = field(default_factory=list)
    decode: list[Instance] = field(default_factory=list)

    def of(self, role: Role) -> list[Instance]:
        return self.prefill if role == "prefill" else self.decode


def launch_router(
    config: RouterConfig, model_path: str, resources: dict[str, Any] | None = None
) -> tuple[Any, ray.ObjectRef]:
    """Create the router actor and ask it to start its servers, without waiting:
    the reference resolves to its :class:`Endpoints` once they listen (a controller
    starts its instances meanwhile)."""
    # Ray types ``.remote()`` as a handle or the class itself (whose methods have
    # no ``remote``), so actor handles are held as Any.
    actor: Any = (
        ray.remote(RouterActor)
        .options(
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=config.max_restarts,  # it starts its servers again (RouterActor)
            **(resources or {}),
        )
        .remote(config, model_path)
    )
    return actor, actor.start.remote()


def start_router(
    config: RouterConfig, model_path: str, resources: dict[str, Any] | None = None
) -> tuple[Any, Endpoints]:
    actor, started = launch_router(config, model_path, resources)
    return actor, ray.get(started)


def add_instance(
    router: Any,
    region: RegionInstances,
    role: Role,
    model: ModelConfig,
    engine: EngineConfig,
    connector: str,
    resources: RankResources | None,
    disaggregation: DisaggregationConfig,
    instance_id: str | None = None,
) -> Instance:
    """Start an instance, pair it with the region's other role, register it."""
    instance = start_instance(
        role, model, engine, connector, resources, disaggregation, instance_id
    )
    join_region(router, region, instance)
    return instance


def join_region(router: Any, region: RegionInstances, instance: Instance) -> None:
    """Pair a started instance with the region's other role, register it, list it
    (shut down if either fails)."""
    try:
        pair_in_region(instance, region.prefill, region.decode)
        register(router, instance, region.name)
    except BaseException:
        instance.shutdown()
        raise
    region.of(instance.role).append(instance)


def register(router: Any, instance: Instance, region: str, model: str = "") -> None:
    """Tell the router of a started instance (``model``: its version's deployment key)."""
    info = instance.group.info
    ray.get(
        router.register.remote(
            InstanceInfo(
                instance.instance_id,
                instance.role,
                region,
                instance.leader,
                info.block_size,
                info.max_model_len,
                model=model,
                adapters=ray.get(instance.leader.lora_fingerprints.remote()),
            )
        )
    )
