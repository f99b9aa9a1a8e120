"""A local cluster of builtin:tiny instances for the e2e tests, built from the same
parts the controller uses (instances, pairing, registration, routers)."""

from __future__ import annotations

import time
from functools import partial

import grpc
import ray

from pdserve.cluster.instances import start_instance
from pdserve.cluster.membership import in_parallel
from pdserve.cluster.topology import RegionInstances, join_region, register, start_router
from pdserve.core.config import DisaggregationConfig, build_engine_config
from pdserve.core.model_config import ModelConfig
from pdserve.models.builtin import resolve_model
from pdserve.parallel.instance import RankResources
from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

KEY = "test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
REMOTE = DisaggregationConfig(local_prefill_max_tokens=4, local_prefill_cached_fraction=1.0)


class Cluster:
    """Regions of builtin:tiny instances; routers can be added over the same instances.

    The instances start at once (as the controller starts a region's), then pair and
    register with a first router one at a time."""

    def __init__(self, regions: dict[str, tuple[int, int]]) -> None:
        self.path = str(resolve_model("builtin:tiny"))
        self.model = ModelConfig.from_dir(self.path)
        self.engine = build_engine_config("builtin:tiny", max_num_batched_tokens=256)
        self.regions = {name: RegionInstances(name) for name in regions}
        self.routers: list = []
        plan = [
            (name, role)
            for name, (n_prefill, n_decode) in regions.items()
            for role, count in (("decode", n_decode), ("prefill", n_prefill))
            for _ in range(count)
        ]
        first = RouterConfig(model_name="tiny", api_keys=(KEY,))  # instances register with it
        starts = [partial(self.router, first, register_all=False)] + [
            partial(
                start_instance,
                role,
                self.model,
                self.engine,
                "shm",
                RankResources(num_cpus=0.25),
                REMOTE,
            )
            for _, role in plan
        ]
        self._bootstrap, *started = in_parallel(lambda start: start(), starts, "tiny-cluster")
        for (name, _), instance in zip(plan, started, strict=True):
            join_region(self._bootstrap[0], self.regions[name], instance)

    def router(self, config: RouterConfig, register_all: bool = True):  # type: ignore[no-untyped-def]
        actor, endpoints = start_router(config, self.path)
        self.routers.append(actor)
        if register_all:
            for region in self.regions.values():
                for instance in region.prefill + region.decode:
                    register(actor, instance, region.name)
        return actor, endpoints

    def instances(self):  # type: ignore[no-untyped-def]
        return [i for r in self.regions.values() for i in r.prefill + r.decode]

    def assert_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get([i.leader.check_idle.remote() for i in self.instances()])
                return
            except ray.exceptions.RayTaskError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stats(self):  # type: ignore[no-untyped-def]
        return {i.instance_id: ray.get(i.leader.stats.remote()) for i in self.instances()}

    def shutdown(self) -> None:
        for actor in self.routers:
            ray.kill(actor)
        for instance in self.instances():
            instance.shutdown()


def stub(endpoints):  # type: ignore[no-untyped-def]
    return pb_grpc.CompletionStub(grpc.insecure_channel(f"{endpoints.host}:{endpoints.grpc_port}"))
