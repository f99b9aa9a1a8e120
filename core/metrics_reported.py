"""The catalog's metrics that instances and the controller report (:mod:`pdserve.core.metrics`).

The controller forwards them in a :class:`~pdserve.core.snapshot.ClusterSnapshot`
and the router renders them at scrape time.
"""

from __future__ import annotations

from pdserve.core.metric_spec import INSTANCE_LABELS, MetricSpec

REPORTED: tuple[MetricSpec, ...] = (
    # -- reported by instances through the controller ---------------------------------------------
    MetricSpec(
        "pdserve_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in an instance's prefix cache.",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in an instance's prefix cache.",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_prefix_cache_hit_ratio",
        "gauge",
        "Hits over queries of an instance's prefix cache since it started.",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_bytes_total",
        "counter",
        "KV bytes moved, per connector and direction (sent, received).",
        (*INSTANCE_LABELS, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_seconds_total",
        "counter",
        "Seconds spent moving KV bytes, per connector and direction.",
        (*INSTANCE_LABELS, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_messages_total",
        "counter",
        "KV transfer messages, per connector and direction.",
        (*INSTANCE_LABELS, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_transfer_failures_total",
        "counter",
        "KV transfer messages that failed, per connector and direction.",
        (*INSTANCE_LABELS, "connector", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_leases_total",
        "counter",
        "Page reservations (decode) and holds (prefill) by how they ended: reserved, "
        "committed, expired, aborted, peer_lost, refused; peer_filled: prompts whose "
        "prefix came from a peer's cache; exported: prefixes sent to a peer.",
        (*INSTANCE_LABELS, "outcome"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_moe_expert_tokens_total",
        "counter",
        "Tokens routed to each expert of each MoE layer of an instance (all its ranks).",
        (*INSTANCE_LABELS, "layer", "expert"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_moe_imbalance_ratio",
        "gauge",
        "Max over mean tokens per expert (over=expert) or per EP rank (over=rank) of an MoE "
        "layer, over the tokens routed since the previous read.",
        (*INSTANCE_LABELS, "layer", "over"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_ep_rank_failures_total",
        "counter",
        "Expert-parallel ranks an elastic MoE instance lost and went on serving without.",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_ep_ranks",
        "gauge",
        "Expert-parallel ranks an MoE instance serves on now (fewer after an elastic recovery).",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_hits_total",
        "counter",
        "Prefix blocks found below the device pool (tier: host, disk) and loaded back.",
        (*INSTANCE_LABELS, "tier"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_misses_total",
        "counter",
        "Prefix lookups below the device pool that found nothing (the rest is recomputed).",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_failed_loads_total",
        "counter",
        "Tier blocks that did not come back intact (missing or failing their checksum).",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_blocks",
        "gauge",
        "Prefix blocks a tier of an instance holds now.",
        (*INSTANCE_LABELS, "tier"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_bytes_total",
        "counter",
        "KV bytes moved by an instance's leader rank to (in) and from (out) a tier.",
        (*INSTANCE_LABELS, "tier", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_kv_tier_seconds_total",
        "counter",
        "Seconds the leader rank spent moving KV bytes to (in) and from (out) a tier.",
        (*INSTANCE_LABELS, "tier", "direction"),
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_draft_tokens_total",
        "counter",
        "Draft tokens an instance proposed and verified (speculative decoding).",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_accepted_tokens_total",
        "counter",
        "Draft tokens the target model accepted (each saves one decode step).",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_verify_steps_total",
        "counter",
        "Rows that verified drafts (one per decoding request and step with drafts).",
        INSTANCE_LABELS,
        source="instance",
    ),
    MetricSpec(
        "pdserve_spec_skipped_batches_total",
        "counter",
        "Steps that drafted nothing because more requests decoded than speculative_max_batch.",
        INSTANCE_LABELS,
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
