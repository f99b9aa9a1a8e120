"""Frozen configuration of the router and its front doors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.frontdoor.auth import check_keys


@dataclass(frozen=True)
class RegionSpec:
    """A region and its one-way latency to the others (seconds).

    On one machine the latency is emulated: the router waits that long before
    sending a request to another region's instances.
    """

    name: str
    latency_s: dict[str, float] = field(default_factory=dict)


WITHOUT_PREFILL = ("local", "spill", "refuse")


@dataclass(frozen=True)
class TlsConfig:
    """TLS for both front doors: PEM files of this server's certificate chain and key.

    With ``client_ca`` the doors require a client certificate signed by it (mTLS).

    Attributes:
    cert: PEM file of this server's certificate chain.
    key: PEM file of this server's private key.
    client_ca: PEM file of the CA that must have signed a client's certificate (None:
        no client certificate is asked for).
    """

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert", "key", "client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise InvalidArgumentError(f"server.tls.{name}", f"no such file: {path}")


@dataclass(frozen=True)
class RouterConfig:
    """Attributes:
    model_name: the model id clients name (``model`` in requests).
    model_version: the version of the cluster's model (a rollout names the next one).
    policy: "cost_model" (default), "least_loaded" or "round_robin".
    regions: the regions and their latencies; the first is the default home.
    api_keys: accepted API keys (more come from ``$PDSERVE_API_KEYS``).
    api_key_priorities: (key, priority) pairs: the priority of a request sent with
        that key when the request sets none.
    api_key_admins: keys that may also load and unload LoRA adapters at runtime
        (more come from ``$PDSERVE_ADMIN_API_KEYS``); other keys only send requests.
    api_key_tenants: (key, tenant name) pairs: keys naming the same tenant share
        their prefix cache; any other key is a tenant of its own, whose cached
        prompts no other key's requests hit (nor learn of through ``cached_tokens``).
    auth_disabled: serve without keys (local use only; must be said explicitly).
    ttft_slo_s: the service-level objective for the time to the first token.
    tpot_slo_s: the service-level objective for the time per output token.
    max_inflight_per_region: admission ceiling of requests in flight per region.
    adaptive_admission: lower the ceiling while observed TTFT misses its SLO.
    low_priority_share: share of the ceiling open to requests of negative priority
        (batch jobs), so online traffic keeps the rest.
    low_priority_degrade_at: from this fraction of their share on, requests of
        negative priority get at most ``low_priority_max_tokens`` tokens.
    low_priority_max_tokens: the most tokens such a request then gets.
    retry_budget_ratio: retries allowed per request admitted (a token bucket).
    hedge_after_s: start a second attempt when the first token is this late (None: off).
    max_migrations: times one request may move to another pair after an instance failed.
    migration_wait_s: how long a moving request waits for a free pair (instances restarting).
    reservation_ttl_s: how long a decode instance holds pages waiting for KV.
    host: the address both front doors listen on.
    grpc_port: the gRPC door's port (0: pick a free port).
    http_port: the HTTP door's port, which also serves ``/metrics`` and
        ``/dashboard`` (0: pick a free port).
    max_body_bytes: largest HTTP request body accepted.
    tls: serve both front doors over TLS (None: plain TCP, for local use).
    without_prefill: what a request does in a region with no prefill instance available:
        "local" (its decode instance prefills it), "spill" (another region with a
        prefill instance serves it; "local" if none has one) or "refuse" (429 at once).
    stream_idle_timeout_s: a stream that gets no token for this long fails (UNAVAILABLE),
        so no client waits forever on an instance that went silent.
    on_transfer_failure: a prompt whose KV did not reach its decode instance is
        prefilled again on another pair ("recompute") or fails (UNAVAILABLE, "fail").
    peer_prefill: when another prefill instance of the region holds more of a
        prompt on its device than the one chosen for load, let the decode instance
        take those pages from it (and prefill the rest itself, if that leaves
        little to compute) instead of recomputing them.
    peer_prefill_min_tokens: the least number of prompt tokens that must be saved.
    peer_kv_s_per_token: the assumed time to move one token's KV between two
        instances, priced against the chosen prefill's measured time per token.
    lora_adapters: names of the LoRA adapters the instances serve (the engine
        section's ``lora_adapters``): a request's ``model`` may name one.
    cold_start_queue: requests that may wait, per region, while the region has no
        instance to serve them (scaled to zero) and the controller starts one; more
        are refused at once (429 with Retry-After). 0: refuse at once, never wait.
    cold_start_timeout_s: how long such a request waits for an instance before it
        fails (503 with Retry-After).
    batch_dir: where ``POST /v1/files`` and ``/v1/batches`` keep files and batch
        records (default ``~/.cache/pdserve/batches``).
    batch_quota_mb: most MiB one API key's batch files (uploads and outputs) may hold.
    batch_max_file_lines: most request lines one uploaded batch file may have
        (OpenAI's limit: 50,000).
    batch_max_file_mb: most MiB one uploaded batch file may hold (OpenAI's: 200).
    batch_max_line_kb: most KiB one line of an uploaded batch file may hold.
    batch_max_files: most files (uploads and batch outputs) one API key may keep.
    batch_max_running: most batches one API key may have running at once.
    max_restarts: times Ray restarts the router actor after it dies (a restarted
        router listens again and resumes its batches; -1: always).
    """

    model_name: str = "pdserve"
    model_version: str = "v1"
    policy: str = "cost_model"
    regions: tuple[RegionSpec, ...] = (RegionSpec("local"),)
    api_keys: tuple[str, ...] = ()
    api_key_priorities: tuple[tuple[str, int], ...] = ()
    api_key_admins: tuple[str, ...] = ()
    api_key_tenants: tuple[tuple[str, str], ...] = ()
    auth_disabled: bool = False
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    max_inflight_per_region: int = 256
    adaptive_admission: bool = True
    low_priority_share: float = 0.5
    low_priority_degrade_at: float = 0.75
    low_priority_max_tokens: int = 64
    retry_budget_ratio: float = 0.1
    hedge_after_s: float | None = None
    max_migrations: int = 2
    migration_wait_s: float = 60.0
    reservation_ttl_s: float = 30.0
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int = 0
    max_body_bytes: int = 1 << 20
    tls: TlsConfig | None = None
    without_prefill: str = "local"
    stream_idle_timeout_s: float = 300.0
    on_transfer_failure: str = "recompute"
    peer_prefill: bool = True
    peer_prefill_min_tokens: int = 64
    peer_kv_s_per_token: float = 2e-5
    lora_adapters: tuple[str, ...] = ()
    cold_start_queue: int = 32
    cold_start_timeout_s: float = 60.0
    batch_dir: str | None = None
    batch_quota_mb: int = 4096
    batch_max_file_lines: int = 50_000
    batch_max_file_mb: int = 200
    batch_max_line_kb: int = 8192
    batch_max_files: int = 1000
    batch_max_running: int = 8
    max_restarts: int = 3

    def __post_init__(self) -> None:
        check_keys("auth.api_keys", self.api_keys)  # "" is what an unset variable becomes
        check_keys("auth.api_key_admins", self.api_key_admins)
        self._check_regions()
        if self.max_inflight_per_region < 1:
            raise InvalidArgumentError("max_inflight_per_region", "must be >= 1")
        if not 0 < self.low_priority_share <= 1:
            raise InvalidArgumentError("router.low_priority_share", "must be in (0, 1]")
        if not 0 <= self.low_priority_degrade_at <= 1:
            raise InvalidArgumentError("router.low_priority_degrade_at", "must be in [0, 1]")
        if self.low_priority_max_tokens < 1:
            raise InvalidArgumentError("router.low_priority_max_tokens", "must be >= 1")
        if not 0 <= self.retry_budget_ratio <= 1:
            raise InvalidArgumentError("retry_budget_ratio", "must be in [0, 1]")
        if self.without_prefill not in WITHOUT_PREFILL:
            raise InvalidArgumentError(
                "router.without_prefill", f"must be one of {WITHOUT_PREFILL}"
            )
        if self.on_transfer_failure not in ("recompute", "fail"):
            raise InvalidArgumentError(
                "router.on_transfer_failure", "must be 'recompute' or 'fail'"
            )
        if self.peer_prefill_min_tokens < 0 or self.peer_kv_s_per_token < 0:
            raise InvalidArgumentError("router.peer_prefill_min_tokens", "must be >= 0")
        if not 0 < self.stream_idle_timeout_s < math.inf:
            raise InvalidArgumentError("router.stream_idle_timeout_s", "must be > 0")
        if self.cold_start_queue < 0:
            raise InvalidArgumentError("router.cold_start_queue", "must be >= 0 (0: never wait)")
        if not 0 < self.cold_start_timeout_s < math.inf:
            raise InvalidArgumentError("router.cold_start_timeout_s", "must be > 0")
        if not (0 < self.ttft_slo_s < math.inf and 0 < self.tpot_slo_s < math.inf):
            raise InvalidArgumentError("slo", "SLOs must be > 0")
        if self.max_body_bytes < 1024:
            raise InvalidArgumentError("router.max_body_bytes", "must be >= 1024")
        if self.batch_quota_mb < 0:
            raise InvalidArgumentError("router.batch_quota_mb", "must be >= 0")
        for name in (
            "batch_max_file_lines",
            "batch_max_file_mb",
            "batch_max_line_kb",
            "batch_max_files",
            "batch_max_running",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"router.{name}", "must be >= 1")
        if self.max_restarts < -1:
            raise InvalidArgumentError("router.max_restarts", "must be >= -1 (-1: always)")

    def _check_regions(self) -> None:
        if not self.regions:
            raise InvalidArgumentError("regions", "at least one region is needed")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise InvalidArgumentError("regions", f"duplicate region names in {names}")
        for r in self.regions:
            for other, latency in r.latency_s.items():
                if other not in names:
                    raise InvalidArgumentError(
                        f"regions.{r.name}.latency", f"unknown region {other!r}"
                    )
                if latency < 0:
                    raise InvalidArgumentError(f"regions.{r.name}.latency", "must be >= 0")

    @property
    def home_region(self) -> str:
        return self.regions[0].name

    def latency(self, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        for r in self.regions:
            if r.name == src:
                return r.latency_s.get(dst, 0.0)
        return 0.0
