"""The configuration reference, ``docs/config.md``, rendered from the config dataclasses.

The cluster YAML is read section by section into frozen dataclasses
(:mod:`pdserve.cluster.config` and the modules it reads sections with); each
dataclass lists its fields in an ``Attributes:`` block of its docstring, one
``name: text`` entry per field (or ``a, b: text`` for several), continued on
more indented lines. :data:`SECTIONS` says which YAML key becomes which field;
the type and default come from the dataclass, the description from its
docstring. ``python -m pdserve.deploy.config_docs > docs/config.md`` (``make
config-docs``) writes the page; ``tests/cluster/test_config_docs.py`` fails
when the page is stale or a field has no description.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.config import ClusterConfig, HealthConfig, PlannerConfig
from pdserve.cluster.config_models import MODEL_KEYS, ModelSpec, RolloutConfig
from pdserve.cluster.config_regions import PARALLEL_KEYS, ROLE_KEYS, RegionConfig, RoleSpec
from pdserve.cluster.config_router import AUTH_KEYS, ROUTER_KEYS, SERVER_KEYS, SLO_KEYS
from pdserve.core.config import (
    CacheConfig,
    DisaggregationConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdserve.router.config import RouterConfig, TlsConfig

ENTRY = re.compile(r"^(\w+(?:, \w+)*): (.*)$")


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its description, from the ``Attributes:`` block of ``cls``'s docstring."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    base = None
    for line in lines[start:]:
        indent = len(line) - len(line.lstrip())
        if not line.strip() or (base is not None and indent < base):
            break
        base = indent if base is None else base
        entry = ENTRY.match(line.strip()) if indent == base else None
        if entry:
            names = entry.group(1).split(", ")
            docs.update(dict.fromkeys(names, entry.group(2)))
        else:
            docs.update({name: f"{docs[name]} {line.strip()}" for name in names})
    return docs


@dataclass(frozen=True)
class Key:
    """One YAML key of a section, and the dataclass field it is read into.

    ``scale``: the YAML value is the field's times this (milliseconds for a field
    in seconds). ``default`` and ``kind`` say what the YAML reader does where it
    is not the field's own default or type (None: the field's)."""

    name: str
    owner: type
    field: str
    scale: float = 1.0
    default: str | None = None
    kind: str | None = None

    @property
    def doc(self) -> str:
        return attribute_docs(self.owner).get(self.field, "")

    @property
    def type_text(self) -> str:
        if self.kind is not None:
            return self.kind
        return yaml_type(str(self._field.type)) + (", ms" if self.scale == 1000 else "")

    @property
    def default_text(self) -> str:
        if self.default is not None:
            return self.default
        f = self._field
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            return "required"
        if isinstance(value, int | float) and not isinstance(value, bool) and self.scale != 1:
            value = value * self.scale
        return f"`{yaml_value(value)}`"

    @property
    def _field(self) -> dataclasses.Field[Any]:
        return next(f for f in dataclasses.fields(self.owner) if f.name == self.field)


@dataclass(frozen=True)
class Section:
    """A section of the YAML file (``router``, ``regions[].prefill``) and its keys."""

    path: str
    summary: str
    keys: tuple[Key, ...]


def yaml_type(annotation: str) -> str:
    """A field's annotation as the YAML writes its value (tuples are lists)."""
    text = re.sub(r"tuple\[(.+), \.\.\.\]", r"list[\1]", annotation)
    return text.replace("dict[str, Any]", "mapping").replace("dict[", "mapping[")


def yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple | list):
        return "[]" if not value else str(list(value))
    return str(value)


def keys_of(owner: type, skip: tuple[str, ...] = (), **overrides: Key) -> tuple[Key, ...]:
    """A key per field of ``owner``, named as the field, or as ``overrides`` names it."""
    fields = [f.name for f in dataclasses.fields(owner) if f.name not in skip]
    return tuple(overrides.get(name, Key(name, owner, name)) for name in fields)


def engine_sections() -> list[Section]:
    """The ``engine`` section: EngineConfig's own options and its groups', by flat name."""
    groups = tuple(f.name for f in dataclasses.fields(EngineConfig) if _is_group(f))
    own = keys_of(
        EngineConfig,
        skip=("model", *groups),
        lora_adapters=Key(
            "lora_adapters", EngineConfig, "lora_adapters", default="`{}`", kind="mapping[str, str]"
        ),
    )
    flat = {field: name for name, field in SpeculativeConfig.flat_names().items()}
    speculative = tuple(Key(flat[f], SpeculativeConfig, f) for f in flat)
    layout = "An instance's ranks; the four sizes a role may name go over these."
    return [
        Section(
            "engine", "Engine options of every instance; a role's `engine` goes over them.", own
        ),
        Section("engine: KV cache", "The paged KV cache and its tiers.", keys_of(CacheConfig)),
        Section(
            "engine: scheduler", "Continuous batching, chunked prefill.", keys_of(SchedulerConfig)
        ),
        Section("engine: parallel layout", layout, keys_of(ParallelConfig)),
        Section(
            "engine: speculative decoding", "Off unless `speculative_method` is set.", speculative
        ),
    ]


def _is_group(f: dataclasses.Field[Any]) -> bool:
    """An EngineConfig field that is a group of options (cache, scheduler, ...)."""
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
        f.default_factory()
    )


def region_sections() -> list[Section]:
    """``regions[]`` and each role's pool in it; ``models[]``, whose regions are alike."""
    pools = "mapping: see `regions[].prefill, decode`"
    region = keys_of(
        RegionConfig,
        prefill=Key("prefill", RegionConfig, "prefill", default="`{}`", kind=pools),
        decode=Key("decode", RegionConfig, "decode", default="`{}`", kind=pools),
    )
    role = keys_of(
        RoleSpec,
        skip=("parallel",),
        min=Key("min", RoleSpec, "min", default="`count`"),
        max=Key("max", RoleSpec, "max", default="`max(count, 4)`"),
    )
    layout = tuple(
        Key(f.name, ParallelConfig, f.name, default="the `engine` section's")
        for f in dataclasses.fields(ParallelConfig)
        if f.name in PARALLEL_KEYS
    )
    model = keys_of(
        ModelSpec,
        version=Key("version", ModelSpec, "version", default="the registry version, else `v1`"),
        engine=Key("engine", ModelSpec, "engine", default="`{}`"),
        regions=Key("regions", ModelSpec, "regions", kind="list: as `regions[]`"),
    )
    served = "A list: the models served beside `model`, each with its own pools."
    return [
        Section("regions[]", "A list: each region and its pools (at least one).", region),
        Section("regions[].prefill, decode", "Each role's pool in a region.", role + layout),
        Section("models[]", served, model),
    ]


def router_sections() -> list[Section]:
    """``slo``, ``server``, ``auth`` and ``router``: read into the RouterConfig."""
    slo = (
        Key("ttft_ms", RouterConfig, "ttft_slo_s", scale=1000),
        Key("tpot_ms", RouterConfig, "tpot_slo_s", scale=1000),
    )
    server = (
        *(Key(name, RouterConfig, name) for name in ("host", "grpc_port", "http_port")),
        Key("metrics_port", ClusterConfig, "metrics_port"),
        Key(
            "tls",
            RouterConfig,
            "tls",
            default="`null` (plain TCP)",
            kind="mapping: see `server.tls`",
        ),
    )
    auth = (
        Key("api_keys", RouterConfig, "api_keys", kind="list: keys, or `auth.api_keys[]` entries"),
        Key("disabled", RouterConfig, "auth_disabled"),
    )
    key_entry = (
        Key("key", RouterConfig, "api_keys", default="required", kind="str"),
        Key("priority", RouterConfig, "api_key_priorities", default="none", kind="int"),
        Key("admin", RouterConfig, "api_key_admins", default="`false`", kind="bool"),
        Key("tenant", RouterConfig, "api_key_tenants", default="the key's own", kind="str"),
    )
    return [
        Section("slo", "The service-level objectives, in milliseconds.", slo),
        Section("server", "Where the front doors listen.", server),
        Section("server.tls", "TLS for both front doors.", keys_of(TlsConfig)),
        Section("auth", "Who may send requests.", auth),
        Section("auth.api_keys[]", "An entry of `api_keys` written as a mapping.", key_entry),
        Section("router", "Placement, admission, retries, the Batch API.", router_keys()),
    ]


def router_keys() -> tuple[Key, ...]:
    """The ``router`` section's keys, as the reader types them (``hedge_after_ms``: ms)."""
    off = "`null` (off)"
    hedge = Key(
        "hedge_after_ms", RouterConfig, "hedge_after_s", scale=1000, default=off, kind="float, ms"
    )
    return tuple(
        hedge if name == "hedge_after_ms" else Key(name, RouterConfig, name, kind=kind.__name__)
        for name, kind in ROUTER_KEYS.items()
    )


def top_section() -> Section:
    name = Key("name", RouterConfig, "model_name", default="the `model` string")
    version = Key(
        "version", RouterConfig, "model_version", default="the registry version, else `v1`"
    )
    model, connector = (Key(k, ClusterConfig, k) for k in ("model", "connector"))
    summary = "The model, how clients name it, and the KV connector."
    return Section("top level", summary, (model, name, version, connector))


def sections() -> list[Section]:
    """Every section of the cluster YAML, in the order of the page."""
    ray = (Key("num_cpus", ClusterConfig, "ray_num_cpus"),)
    return [
        top_section(),
        *engine_sections(),
        *region_sections(),
        Section(
            "rollout", "How a canary is judged, and a version retired.", keys_of(RolloutConfig)
        ),
        *router_sections(),
        Section("planner", "How the planner sizes each region's pools.", keys_of(PlannerConfig)),
        Section("health", "How the controller watches instances.", keys_of(HealthConfig)),
        Section(
            "disaggregation",
            "When a decode instance prefills a request itself.",
            keys_of(DisaggregationConfig),
        ),
        Section("ray", "The embedded Ray instance.", ray),
    ]


HEADER = """\
# Configuration reference

<!-- Generated by `make config-docs` (python -m pdserve.deploy.config_docs) from the
docstrings of the config dataclasses: edit those, then run it again. -->

One YAML file describes a cluster: `pdserve serve --config FILE` (example:
[`deploy/configs/local.yaml`](../deploy/configs/local.yaml); how the parts fit:
[serving.md](serving.md)). It is checked when it loads, and an error names the
field and its line (`cluster.yaml:7: regions[0].prefill.count: must be >= 0`).
An unknown key is refused, naming the known ones. Each entry below gives the
key, its type, its default and what it does.
"""


def render() -> str:
    """The whole page."""
    parts = [HEADER]
    listed = sections()
    parts.append(
        "Sections: " + ", ".join(f"[`{s.path}`](#{anchor(s.path)})" for s in listed) + ".\n"
    )
    for section in listed:
        parts.append(f"## `{section.path}`\n\n{section.summary}\n")
        parts.append("\n".join(entry(key) for key in section.keys) + "\n")
    return "\n".join(parts)


def entry(key: Key) -> str:
    default = key.default_text
    default = default if default == "required" else f"default {default}"
    return f"- **`{key.name}`** ({key.type_text}, {default}): {key.doc}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading ``## `heading```."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def undocumented() -> Iterator[str]:
    """``section.key`` of every key whose field has no description."""
    for section in sections():
        for key in section.keys:
            if not key.doc:
                yield f"{section.path}.{key.name} ({key.owner.__name__}.{key.field})"


def keys_read() -> dict[str, set[str]]:
    """Section -> the keys the YAML reader takes there (for the reference's completeness)."""
    return {
        "router": set(ROUTER_KEYS),
        "server": SERVER_KEYS,
        "auth": AUTH_KEYS,
        "slo": SLO_KEYS,
        "regions[].prefill, decode": ROLE_KEYS | PARALLEL_KEYS,
        "models[]": MODEL_KEYS,
    }


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
