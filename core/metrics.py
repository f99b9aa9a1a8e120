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

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from pdserve.core.metric_spec import (
    INSTANCE_LABELS,
    LATENCY_BUCKETS,
    PHASES,
    TOKEN_BUCKETS,
    MetricSpec,
)
from pdserve.core.metrics_reported import REPORTED

__all__ = ["BY_NAME", "CATALOG", "PHASES", "MetricSpec", "Metrics", "exported_names"]

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
        INSTANCE_LABELS,
    ),
    MetricSpec(
        "pdserve_running_requests",
        "gauge",
        "Requests in an instance's running batch.",
        INSTANCE_LABELS,
    ),
    MetricSpec(
        "pdserve_kv_usage_ratio",
        "gauge",
        "Fraction of an instance's KV-cache pages in use.",
        INSTANCE_LABELS,
    ),
    *REPORTED,
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
