"""The cluster YAML's models beyond its own: each with a name, a version, a source
and its own prefill and decode pools per region; and how rollouts judge a canary.

    model: builtin:pycode          # the cluster's own model ...
    name: pycode                   # ... as clients name it (default: the model string)
    version: v1                    # (default: the registry version, else v1)
    models:
      - name: tiny
        version: v3
        model: builtin:tiny        # a folder, builtin:NAME or registry:NAME@VERSION
        engine: {max_num_seqs: 8}  # over the cluster's engine section
        regions:                   # regions named in the top-level regions list
          - name: east
            prefill: {count: 1}
            decode: {count: 1, min: 0}
    rollout: {min_requests: 20, max_error_rate_increase: 0.05, max_latency_regression: 0.5}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.cluster.config_regions import RegionConfig, parse_region
from pdserve.cluster.config_yaml import Lines, get_list, get_map, typed_fields
from pdserve.core.errors import InvalidArgumentError

MODEL_KEYS = {"name", "version", "model", "engine", "regions"}


@dataclass(frozen=True)
class ModelSpec:
    """One version of a model the cluster serves, and its pools per region.

    Attributes:
    name: the name clients give as a request's ``model``.
    version: the version served under that name.
    model: where its weights are: a folder, builtin:NAME or registry:NAME@VERSION.
    engine: its engine options, over the cluster's ``engine`` section.
    regions: its prefill and decode pools, in regions of the top-level list (their
        latencies are set there).
    """

    name: str
    version: str
    model: str
    engine: dict[str, Any]
    regions: tuple[RegionConfig, ...]

    @property
    def key(self) -> str:
        """The deployment key its instances register with (pdserve.router.models)."""
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class RolloutConfig:
    """How a canary is judged, and how a version is retired.

    Attributes:
    min_requests: a canary is judged once it served this many requests.
    max_error_rate_increase: the canary is rolled back when its share of failed
        requests exceeds the stable version's by more than this (0.05: 5 points).
    max_latency_regression: ... or when its TTFT or TPOT p90 exceeds the stable
        version's by more than this fraction (0.5: 50% slower).
    check_interval_s: how often a canary is judged.
    drain_grace_s: after traffic leaves a version, how long its instances keep taking
        the requests admitted just before (already pinned to it) before they drain.
    """

    min_requests: int = 20
    max_error_rate_increase: float = 0.05
    max_latency_regression: float = 0.5
    check_interval_s: float = 5.0
    drain_grace_s: float = 2.0

    def __post_init__(self) -> None:
        if self.min_requests < 1:
            raise InvalidArgumentError("rollout.min_requests", "must be >= 1")
        for name in ("max_error_rate_increase", "max_latency_regression", "drain_grace_s"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"rollout.{name}", "must be >= 0")
        if self.check_interval_s <= 0:
            raise InvalidArgumentError("rollout.check_interval_s", "must be > 0")


def default_version(model: str) -> str:
    """A registry model's version, else ``v1``."""
    if model.startswith("registry:") and "@" in model:
        return model.rpartition("@")[2]
    return "v1"


def parse_models(
    raw: dict[str, Any], lines: Lines, region_names: list[str], own_name: str
) -> tuple[ModelSpec, ...]:
    """The ``models`` list."""
    specs: list[ModelSpec] = []
    names = {own_name}
    for i, entry in enumerate(get_list(raw, "models", lines)):
        path = f"models[{i}]"
        if not isinstance(entry, dict):
            raise lines.error(path, "must be a mapping with name, model and regions")
        for key in entry:
            if key not in MODEL_KEYS:
                raise lines.error(f"{path}.{key}", f"unknown field (known: {sorted(MODEL_KEYS)})")
        for key in ("name", "model"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise lines.error(f"{path}.{key}", "required: a non-empty string")
        if entry["name"] in names:
            raise lines.error(f"{path}.name", f"duplicate model name {entry['name']!r}")
        names.add(entry["name"])
        regions = tuple(
            _model_region(r, j, f"{path}.regions", lines, region_names)
            for j, r in enumerate(get_list(entry, "regions", lines))
        )
        if not regions:
            raise lines.error(f"{path}.regions", "at least one region is required")
        version = entry.get("version", default_version(entry["model"]))
        specs.append(
            ModelSpec(
                entry["name"],
                str(version),
                entry["model"],
                get_map(entry, "engine", lines, path),
                regions,
            )
        )
    return tuple(specs)


def _model_region(raw: Any, j: int, path: str, lines: Lines, names: list[str]) -> RegionConfig:
    where = f"{path}[{j}]"
    if isinstance(raw, dict) and "latency_ms" in raw:
        raise lines.error(f"{where}.latency_ms", "set latencies in the top-level regions list")
    spec = parse_region(raw, j, lines, where)
    if spec.name not in names:
        raise lines.error(f"{where}.name", f"unknown region {spec.name!r}; known: {names}")
    return spec


def parse_rollout(raw: dict[str, Any], lines: Lines) -> RolloutConfig:
    values = typed_fields(get_map(raw, "rollout", lines), RolloutConfig, "rollout", lines)
    return RolloutConfig(**values)
