"""What the controller reports to the router, and how it is rendered at scrape time.

The controller reads each instance's counters (:class:`InstanceCounters`) and
its own state into a :class:`ClusterSnapshot` every health round; the router's
:class:`SnapshotCollector` renders the latest one as the ``source="instance"``
and ``source="controller"`` metrics of :data:`~pdserve.core.metrics.CATALOG`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.core.metrics import CATALOG


@dataclass
class InstanceCounters:
    """One instance's cumulative counters, as its leader reads them."""

    instance_id: str
    region: str
    role: str
    prefix_queries: int = 0
    prefix_hits: int = 0
    # connector name, direction ("sent"/"received") -> TransferStats.as_dict()
    transfers: list[dict[str, Any]] = field(default_factory=list)
    leases: dict[str, int] = field(default_factory=dict)
    kv_tiers: KVTierCounters | None = None
    expert_load: ExpertLoad | None = None
    speculation: SpeculationCounters | None = None
    node_id: str = ""  # the Ray node its leader runs on
    node_ip: str = ""


@dataclass
class ExpertLoad:
    """One MoE instance's expert load (see ``pdserve.cluster.expert_load``)."""

    tokens: dict[int, list[int]]  # layer -> tokens routed to each expert since start
    by_expert: dict[int, float]  # layer -> max over mean per expert, recent tokens
    by_rank: dict[int, float]  # layer -> max over mean per EP rank, recent tokens
    ep_rank_failures: int = 0  # EP ranks lost and recovered from
    ep_ranks: int = 0  # EP ranks serving now (0: not known)


@dataclass
class SpeculationCounters:
    """One instance's speculative decoding since start (None where it is off)."""

    proposed: int  # draft tokens verified
    accepted: int
    verify_steps: int  # rows that verified drafts
    skipped_batches: int  # steps too large to draft


@dataclass
class KVTierCounters:
    """One instance's KV tiers: lookups (engine) and bytes moved (leader rank)."""

    hits: dict[str, int]  # tier -> blocks loaded back
    misses: int
    failed_loads: int
    blocks: dict[str, int]  # tier -> blocks held now
    # (tier, direction) -> bytes / seconds; direction "in" (written down) or "out" (loaded)
    bytes: dict[tuple[str, str], int]
    seconds: dict[tuple[str, str], float]


@dataclass
class ScaleEvent:
    """A scaling decision: the planner's (applied or advisory) or an operator's."""

    at: float  # time.time()
    region: str
    action: str  # add_prefill, remove_decode, flip_to_prefill, set, hold, ...
    reason: str
    source: str  # planner, planner-advisory, operator, health
    prefill: int  # the region's target counts after the decision
    decode: int


@dataclass
class RegionState:
    region: str
    target_prefill: int
    target_decode: int
    serving: dict[str, int]  # role -> instances serving
    draining: dict[str, int]  # role -> instances draining
    restarts: dict[str, int] = field(default_factory=dict)
    # role -> seconds per start-up phase (schedule, spawn, load, warmup) of its latest start
    start_phases: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class ClusterSnapshot:
    """What the controller sends the router every health round."""

    at: float
    regions: list[RegionState]
    instances: list[InstanceCounters]
    # Cumulative per (region, action, reason); the newest events for the dashboard.
    decisions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    events: list[ScaleEvent] = field(default_factory=list)


class SnapshotCollector(Collector):
    """Renders the latest :class:`ClusterSnapshot` at scrape time."""

    def __init__(self) -> None:
        self.snapshot: ClusterSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        fams = {
            s.name: (
                CounterMetricFamily(s.name.removesuffix("_total"), s.help, labels=s.labels)
                if s.kind == "counter"
                else GaugeMetricFamily(s.name, s.help, labels=s.labels)
            )
            for s in CATALOG
            if s.source != "router"
        }
        for r in snap.regions:
            _add_region(fams, r)
        for (region, action, reason), n in snap.decisions.items():
            fams["pdserve_planner_decisions_total"].add_metric([region, action, reason], n)
        for i in snap.instances:
            who = [i.region, i.role, i.instance_id]
            fams["pdserve_prefix_cache_queries_total"].add_metric(who, i.prefix_queries)
            fams["pdserve_prefix_cache_hits_total"].add_metric(who, i.prefix_hits)
            fams["pdserve_prefix_cache_hit_ratio"].add_metric(
                who, i.prefix_hits / i.prefix_queries if i.prefix_queries else 0.0
            )
            for t in i.transfers:
                labels = [*who, str(t["connector"]), str(t["direction"])]
                fams["pdserve_transfer_bytes_total"].add_metric(labels, t["bytes"])
                fams["pdserve_transfer_seconds_total"].add_metric(labels, t["seconds"])
                fams["pdserve_transfer_messages_total"].add_metric(labels, t["messages"])
                fams["pdserve_transfer_failures_total"].add_metric(labels, t["failures"])
            for outcome, n in i.leases.items():
                fams["pdserve_leases_total"].add_metric([*who, outcome], n)
            if i.kv_tiers is not None:
                _add_tiers(fams, who, i.kv_tiers)
            if i.expert_load is not None:
                _add_experts(fams, who, i.expert_load)
            if (s := i.speculation) is not None:
                fams["pdserve_spec_draft_tokens_total"].add_metric(who, s.proposed)
                fams["pdserve_spec_accepted_tokens_total"].add_metric(who, s.accepted)
                fams["pdserve_spec_verify_steps_total"].add_metric(who, s.verify_steps)
                fams["pdserve_spec_skipped_batches_total"].add_metric(who, s.skipped_batches)
        yield from fams.values()


def _add_tiers(
    fams: dict[str, CounterMetricFamily | GaugeMetricFamily], who: list[str], t: KVTierCounters
) -> None:
    for tier, n in t.hits.items():
        fams["pdserve_kv_tier_hits_total"].add_metric([*who, tier], n)
    for tier, n in t.blocks.items():
        fams["pdserve_kv_tier_blocks"].add_metric([*who, tier], n)
    fams["pdserve_kv_tier_misses_total"].add_metric(who, t.misses)
    fams["pdserve_kv_tier_failed_loads_total"].add_metric(who, t.failed_loads)
    for (tier, direction), n in t.bytes.items():
        fams["pdserve_kv_tier_bytes_total"].add_metric([*who, tier, direction], n)
        seconds = t.seconds.get((tier, direction), 0.0)
        fams["pdserve_kv_tier_seconds_total"].add_metric([*who, tier, direction], seconds)


def _add_region(fams: dict[str, CounterMetricFamily | GaugeMetricFamily], r: RegionState) -> None:
    """Adds one region's instance counts, targets and P/D ratios to the families."""
    for role in ("prefill", "decode"):
        fams["pdserve_instances"].add_metric([r.region, role, "serving"], r.serving.get(role, 0))
        fams["pdserve_instances"].add_metric([r.region, role, "draining"], r.draining.get(role, 0))
        fams["pdserve_instance_restarts_total"].add_metric(
            [r.region, role], r.restarts.get(role, 0)
        )
    for role, phases in r.start_phases.items():
        for phase, seconds in phases.items():
            fams["pdserve_instance_start_seconds"].add_metric([r.region, role, phase], seconds)
    fams["pdserve_instances_target"].add_metric([r.region, "prefill"], r.target_prefill)
    fams["pdserve_instances_target"].add_metric([r.region, "decode"], r.target_decode)
    fams["pdserve_pd_ratio"].add_metric(
        [r.region, "target"], r.target_prefill / max(r.target_decode, 1)
    )
    fams["pdserve_pd_ratio"].add_metric(
        [r.region, "actual"],
        r.serving.get("prefill", 0) / max(r.serving.get("decode", 0), 1),
    )


def _add_experts(
    fams: dict[str, CounterMetricFamily | GaugeMetricFamily], who: list[str], load: ExpertLoad
) -> None:
    for layer, tokens in load.tokens.items():
        for expert, n in enumerate(tokens):
            fams["pdserve_moe_expert_tokens_total"].add_metric([*who, str(layer), str(expert)], n)
    for over, values in (("expert", load.by_expert), ("rank", load.by_rank)):
        for layer, ratio in values.items():
            fams["pdserve_moe_imbalance_ratio"].add_metric([*who, str(layer), over], ratio)
    fams["pdserve_ep_rank_failures_total"].add_metric(who, load.ep_rank_failures)
    if load.ep_ranks:
        fams["pdserve_ep_ranks"].add_metric(who, load.ep_ranks)
