"""A region's section of the cluster config: its latencies, node labels, warm pool
and the count, bounds, resources, layout and engine options of each role.

    regions:
      - name: east
        latency_ms: {west: 20}
        node_labels: {pdserve/region: us-east}
        prefill: {count: 1, min: 1, max: 3, tensor_parallel_size: 2, num_cpus_per_rank: 1}
        decode: {count: 1, min: 1, max: 3, engine: {max_num_seqs: 64}}
        warm_pool: 1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster.config_yaml import Lines, get_map, typed, typed_map

ROLE_KEYS = {"count", "min", "max", "num_cpus_per_rank", "num_gpus_per_rank", "engine"}
PARALLEL_KEYS = {
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "expert_parallel_size",
    "redundant_experts",
}
MAX_INSTANCES = 10_000  # of one role in one region: count, min and max


@dataclass(frozen=True)
class RoleSpec:
    """How many instances of one role a region runs, their layout and resources.

    Attributes:
    count: instances of the role the region starts with.
    min: fewest instances the planner keeps (0 allowed: scale to zero).
    max: most instances the planner starts.
    num_cpus_per_rank: Ray CPUs each rank of an instance asks for.
    num_gpus_per_rank: Ray GPUs each rank of an instance asks for.
    parallel: the role's layout (``tensor_parallel_size``, ``pipeline_parallel_size``,
        ``expert_parallel_size``, ``redundant_experts``), over the engine section's.
    engine: engine options of this role over the cluster's ``engine`` section (e.g. a
        larger ``max_num_batched_tokens`` for prefill); an instance that flips role
        keeps the options it started with.
    """

    count: int = 1
    min: int = 1
    max: int = 4
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    parallel: dict[str, int] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RegionConfig:
    """One region: its latencies to the others, where its instances run, its pools.

    Attributes:
    name: the region's name (requests and ``pdserve scale --region`` name it); the
        first region is the default home.
    latency_ms: one-way latency to each other region; on one machine the router
        emulates it, waiting that long before sending a request to another region's
        instances.
    prefill, decode: each role's instances: how many, their layout and resources.
    node_labels: the Ray node labels the region's instances are placed on (e.g.
        ``pdserve/region: us-east`` on a multi-node cluster).
    warm_pool: instances kept started but serving nothing (the decode role's
        resources and engine options), so a start skips start-up: see
        pdserve.cluster.pool.
    """

    name: str
    latency_ms: dict[str, float] = field(default_factory=dict)
    prefill: RoleSpec = field(default_factory=RoleSpec)
    decode: RoleSpec = field(default_factory=RoleSpec)
    node_labels: dict[str, str] = field(default_factory=dict)
    warm_pool: int = 0

    def role(self, role: str) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode


def parse_region(raw: Any, i: int, lines: Lines, path: str | None = None) -> RegionConfig:
    path = path or f"regions[{i}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise lines.error(f"{path}.name", "each region needs a name")
    allowed = {"name", "latency_ms", "prefill", "decode", "node_labels", "warm_pool"}
    for key in raw:
        if key not in allowed:
            raise lines.error(f"{path}.{key}", f"unknown field (known: {sorted(allowed)})")
    return RegionConfig(
        name=raw["name"],
        latency_ms=typed_map(raw, "latency_ms", float, path, lines),
        prefill=_role(raw, "prefill", path, lines),
        decode=_role(raw, "decode", path, lines),
        node_labels=_labels(raw, path, lines),
        warm_pool=_pool_size(raw.get("warm_pool", 0), f"{path}.warm_pool", lines),
    )


def _labels(raw: dict[str, Any], path: str, lines: Lines) -> dict[str, str]:
    """``node_labels``: Ray's labels are strings; a YAML number or bool is written as one."""
    labels = get_map(raw, "node_labels", lines, path)
    for key, value in labels.items():
        if not isinstance(value, str | int | float):
            raise lines.error(f"{path}.node_labels.{key}", "must be a string")
    return {str(k): str(v) for k, v in labels.items()}


def _pool_size(value: Any, path: str, lines: Lines) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise lines.error(path, f"must be an integer >= 0 (instances kept warm), got {value!r}")
    return value


def _role(region: dict[str, Any], role: str, parent: str, lines: Lines) -> RoleSpec:
    raw, path = get_map(region, role, lines, parent), f"{parent}.{role}"
    for key in raw:
        if key not in ROLE_KEYS | PARALLEL_KEYS:
            raise lines.error(
                f"{path}.{key}", f"unknown field (known: {sorted(ROLE_KEYS | PARALLEL_KEYS)})"
            )

    def number(key: str, kind: type, default: Any) -> Any:
        return typed(raw.get(key, default), kind, f"{path}.{key}", lines)

    count = number("count", int, 1)
    spec = RoleSpec(
        count=count,
        min=number("min", int, count),
        max=number("max", int, max(count, 4)),
        num_cpus_per_rank=number("num_cpus_per_rank", float, 1.0),
        num_gpus_per_rank=number("num_gpus_per_rank", float, 0.0),
        parallel={k: number(k, int, None) for k in PARALLEL_KEYS if k in raw},
        engine=get_map(raw, "engine", lines, path),
    )
    for name in ("count", "min", "max"):
        if getattr(spec, name) < 0:
            raise lines.error(f"{path}.{name}", "must be >= 0")
        if getattr(spec, name) > MAX_INSTANCES:  # a million took the simulator for ever
            raise lines.error(f"{path}.{name}", f"must be at most {MAX_INSTANCES}")
    if not spec.min <= spec.count <= spec.max:  # a bound not given is not named (min is count)
        bound = (
            f"within [min={spec.min}, max={spec.max}]"
            if "min" in raw and "max" in raw
            else f"<= max ({spec.max})"
            if spec.count > spec.max
            else f">= min ({spec.min})"
        )
        raise lines.error(f"{path}.count", f"must be {bound}, got {spec.count}")
    return spec
