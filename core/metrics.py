"""The metrics catalog: every metric pdserve exports, in one place.

Names follow Prometheus conventions: the ``pdserve_`` prefix, base units
(seconds, bytes, ratios in [0, 1]), ``_total`` on counters. Labels are the
ones that mean something for the metric: ``region``, ``role``
(prefill/decode), ``instance``.

Where each one is measured:

- the router (the front doors' process) measures what a client sees: request
  outcomes, TTFT, inter-token and end-to-end latency, rejections and
  migrations. TTFT is taken there, so the KV transfer counts in it;
- instances report their load to the router (queue lengths, batch, KV usage,
  every :class:`~pdserve.core.messages.LoadReport`) and their counters
  (prefix cache, transfers, leases) to the controller, which forwards them
  with its own state (instances per region and role, the P:D target, planner
  decisions) in a :class:`ClusterSnapshot`;
- the router serves all of it on one ``/metrics`` endpoint.

:func:`Metrics` builds the ``prometheus_client`` objects of the router-side
metrics from :data:`CATALOG`; :class:`SnapshotCollector` renders the reported
ones at scrape time. ``deploy/grafana/pdserve.json`` queries only names listed
here (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

Kind = Literal["counter", "gauge", "histogram"]

# Latency buckets (seconds): 1 ms .. 60 s, denser where SLOs usually sit.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip

PHASES = ("prefill_queue", "prefill", "transfer", "decode_queue", "decode")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    source: Literal["router", "instance", "controller"] = "router"


_INSTANCE = ("region", "role", "instance")

CATALOG: tuple[MetricSpec, ...] = (
    # -- measured at the router -------------------------------------------------------------------
    MetricSpec(
        "pdserve_requests_total",
        "counter",
        "Requests by final status (stop, length, cancelled, or an error code).",
        ("region", "status"),
    ),
    MetricSpec(
        "pdserve_model_requests_total",
        "counter",
        "Finished requests by the model version that served them (ok or failed).",
        ("model", "version", "outcome"),
    ),
    MetricSpec(
        "pdserve_lora_replay_failures_total", "counter", "Runtime LoRA loads new instances failed."
    ),
    MetricSpec(
        "pdserve_model_traffic_share",
        "gauge",
        "Each served model version's share of its model's new requests (rollouts).",
        ("model", "version"),
    ),
    MetricSpec(
        "pdserve_time_to_first_token_seconds",
        "histogram",
        "Time from the router receiving a request to its first token (transfer included).",
        ("region",),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "pdserve_inter_token_latency_seconds",
        "histogram",
        "Time between consecutive tokens of one stream, as the router sees them.",
        ("region",),
        TOKEN_BUCKETS,
    ),
    MetricSpec(
        "pdserve_time_per_output_token_seconds",
        "histogram",
        "A finished request's mean time per output token after the first (TPOT).",
        ("region",),
        TOKEN_BUCKETS,
    ),
    MetricSpec(
        "pdserve_e2e_request_latency_seconds",
        "histogram",
        "Time from receiving a request to its last token.",
        ("region",),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "pdserve_request_phase_seconds",
        "histogram",
        "Time a request spent in each phase: prefill_queue, prefill, transfer (the part of "
        "the KV transfer not hidden behind prefill), decode_queue, decode.",
        ("region", "phase"),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "pdserve_rejections_total",
        "counter",
        "Requests refused before they started, by reason (an error code).",
        ("reason",),
    ),
    MetricSpec(
        "pdserve_degraded_requests_total",
        "counter",
        "Requests of negative priority admitted under overload with a capped max_tokens.",
        ("region",),
    ),
    MetricSpec(
        "pdserve_migrations_total",
        "counter",
        "Requests moved to another pair after an instance was lost, by the phase it was in.",
        ("region", "phase"),
    ),
    MetricSpec(
        "pdserve_queue_length",
        "gauge",
        "Requests waiting for their first step at an instance.",
        _INSTANCE,
    ),
    MetricSpec(
        "pdserve_running_requests",
        "gauge",
        "Requests in an instance's running batch.",
        _INSTANCE,
    ),
    MetricSpec(
        "pdserve_kv_usage_ratio",
        "gauge",
        "Fraction of an instance's KV-cache pages in use.",
        _INSTANCE,
    ),
    # -- reported by instances through the controller ---------------------------------------------
    MetricSpec(
        "pdserve_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in an instance's prefix cache.",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in an instance's prefix cache.",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_prefix_cache_hit_ratio",
        "gauge",
        "Hits over queries of an instance's prefix cache since it started.",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_bytes_total",
        "counter",
        "KV bytes moved, per connector and direction (sent, received).",
        (*_INSTANCE, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_seconds_total",
        "counter",
        "Seconds spent moving KV bytes, per connector and direction.",
        (*_INSTANCE, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_messages_total",
        "counter",
        "KV transfer messages, per connector and direction.",
        (*_INSTANCE, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_failures_total",
        "counter",
        "KV transfer messages that failed, per connector and direction.",
        (*_INSTANCE, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_leases_total",
        "counter",
        "Page reservations (decode) and holds (prefill) by how they ended: reserved, "
        "committed, expired, aborted, peer_lost, refused; peer_filled: prompts whose "
        "prefix came from a peer's cache; exported: prefixes sent to a peer.",
        (*_INSTANCE, "outcome"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_moe_expert_tokens_total",
        "counter",
        "Tokens routed to each expert of each MoE layer of an instance (all its ranks).",
        (*_INSTANCE, "layer", "expert"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_moe_imbalance_ratio",
        "gauge",
        "Max over mean tokens per expert (over=expert) or per EP rank (over=rank) of an MoE "
        "layer, over the tokens routed since the previous read.",
        (*_INSTANCE, "layer", "over"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_ep_rank_failures_total",
        "counter",
        "Expert-parallel ranks an elastic MoE instance lost and went on serving without.",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_hits_total",
        "counter",
        "Prefix blocks found below the device pool (tier: host, disk) and loaded back.",
        (*_INSTANCE, "tier"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_misses_total",
        "counter",
        "Prefix lookups below the device pool that found nothing (the rest is recomputed).",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_failed_loads_total",
        "counter",
        "Tier blocks that did not come back intact (missing or failing their checksum).",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_blocks",
        "gauge",
        "Prefix blocks a tier of an instance holds now.",
        (*_INSTANCE, "tier"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_bytes_total",
        "counter",
        "KV bytes moved by an instance's leader rank to (in) and from (out) a tier.",
        (*_INSTANCE, "tier", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_seconds_total",
        "counter",
        "Seconds the leader rank spent moving KV bytes to (in) and from (out) a tier.",
        (*_INSTANCE, "tier", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_draft_tokens_total",
        "counter",
        "Draft tokens an instance proposed and verified (speculative decoding).",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_accepted_tokens_total",
        "counter",
        "Draft tokens the target model accepted (each saves one decode step).",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_verify_steps_total",
        "counter",
        "Rows that verified drafts (one per decoding request and step with drafts).",
        _INSTANCE,
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_skipped_batches_total",
        "counter",
        "Steps that drafted nothing because more requests decoded than speculative_max_batch.",
        _INSTANCE,
        source="instance",
    ),
    # -- the controller ---------------------------------------------------------------------------
    MetricSpec(
        "pdserve_instances",
        "gauge",
        "Instances per region and role, by state (serving, draining).",
        ("region", "role", "state"),
        source="controller",
    ),
    MetricSpec(
        "pdserve_instances_target",
        "gauge",
        "The number of instances the controller is converging to, per region and role.",
        ("region", "role"),
        source="controller",
    ),
    MetricSpec(
        "pdserve_pd_ratio",
        "gauge",
        "Prefill over decode instances per region: the target and the actual count.",
        ("region", "kind"),
        source="controller",
    ),
    MetricSpec(
        "pdserve_planner_decisions_total",
        "counter",
        "Planner and operator scaling decisions, by action and reason.",
        ("region", "action", "reason"),
        source="controller",
    ),
    MetricSpec(
        "pdserve_instance_restarts_total",
        "counter",
        "Instances replaced after they died, per region and role.",
        ("region", "role"),
        source="controller",
    ),
    MetricSpec(
        "pdserve_instance_start_seconds",
        "gauge",
        "Seconds the latest instance of a region and role took per start-up phase: schedule "
        "(resources reserved), spawn (rank processes up), load (weights), warmup (KV, engine).",
        ("region", "role", "phase"),
        source="controller",
    ),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}


def exported_names() -> set[str]:
    """Every series name a scrape can contain (histograms add _bucket, _sum, _count)."""
    names = set()
    for m in CATALOG:
        if m.kind == "histogram":
            names |= {f"{m.name}_bucket", f"{m.name}_sum", f"{m.name}_count"}
        else:
            names.add(m.name)
    return names


class Metrics:
    """The router-side metrics of :data:`CATALOG`, as ``prometheus_client`` objects."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # no *_created series: one name per catalog entry
        self.registry = registry or CollectorRegistry()
        self._objects: dict[str, Any] = {}
        for spec in CATALOG:
            if spec.source != "router":
                continue
            # prometheus_client adds _total itself and wants the base name.
            base = spec.name.removesuffix("_total")
            if spec.kind == "counter":
                obj: Any = Counter(base, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "gauge":
                obj = Gauge(spec.name, spec.help, spec.labels, registry=self.registry)
            else:
                obj = Histogram(
                    spec.name,
                    spec.help,
                    spec.labels,
                    buckets=spec.buckets or LATENCY_BUCKETS,
                    registry=self.registry,
                )
            self._objects[spec.name] = obj

    def __getitem__(self, name: str) -> Any:
        return self._objects[name]
