"""The cluster config's router part: the ``slo``, ``server``, ``auth`` and ``router`` sections."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from pdserve.cluster.config_models import default_version
from pdserve.cluster.config_yaml import Lines, api_key_entries, get_map, typed, typed_fields
from pdserve.core.adapters import adapter_pairs
from pdserve.core.errors import InvalidArgumentError
from pdserve.router.config import RegionSpec, RouterConfig, TlsConfig

# The ``router`` section: its keys and their types (hedge_after_ms becomes hedge_after_s).
ROUTER_KEYS: dict[str, type] = {
    "policy": str,
    "max_inflight_per_region": int,
    "adaptive_admission": bool,
    "low_priority_share": float,
    "low_priority_degrade_at": float,
    "low_priority_max_tokens": int,
    "retry_budget_ratio": float,
    "hedge_after_ms": float,
    "max_migrations": int,
    "migration_wait_s": float,
    "reservation_ttl_s": float,
    "without_prefill": str,
    "stream_idle_timeout_s": float,
    "max_body_bytes": int,
    "on_transfer_failure": str,
    "peer_prefill": bool,
    "peer_prefill_min_tokens": int,
    "peer_kv_s_per_token": float,
    "cold_start_queue": int,
    "cold_start_timeout_s": float,
    "batch_dir": str,
    "batch_quota_mb": int,
    "batch_max_file_lines": int,
    "batch_max_file_mb": int,
    "batch_max_line_kb": int,
    "batch_max_files": int,
    "batch_max_running": int,
    "max_restarts": int,
}
SERVER_KEYS = {"host", "grpc_port", "http_port", "metrics_port", "tls"}
AUTH_KEYS = {"api_keys", "disabled"}
SLO_KEYS = {"ttft_ms", "tpot_ms"}


def _refuse_unknown_keys(
    sections: Iterable[tuple[str, dict[str, Any], Collection[str]]], lines: Lines
) -> None:
    """Each section's keys are ones it knows."""
    for section, values, known in sections:
        for key in values:
            if key not in known:
                raise lines.error(f"{section}.{key}", f"unknown field (known: {sorted(known)})")


def _router_options(raw: dict[str, Any], extra: dict[str, Any], lines: Lines) -> dict[str, Any]:
    """The ``router`` section's fields, typed, and the names of the engine's LoRA adapters."""
    options = {
        key: typed(value, ROUTER_KEYS[key], f"router.{key}", lines) for key, value in extra.items()
    }
    adapters = get_map(raw, "engine", lines).get("lora_adapters")
    try:
        options["lora_adapters"] = tuple(n for n, _ in adapter_pairs(adapters or ()))
    except InvalidArgumentError as e:
        raise lines.error("engine.lora_adapters", e.message) from None
    return options


def router_config(
    raw: dict[str, Any], regions: Sequence[tuple[str, dict[str, float]]], lines: Lines
) -> RouterConfig:
    """The router's config from the ``slo``, ``server``, ``auth`` and ``router`` sections."""
    slo, server, auth = (get_map(raw, k, lines) for k in ("slo", "server", "auth"))
    extra = get_map(raw, "router", lines)
    sections = (
        ("router", extra, ROUTER_KEYS),
        ("server", server, SERVER_KEYS),
        ("auth", auth, AUTH_KEYS),
        ("slo", slo, SLO_KEYS),
    )
    _refuse_unknown_keys(sections, lines)
    tls, keys = get_map(server, "tls", lines, "server"), api_key_entries(auth, lines)
    options = _router_options(raw, extra, lines)
    hedge_ms = options.pop("hedge_after_ms", None)
    try:
        return RouterConfig(
            model_name=str(raw.get("name", raw["model"])),
            model_version=str(raw.get("version", default_version(raw["model"]))),
            regions=tuple(
                RegionSpec(name, {k: v / 1000 for k, v in latency_ms.items()})
                for name, latency_ms in regions
            ),
            api_keys=tuple(key for key, *_ in keys),
            api_key_priorities=tuple((k, p) for k, p, *_ in keys if p is not None),
            api_key_admins=tuple(k for k, _, admin, _ in keys if admin),
            api_key_tenants=tuple((k, t) for k, *_, t in keys if t is not None),
            # typed: bool("false") is True, and a quoted "false" turned auth off
            auth_disabled=typed(auth.get("disabled", False), bool, "auth.disabled", lines),
            ttft_slo_s=typed(slo.get("ttft_ms", 2000), float, "slo.ttft_ms", lines) / 1000,
            tpot_slo_s=typed(slo.get("tpot_ms", 200), float, "slo.tpot_ms", lines) / 1000,
            host=typed(server.get("host", "127.0.0.1"), str, "server.host", lines),
            grpc_port=typed(server.get("grpc_port", 0), int, "server.grpc_port", lines),
            http_port=typed(server.get("http_port", 0), int, "server.http_port", lines),
            hedge_after_s=None if hedge_ms is None else float(hedge_ms) / 1000,
            tls=TlsConfig(**typed_fields(tls, TlsConfig, "server.tls", lines)) if tls else None,
            **options,
        )
    except InvalidArgumentError as e:
        field = e.field if "." in e.field else f"router.{e.field}"
        raise lines.error(field, e.message) from None
    except TypeError as e:  # a missing TLS file name
        raise lines.error("server.tls", f"needs cert and key ({e})") from None
