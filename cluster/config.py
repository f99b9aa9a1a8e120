"""The cluster config: one YAML file describes a whole serving cluster.

    model: builtin:tiny
    connector: shm
    engine: {dtype: float32, max_num_batched_tokens: 512}
    regions:
      - name: east
        latency_ms: {west: 20}
        prefill: {count: 1, min: 1, max: 3, tensor_parallel_size: 1, num_cpus_per_rank: 1}
        decode: {count: 1, min: 1, max: 3}
    slo: {ttft_ms: 2000, tpot_ms: 200}
    server: {host: 127.0.0.1, grpc_port: 50051, http_port: 8000}
    auth: {api_keys: [], disabled: true}
    planner: {mode: advisory}
    health: {stall_timeout_s: 60}

Errors name the field and, when the value came from a file, its line:
``cluster.yaml:7: regions[0].prefill.count: must be >= 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from pdserve.cluster.config_models import (
    ModelSpec,
    RolloutConfig,
    parse_models,
    parse_rollout,
)
from pdserve.cluster.config_regions import (
    PARALLEL_KEYS,
    RegionConfig,
    parse_region,
)
from pdserve.cluster.config_router import router_config
from pdserve.cluster.config_yaml import Lines, get_list, get_map, to_python, typed, typed_fields
from pdserve.core.config import DisaggregationConfig, EngineConfig, build_engine_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.router.config import RouterConfig
from pdserve.transfer import check_connector

MIN_PLANNER_INTERVAL_S = 0.1  # the planner's interval: at least this


@dataclass(frozen=True)
class PlannerConfig:
    """Attributes:
    mode: "off", "advisory" (recommend and log only) or "on" (apply).
    policy: "reactive" (act on SLO misses) or "proactive" (forecast each region's
        traffic and move toward the counts a latency model says it needs; reactive
        rules still apply on a miss).
    interval_s: how often it looks at the metrics.
    cooldown_s: least time between two changes of one region.
    high: a metric above ``high`` x its SLO (or KV usage above ``kv_high``) asks for more.
    low: a region whose metrics stay under ``low`` x SLO for ``idle_s`` gives one back.
    kv_high: decode KV usage (a fraction of the pool) above which a region asks for
        one more decode instance.
    idle_s: how long a region stays calm (under ``low`` x SLO, or no traffic) before
        it gives one instance back; a role with ``min: 0`` goes down to zero.
    profile: proactive: the ``pdserve profile`` file whose latency model sizes a region.
    horizon_s: proactive: how far ahead the forecast looks (about an instance's start-up).
    headroom: proactive: capacity planned over the forecast (0.2: +20%).
    smoothing: proactive: weight of the newest window in the forecast (0 < x <= 1).
    """

    mode: str = "advisory"
    policy: str = "reactive"
    interval_s: float = 5.0
    cooldown_s: float = 30.0
    high: float = 0.9
    low: float = 0.3
    kv_high: float = 0.85
    idle_s: float = 60.0
    profile: str | None = None
    horizon_s: float = 60.0
    headroom: float = 0.2
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in ("off", "advisory", "on"):
            raise InvalidArgumentError(
                "planner.mode", f"must be off, advisory or on, got {self.mode!r}"
            )
        if self.policy not in ("reactive", "proactive"):
            raise InvalidArgumentError(
                "planner.policy", f"must be reactive or proactive, got {self.policy!r}"
            )
        # 0: the planner would never yield; below 0.1 s a simulated day is millions of ticks
        if not MIN_PLANNER_INTERVAL_S <= self.interval_s < float("inf"):
            raise InvalidArgumentError(
                "planner.interval_s",
                f"must be >= {MIN_PLANNER_INTERVAL_S} s and finite, got {self.interval_s}",
            )
        if not (self.cooldown_s >= 0 and self.idle_s >= 0):
            raise InvalidArgumentError("planner.cooldown_s", "cooldown_s and idle_s must be >= 0")
        if not 0 < self.low < self.high:
            raise InvalidArgumentError("planner.low", "must be > 0 and below planner.high")
        if self.horizon_s < 0 or self.headroom < 0:
            raise InvalidArgumentError("planner.horizon_s", "horizon_s and headroom must be >= 0")
        if not 0 < self.smoothing <= 1:
            raise InvalidArgumentError("planner.smoothing", "must be in (0, 1]")


@dataclass(frozen=True)
class HealthConfig:
    """How the controller watches instances and restores a region's targets.

    Attributes:
    interval_s: how often the controller checks every instance leader.
    ping_timeout_s: a leader that does not answer a health check within this is replaced.
    stall_timeout_s: an engine loop that has work but finishes nothing (no step, no
        command) for this long is unhealthy, and its instance is replaced; keep it
        well above the slowest step.
    retry_backoff_s: the wait before retrying a failed instance start; it doubles
        with each failure in a row.
    retry_backoff_max_s: the longest wait between two retries.
    start_timeout_s: how long each step of starting an instance (loading the model,
        allocating the KV cache, ...) may take before the start counts as failed and
        is retried.
    place_timeout_s: how long a start waits for Ray to find room for its ranks (an
        autoscaler may add a node meanwhile) before it counts as failed and is
        retried; default: ``start_timeout_s``. A cluster of fixed size can say "no
        room" sooner than its slowest rank start.
    drain_timeout_s: how long an instance leaving its region (scale-down, scale to
        zero, a version retired by a rollout) may take to finish the requests it
        holds; past it the router moves them to other instances, as it moves a lost
        instance's (no token missing or repeated), and the instance stops.
    """

    interval_s: float = 1.0
    ping_timeout_s: float = 5.0
    stall_timeout_s: float = 60.0
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 60.0
    start_timeout_s: float = 300.0
    place_timeout_s: float | None = None
    drain_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        positive = ("interval_s", "ping_timeout_s", "stall_timeout_s", "retry_backoff_s")
        for name in (*positive, "start_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"health.{name}", "must be > 0")
        if self.place_timeout_s is not None and self.place_timeout_s <= 0:
            raise InvalidArgumentError("health.place_timeout_s", "must be > 0")
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise InvalidArgumentError(
                "health.retry_backoff_max_s", "must be >= health.retry_backoff_s"
            )

    def backoff(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed starts in a row."""
        return min(self.retry_backoff_s * 2 ** max(failures - 1, 0), self.retry_backoff_max_s)


@dataclass(frozen=True)
class ClusterConfig:
    """A whole serving cluster, as one YAML file describes it.

    Attributes:
    model: the cluster's model: a checkpoint folder, ``builtin:NAME`` or
        ``registry:NAME@VERSION``.
    engine: engine options of every instance, by their flat names (EngineConfig's
        and its groups'); a role's ``engine`` goes over them.
    regions: the regions, each with its prefill and decode pools.
    connector: how KV pages move between prefill and decode instances: ``auto``,
        ``shm``, ``cuda_ipc``, ``object_store``, ``p2p`` or ``nccl`` (auto, per pair of
        ranks: between ranks on one Ray node ``cuda_ipc`` for a KV cache on a GPU,
        ``shm`` for one in host memory; between nodes ``object_store``). A named
        connector is used for every pair: ``shm`` and ``cuda_ipc`` reach only their
        own node; ``nccl`` moves pages GPU to GPU over an NCCL group per pair (gloo
        for caches in host memory).
    router: the router and its front doors (the slo, server, auth and router sections).
    planner: how the planner sizes each region's pools.
    health: how the controller watches instances.
    disaggregation: when a decode instance prefills a request itself.
    ray_num_cpus: the CPUs an embedded Ray instance offers (None: the machine's).
    metrics_port: read and checked for its type, but not used: the metrics are
        served on the router's HTTP port (``/metrics``).
    source: the file the config was read from, named in errors.
    models: the models served beside ``model``.
    rollout: how a canary is judged, and how a version is retired.
    """

    model: str
    engine: dict[str, Any]
    regions: tuple[RegionConfig, ...]
    connector: str = "auto"
    router: RouterConfig = field(default_factory=RouterConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    ray_num_cpus: int | None = None
    metrics_port: int = 0
    source: str = "<config>"
    models: tuple[ModelSpec, ...] = ()  # the models served beside ``model``
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    @property
    def version(self) -> str:
        """The version of ``model`` (``router.model_name`` is its name)."""
        return self.router.model_version

    def deployment(self, spec: ModelSpec) -> ClusterConfig:
        """The config of one more model's instances: its source, engine and pools, the
        rest as the cluster's. Its planner sizes its pools from its own metrics,
        reactively (a proactive planner's profile is of the cluster's own model)."""
        planner = replace(self.planner, policy="reactive", profile=None)
        return replace(
            self,
            model=spec.model,
            engine={**self.engine, **spec.engine},
            regions=spec.regions,
            models=(),
            planner=planner,
        )

    def engine_config(self, role: str, region: RegionConfig) -> EngineConfig:
        spec = region.role(role)
        return build_engine_config(self.model, **{**self.engine, **spec.engine, **spec.parallel})

    def instance_needs(self, role: str, region: RegionConfig) -> dict[str, float]:
        """Ray resources one instance of ``role`` in ``region`` asks for (all its ranks)."""
        spec = region.role(role)
        ranks = self.engine_config(role, region).parallel.world_size
        return {"CPU": spec.num_cpus_per_rank * ranks, "GPU": spec.num_gpus_per_rank * ranks}

    def needs(self, targets: dict[str, dict[str, int]] | None = None) -> dict[str, float]:
        """Ray resources of every instance at ``targets`` (region -> role -> count;
        default: the configured counts)."""
        total = {"CPU": 0.0, "GPU": 0.0}
        for region in self.regions:
            for role in ("prefill", "decode"):
                count = region.role(role).count if targets is None else targets[region.name][role]
                count += region.warm_pool if role == "decode" else 0  # the pool holds its own
                for key, amount in self.instance_needs(role, region).items():
                    total[key] += count * amount
        for spec in self.models:  # at their configured counts
            for key, amount in self.deployment(spec).needs().items():
                total[key] += amount
        return total


def load_config(path: str | Path) -> ClusterConfig:
    file = Path(path)
    if not file.is_file():
        raise InvalidArgumentError("config", f"no such file: {file}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError("config", f"{file}: not UTF-8 text ({e.reason})") from None
    return parse_config(text, str(file))


def parse_config(text: str, source: str = "<config>") -> ClusterConfig:
    lines = Lines(source)
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        raise InvalidArgumentError("config", f"{source}: not valid YAML: {e}") from None
    raw = to_python(node, "", lines) if node is not None else {}
    if not isinstance(raw, dict):
        raise lines.error("config", "must be a mapping")
    try:
        return _build(raw, lines)
    except InvalidArgumentError as e:
        if str(e).startswith(source):
            raise
        raise lines.error(e.field, e.message) from None


_TOP = {
    "model",
    "name",
    "version",
    "models",
    "rollout",
    "engine",
    "connector",
    "regions",
    "slo",
    "server",
    "auth",
    "planner",
    "router",
    "disaggregation",
    "ray",
    "health",
}


def _build(raw: dict[str, Any], lines: Lines) -> ClusterConfig:
    for key in raw:
        if key not in _TOP:
            raise lines.error(key, f"unknown field (known: {sorted(_TOP)})")
    if not isinstance(raw.get("model"), str):
        raise lines.error("model", "required: a checkpoint folder or builtin:<name>")
    regions = tuple(
        parse_region(r, i, lines) for i, r in enumerate(get_list(raw, "regions", lines))
    )
    if not regions:
        raise lines.error("regions", "at least one region is required")
    names = [r.name for r in regions]
    for r in regions:
        for other in r.latency_ms:
            if other not in names:
                raise lines.error(
                    f"regions[{names.index(r.name)}].latency_ms.{other}", "unknown region"
                )
    router = router_config(raw, [(r.name, r.latency_ms) for r in regions], lines)
    server = get_map(raw, "server", lines)
    config = ClusterConfig(
        model=raw["model"],
        engine=get_map(raw, "engine", lines),
        regions=regions,
        connector=_connector(typed(raw.get("connector", "auto"), str, "connector", lines), lines),
        router=router,
        planner=PlannerConfig(
            **typed_fields(
                _planner(get_map(raw, "planner", lines)), PlannerConfig, "planner", lines
            )
        ),
        health=HealthConfig(
            **typed_fields(get_map(raw, "health", lines), HealthConfig, "health", lines)
        ),
        disaggregation=DisaggregationConfig(
            **typed_fields(
                get_map(raw, "disaggregation", lines), DisaggregationConfig, "disaggregation", lines
            )
        ),
        ray_num_cpus=_ray_cpus(get_map(raw, "ray", lines), lines),
        metrics_port=typed(server.get("metrics_port", 0), int, "server.metrics_port", lines),
        source=lines.source,
        models=parse_models(raw, lines, names, router.model_name),
        rollout=parse_rollout(raw, lines),
    )
    _check_engines(config, lines)
    for i, spec in enumerate(config.models):
        _check_engines(config.deployment(spec), lines, f"models[{i}].")
    return config


def _connector(name: str, lines: Lines) -> str:
    try:
        check_connector(name)
    except InvalidArgumentError as e:
        raise lines.error("connector", e.message) from None
    return name


def _check_engines(config: ClusterConfig, lines: Lines, prefix: str = "") -> None:
    """Every engine option of every role, checked now rather than at start-up."""
    for i, region in enumerate(config.regions):
        for role in ("prefill", "decode"):
            try:
                config.engine_config(role, region)
            except InvalidArgumentError as e:
                if e.field in PARALLEL_KEYS:
                    where = f"{prefix}regions[{i}].{role}.{e.field}"
                elif e.field in region.role(role).engine:
                    where = f"{prefix}regions[{i}].{role}.engine.{e.field}"
                else:
                    where = f"{prefix and prefix + 'engine or '}engine.{e.field}"
                raise lines.error(where, e.message) from None


def _planner(planner: dict[str, Any]) -> dict[str, Any]:
    """``planner``, its ``mode: on`` / ``mode: off`` read as meant: YAML reads those
    unquoted words as booleans."""
    mode = planner.get("mode")
    return {**planner, "mode": "on" if mode else "off"} if isinstance(mode, bool) else planner


def _ray_cpus(ray: dict[str, Any], lines: Lines) -> int | None:
    """``ray.num_cpus``: the CPUs an embedded Ray instance offers (None: the machine's)."""
    for key in ray:
        if key != "num_cpus":
            raise lines.error(f"ray.{key}", "unknown field (known: ['num_cpus'])")
    value = ray.get("num_cpus")
    return None if value is None else typed(value, int, "ray.num_cpus", lines)
