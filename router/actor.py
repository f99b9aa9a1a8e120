"""The router's Ray actor: the router, its gRPC and HTTP front doors, one event loop.

Decode instances push :class:`~pdserve.core.messages.TokenBatch` to
``deliver``; every instance pushes its :class:`~pdserve.core.messages.LoadReport`
to ``report``. The controller registers and drains instances.

Ray imports this module in every process that holds a router's handle (each
instance rank does, to push to it), so it imports the router itself, its front
doors and their libraries only inside the actor (a CPU rank's start: 0.2 CPU-s
less).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.core.net import host_port

if TYPE_CHECKING:
    from pdserve.core.messages import LoadReport, TokenBatch
    from pdserve.core.snapshot import ClusterSnapshot
    from pdserve.router.config import RouterConfig
    from pdserve.router.models import VersionHealth
    from pdserve.router.router import InstanceInfo, Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    host: str
    grpc_port: int
    http_port: int

    @property
    def grpc_address(self) -> str:
        """What a gRPC client dials (an IPv6 host in brackets)."""
        return host_port(self.host, self.grpc_port)

    @property
    def http_url(self) -> str:
        """The HTTP front door's base URL, ``http://host:port`` (TLS: change the scheme)."""
        return f"http://{host_port(self.host, self.http_port)}"


@dataclass(frozen=True)
class RouterStats:
    finished: dict[str, int]
    rejected: int
    retries_spent: int
    retries_denied: int
    admission_limits: dict[str, int]
    inflight: dict[str, int]
    placed: dict[str, int]
    hedged: int
    migrations: int
    prefix_blocks: dict[str, int]
    decision_us: dict[str, float]  # p50, p99 of placement decisions
    door_delay_us: dict[str, float]  # p50, p99 from a delta ready to written
    cold_waiting: dict[str, int] | None = None  # requests waiting for a cold start, per region
    cold_refused: int = 0  # refused: the region's cold-start queue was full
    cold_timed_out: int = 0  # waited past cold_start_timeout_s


class RouterActor:
    """Ray async actor body (wrapped with ``ray.remote`` by whoever starts it)."""

    def __init__(self, config: RouterConfig, model_path: str) -> None:
        from pdserve.core.logs import setup_logging
        from pdserve.core.model_config import ModelConfig
        from pdserve.core.tokenizer import Tokenizer
        from pdserve.router.frontdoor.auth import ApiKeys

        setup_logging()
        self.config = config
        self.model = ModelConfig.from_dir(model_path)
        has_tokenizer = (Path(model_path) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(model_path) if has_tokenizer else None
        self.keys = ApiKeys(
            config.api_keys,
            config.auth_disabled,
            config.api_key_priorities,
            config.api_key_admins,
            config.api_key_tenants,
        )
        self.router: Router | None = None
        self._servers: list[Any] = []
        self._sampler: asyncio.Future[None] | None = None
        self._resuming: asyncio.Future[None] | None = None  # batches resumed at start-up
        self._restarted: asyncio.Future[Endpoints] | None = None
        self._incarnation = uuid.uuid4().hex  # new at each (re)start: it knows no instance
        if _reconstructed():  # Ray restarted this actor after it died: serve again
            logger.warning("the router restarted: listening again, resuming its batches")
            self._restarted = asyncio.ensure_future(self.start())

    async def start(self) -> Endpoints:
        import ray

        from pdserve.router.frontdoor.batches import front_door_url
        from pdserve.router.frontdoor.grpc_service import start_grpc
        from pdserve.router.frontdoor.http_api import HttpApi, start_http
        from pdserve.router.router import Router

        sink = ray.get_runtime_context().current_actor
        self.router = Router(self.config, self.tokenizer, sink, self.model.vocab_size)
        self._publish_traffic()
        tls = self.config.tls
        grpc_server, grpc_port = await start_grpc(
            self.router, self.keys, self.config.host, self.config.grpc_port, tls
        )
        api = HttpApi(self.router, self.keys, self.config.max_body_bytes, batch_folder(self.config))
        http_runner, http_port = await start_http(api, self.config.host, self.config.http_port, tls)
        if api.batches is not None:
            url = front_door_url("http" if tls is None else "https", self.config.host, http_port)
            client_certs = tls is not None and bool(tls.client_ca)
            self._resuming = api.batches.listening(url, tls is not None, client_certs)
        self._servers = [grpc_server, http_runner]
        self._sampler = asyncio.ensure_future(self._sample_every(1.0))
        logger.info(
            "router serving gRPC on %s:%d, HTTP on %s:%d (%s)",
            self.config.host,
            grpc_port,
            self.config.host,
            http_port,
            "plain TCP"
            if tls is None
            else "TLS" + (", client certificates" if tls.client_ca else ""),
        )
        # Everything loaded so far lives as long as the actor: leave it out of the
        # collector's full passes, which would otherwise stall the loop for
        # milliseconds while tokens wait to be written.
        gc.freeze()
        return Endpoints(self.config.host, grpc_port, http_port)

    def _router(self) -> Router:
        assert self.router is not None, "start() first"
        return self.router

    async def incarnation(self) -> str:
        """Who this router is since it last (re)started, once it serves: a controller that
        sees it change registers its instances again (a restarted router knows none)."""
        if self._restarted is not None:
            await self._restarted
        return self._incarnation

    async def register(self, info: InstanceInfo) -> None:
        router = self._router()
        router.register(info)
        first = await info.handle.subscribe_router.remote(_self_handle())
        router.on_report(first)

    async def unregister(self, instance_id: str) -> None:
        self._router().unregister(instance_id)

    async def adapters(self) -> dict[str, dict[str, str]]:
        """Each instance's LoRA adapters as the router records them (name -> content
        fingerprint), once the runtime loads under way on instances started later end."""
        router = self._router()
        await router.lora.replayed()
        return {i: dict(v.adapters) for i, v in router.cluster.instances.items()}

    # -- models and versions (the controller's rollouts) ----------------------------------------

    async def add_version(
        self, name: str, version: str, key: str, path: str, adapters: tuple[str, ...] = ()
    ) -> None:
        """Serve ``name@version`` (its instances register with ``key``); no traffic yet
        if ``name`` has a version already."""
        from pdserve.router.models import ServedVersion

        served = await asyncio.to_thread(ServedVersion.load, name, version, key, path, adapters)
        self._router().catalog.add(served)
        self._publish_traffic()

    async def set_traffic(self, name: str, shares: dict[str, float]) -> None:
        self._router().catalog.set_traffic(name, shares)
        self._publish_traffic()

    def _publish_traffic(self) -> None:
        router = self._router()
        gauge = router.obs.metrics["pdserve_model_traffic_share"]
        for name, model in router.catalog.models.items():
            for version, share in model.traffic.items():
                gauge.labels(name, version).set(share)

    async def remove_version(self, name: str, version: str) -> None:
        router = self._router()
        served = router.catalog.models.get(name)
        gone = served.versions.get(version) if served else None
        router.catalog.remove(name, version)
        if gone is not None:
            router.outcomes.forget(gone.key)
        router.obs.metrics["pdserve_model_traffic_share"].labels(name, version).set(0.0)

    async def version_health(self, key: str) -> VersionHealth:
        return self._router().outcomes.health(key)

    async def traffic(self) -> dict[str, dict[str, float]]:
        """Each served model's versions and their shares of its new requests."""
        return {n: dict(m.traffic) for n, m in self._router().catalog.models.items()}

    async def set_draining(self, instance_id: str, draining: bool) -> None:
        self._router().set_draining(instance_id, draining)

    async def deliver(self, batch: TokenBatch) -> None:
        self._router().on_tokens(batch)

    async def report(self, report: LoadReport) -> None:
        self._router().on_report(report)

    async def tables(self) -> dict[str, int]:
        """Per-request tables of the router and their sizes (all 0 at rest)."""
        return self._router().tables()

    async def stats(self) -> RouterStats:
        r = self._router()
        return RouterStats(
            dict(r.finished),
            r.admission.rejected,
            r.retries.spent,
            r.retries.denied,
            {name.name: r.admission.limit(name.name) for name in self.config.regions},
            dict(r.region_inflight),
            dict(r.placed),
            r.hedged,
            r.migrations,
            {i: r.prefixes.size(i) for i in r.cluster.instances},
            _percentiles(r.decision_s),
            _percentiles(r.door_delay_s),
            dict(r.cold.waiting),
            r.cold.refused,
            r.cold.timed_out,
        )

    async def cluster_snapshot(self, snapshot: ClusterSnapshot) -> None:
        """The controller's view (instance counters, targets, decisions), every second."""
        self._router().obs.snapshot(snapshot)

    async def metrics_text(self) -> str:
        """The ``/metrics`` exposition (for tools that hold an actor handle)."""
        return self._router().obs.exposition()[0].decode()

    async def _sample_every(self, interval_s: float) -> None:
        while True:
            try:
                self._router().obs.sample(self._router())
            except Exception:
                logger.exception("dashboard sample failed")
            await asyncio.sleep(interval_s)

    async def region_metrics(self, window_s: float = 30.0, model: str = "") -> list[dict[str, Any]]:
        """Each region's metrics for the planner of the model version ``model``."""
        from pdserve.router.observe import drain_rate

        router = self._router()
        metrics = router.obs.region_metrics(router, window_s, model)
        for m in metrics:  # requests held for a cold start: the region is not calm
            m["cold_waiting"] = router.cold.waiting.get(m["region"], 0)
            times, tokens = m.pop("arrivals")  # the latest 1,024: the drain rate is O(n^2)
            m["arrival_drain_rate"] = await asyncio.to_thread(
                drain_rate, times[-1024:], tokens[-1024:], self.config.ttft_slo_s
            )
        return metrics

    async def watch_demand(self, controller: Any) -> None:
        """Call ``controller.wake(region, roles)`` (no wait for it) when a request starts
        waiting in a region that lacks ``roles`` (scaled to zero)."""
        self._router().cold.demand = lambda region, roles: controller.wake.remote(
            region, list(roles)
        )

    async def instance_lost(self, instance_id: str) -> None:
        """The controller saw an instance die: move its requests elsewhere."""
        self._router().instance_lost(instance_id)

    async def drain_timed_out(self, instance_id: str) -> int:
        """A draining instance outlived its drain timeout: move what it holds elsewhere."""
        return self._router().drain_timed_out(instance_id)

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        for server in self._servers:
            if hasattr(server, "stop"):
                await server.stop(grace=1.0)
            else:
                await server.cleanup()


def batch_folder(config: RouterConfig) -> Path:
    """Where the front door keeps batch files and records."""
    if config.batch_dir:
        return Path(config.batch_dir).expanduser()
    return Path.home() / ".cache" / "pdserve" / "batches"


def _percentiles(values: Any) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {}
    return {
        q: round(data[min(len(data) - 1, int(p * len(data)))] * 1e6, 1)
        for q, p in (("p50", 0.5), ("p99", 0.99))
    }


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (``max_restarts``) rather than created it."""
    import ray

    return ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _self_handle() -> Any:
    import ray

    return ray.get_runtime_context().current_actor
