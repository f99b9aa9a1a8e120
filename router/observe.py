"""What the router measures and serves: the ``/metrics`` exposition and the
dashboard's time series.

The router is where a client's view of a request exists (TTFT includes the KV
transfer there), where every instance's load report arrives, and where the
controller sends its :class:`~pdserve.core.metrics.ClusterSnapshot`; so the
cluster's one scrape target and its dashboard live here.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.core.messages import LoadReport
from pdserve.core.metrics import PHASES, Metrics
from pdserve.core.snapshot import ClusterSnapshot, SnapshotCollector

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig
    from pdserve.router.state import ClusterView
    from pdserve.router.stream import RequestStream


class ObservedRouter(Protocol):
    """What the observer reads of its router: the config (regions, SLOs), the cluster's
    instances and tables, and the requests in flight per region."""

    @property
    def config(self) -> RouterConfig: ...
    @property
    def cluster(self) -> ClusterView: ...
    @property
    def region_inflight(self) -> dict[str, int]: ...


HISTORY = 900  # dashboard samples kept (one a second: 15 minutes)
WINDOW_S = 30.0  # latency percentiles on the dashboard are over this window
OTHER = "other"  # the label of anything the config does not name


class Observer:
    """Label values come from the config and the cluster, never from a request:
    a region the config does not name is counted as ``other``."""

    def __init__(self, regions: list[str]) -> None:
        self.regions = frozenset(regions)
        self.metrics = Metrics()
        self.cluster = SnapshotCollector()
        self.metrics.registry.register(self.cluster)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        # Finished requests per region: (time.monotonic(), TTFT, TPOT or None, tokens out).
        self.completed: dict[str, deque[tuple[float, float, float | None, int]]] = defaultdict(
            lambda: deque(maxlen=4096)
        )
        # Requests per home region as they arrive: (time.monotonic(), prompt tokens).
        self.arrivals: dict[str, deque[tuple[float, int]]] = defaultdict(lambda: deque(maxlen=8192))
        # The same two per (region, deployment key): what each model's planner reads.
        self.model_completed: dict[tuple[str, str], deque[tuple[float, float, float | None, int]]]
        self.model_completed = defaultdict(lambda: deque(maxlen=4096))
        self.model_arrivals: dict[tuple[str, str], deque[tuple[float, int]]] = defaultdict(
            lambda: deque(maxlen=8192)
        )
        # (region, counter) -> (time, value) at the last sample, for rates.
        self._last: dict[tuple[str, str], tuple[float, float]] = {}

    # -- requests --------------------------------------------------------------------------------

    def _region(self, region: str) -> str:
        return region if region in self.regions else OTHER

    def arrived(self, region: str, prompt_len: int, model: str = "") -> None:
        at = (time.monotonic(), prompt_len)
        self.arrivals[self._region(region)].append(at)
        self.model_arrivals[(self._region(region), model)].append(at)

    def model_finished(
        self, region: str, model: str, ttft: float | None, tpot: float | None, tokens: int
    ) -> None:
        """A request of deployment ``model`` served in ``region`` ended well (its planner)."""
        if ttft is not None:
            record = (time.monotonic(), ttft, tpot, tokens)
            self.model_completed[(self._region(region), model)].append(record)

    def finished(self, region: str, status: str, stream: RequestStream | None) -> None:
        region = self._region(region)
        self.metrics["pdserve_requests_total"].labels(region, status).inc()
        if stream is None or stream.first_token_at is None:
            return
        m = self.metrics
        m["pdserve_time_to_first_token_seconds"].labels(region).observe(
            stream.first_token_at - stream.arrival
        )
        if stream.last_token_at is not None:
            m["pdserve_e2e_request_latency_seconds"].labels(region).observe(
                stream.last_token_at - stream.arrival
            )
        itl = m["pdserve_inter_token_latency_seconds"].labels(region)
        for gap in np.diff(stream.token_times):
            itl.observe(float(gap))
        n, tpot = len(stream.token_times), None
        if n > 1:
            tpot = (stream.token_times[-1] - stream.token_times[0]) / (n - 1)
            m["pdserve_time_per_output_token_seconds"].labels(region).observe(tpot)
        ttft = stream.first_token_at - stream.arrival
        self.completed[region].append((time.monotonic(), ttft, tpot, n))

    def phases(self, region: str, phases: dict[str, float]) -> None:
        region = self._region(region)
        hist = self.metrics["pdserve_request_phase_seconds"]
        for phase, seconds in phases.items():
            if phase in PHASES:
                hist.labels(region, phase).observe(seconds)

    def degraded(self, region: str) -> None:
        self.metrics["pdserve_degraded_requests_total"].labels(self._region(region)).inc()

    def rejected(self, reason: str) -> None:
        self.metrics["pdserve_rejections_total"].labels(reason).inc()

    def migrated(self, region: str, phase: str) -> None:
        self.metrics["pdserve_migrations_total"].labels(self._region(region), phase).inc()

    # -- instances ---------------------------------------------------------------------------------

    def load(self, region: str, report: LoadReport) -> None:
        who = (region, report.role, report.instance_id)
        m = self.metrics
        m["pdserve_queue_length"].labels(*who).set(report.waiting)
        m["pdserve_running_requests"].labels(*who).set(report.running)
        used = 1.0 - report.free_blocks / report.num_blocks if report.num_blocks else 0.0
        m["pdserve_kv_usage_ratio"].labels(*who).set(used)

    def forget(self, region: str, role: str, instance_id: str) -> None:
        for name in ("pdserve_queue_length", "pdserve_running_requests", "pdserve_kv_usage_ratio"):
            with contextlib.suppress(KeyError):
                self.metrics[name].remove(region, role, instance_id)

    def snapshot(self, snap: ClusterSnapshot) -> None:
        self.cluster.snapshot = snap

    # -- serving -------------------------------------------------------------------------------

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST

    def sample(self, router: ObservedRouter) -> dict[str, Any]:
        """One dashboard point per region: counts, queues, KV usage, latency, bandwidth."""
        now_wall, now = time.time(), time.monotonic()
        snap = self.cluster.snapshot
        states = {r.region: r for r in snap.regions} if snap else {}
        totals = _region_totals(snap)
        moe = _moe_imbalance(snap)
        point: dict[str, Any] = {"t": now_wall, "regions": {}}
        for spec in router.config.regions:
            name = spec.name
            views = [v for v in router.cluster.instances.values() if v.region == name]
            pre = [v for v in views if v.role == "prefill"]
            dec = [v for v in views if v.role == "decode"]
            recent = self._recent(name, WINDOW_S, now)
            ttft = [r[1] for r in recent]
            tpot = [r[2] for r in recent if r[2] is not None]
            state = states.get(name)
            rates = {k: self._rate(name, k, v, now) for k, v in totals.get(name, {}).items()}
            point["regions"][name] = {
                "prefill": len(pre),
                "decode": len(dec),
                "target_prefill": state.target_prefill if state else None,
                "target_decode": state.target_decode if state else None,
                "prefill_queue": sum(v.report.waiting for v in pre if v.report),
                "decode_queue": sum(v.report.waiting for v in dec if v.report),
                "running": sum(v.report.running for v in dec if v.report),
                "kv_usage": max(
                    (1 - v.report.free_blocks / v.report.num_blocks for v in dec if v.report),
                    default=0.0,
                ),
                "ttft": _quantiles(ttft),
                "tpot": _quantiles(tpot),
                "requests_per_s": len(recent) / WINDOW_S,
                "transfer_bytes_per_s": rates.get("sent", 0.0),
                "tier_hits_per_s": {tier: rates.get(tier, 0.0) for tier in ("host", "disk")},
                "tier_misses_per_s": rates.get("misses", 0.0),
                "moe_imbalance": moe.get(name),
            }
        self.history.append(point)
        return point

    def _rate(self, region: str, counter: str, value: float, now: float) -> float:
        """Per second since the last sample (0 on the first, or after a counter reset)."""
        t0, v0 = self._last.get((region, counter), (now, value))
        self._last[(region, counter)] = (now, value)
        return max((value - v0) / (now - t0), 0.0) if now > t0 else 0.0

    def _recent(
        self, region: str, window_s: float, now: float
    ) -> list[tuple[float, float, float | None, int]]:
        return [r for r in self.completed[region] if now - r[0] <= window_s]

    def region_metrics(
        self, router: ObservedRouter, window_s: float, model: str = ""
    ) -> list[dict[str, Any]]:
        """Each region's recent latencies and load of one model version (its deployment
        key ``model``), for its planner."""
        now = time.monotonic()
        out = []
        for spec in router.config.regions:
            done = self.model_completed[(spec.name, model)]
            recent = [r for r in done if now - r[0] <= window_s]
            prefills = router.cluster.table("prefill", spec.name, model)
            decodes = router.cluster.table("decode", spec.name, model)
            queue_s = float(np.mean(prefills.queued * prefills.per_token)) if len(prefills) else 0.0
            usage = [1.0 - v.free_fraction for v in decodes.views]
            ttft = [r[1] for r in recent]
            tpot = [r[2] for r in recent if r[2] is not None]
            came = [a for a in self.model_arrivals[(spec.name, model)] if now - a[0] <= window_s]
            out.append(
                {
                    "region": spec.name,
                    "prefill_count": len(prefills),
                    "decode_count": len(decodes),
                    "requests": len(recent),
                    "ttft_p90_s": float(np.quantile(ttft, 0.9)) if ttft else None,
                    "tpot_p90_s": float(np.quantile(tpot, 0.9)) if tpot else None,
                    "prefill_queue_s": queue_s,
                    "decode_kv_usage": max(usage, default=0.0),
                    "decode_batch": float(np.mean(decodes.running)) if len(decodes) else 0.0,
                    "inflight": router.region_inflight[spec.name],
                    "arrival_rate": len(came) / window_s,
                    "prompt_mean": float(np.mean([a[1] for a in came])) if came else 0.0,
                    "output_mean": float(np.mean([r[3] for r in recent])) if recent else 0.0,
                    "arrival_peak_rate": peak_rate([a[0] for a in came], now, window_s),
                    # (times, prompt tokens) for the drain rate, which the actor computes
                    # off its event loop (pdserve.router.actor.RouterActor.region_metrics).
                    "arrivals": ([a[0] for a in came], [a[1] for a in came]),
                }
            )
        return out

    def dashboard(self, router: ObservedRouter, since: float) -> dict[str, Any]:
        snap = self.cluster.snapshot
        return {
            "now": time.time(),
            "slo": {"ttft_s": router.config.ttft_slo_s, "tpot_s": router.config.tpot_slo_s},
            "regions": [r.name for r in router.config.regions],
            "series": [p for p in self.history if p["t"] > since],
            # where each instance runs, as its leader last reported
            "instances": [
                {
                    "instance": i.instance_id,
                    "region": i.region,
                    "role": i.role,
                    "node_id": i.node_id,
                    "node_ip": i.node_ip,
                }
                for i in (snap.instances if snap else [])
            ],
            "events": [
                {
                    "t": e.at,
                    "region": e.region,
                    "action": e.action,
                    "reason": e.reason,
                    "source": e.source,
                    "prefill": e.prefill,
                    "decode": e.decode,
                }
                for e in (snap.events if snap else [])
            ],
        }


def _region_totals(snap: ClusterSnapshot | None) -> dict[str, dict[str, float]]:
    """Per region: KV bytes sent, tier hits (per tier) and misses, summed over instances."""
    out: dict[str, dict[str, float]] = {}
    for i in snap.instances if snap else []:
        total = out.setdefault(i.region, {})
        for t in i.transfers:
            if t["direction"] == "sent":
                total["sent"] = total.get("sent", 0.0) + float(t["bytes"])
        if i.kv_tiers is not None:
            for tier, n in i.kv_tiers.hits.items():
                total[tier] = total.get(tier, 0.0) + n
            total["misses"] = total.get("misses", 0.0) + i.kv_tiers.misses
    return out


def _moe_imbalance(snap: ClusterSnapshot | None) -> dict[str, dict[str, float]]:
    """Per region, the worst MoE layer's imbalance over EP ranks and over experts."""
    out: dict[str, dict[str, float]] = {}
    for i in snap.instances if snap else []:
        load = i.expert_load
        if load is None or not load.by_rank:
            continue
        worst = out.setdefault(i.region, {"rank": 0.0, "expert": 0.0})
        worst["rank"] = max(worst["rank"], *load.by_rank.values())
        worst["expert"] = max(worst["expert"], *load.by_expert.values())
    return out


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p50, p90, p99 = np.quantile(values, [0.5, 0.9, 0.99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def peak_rate(times: Sequence[float], now: float, span: float, bins: int = 4) -> float:
    """Arrivals a second in the busiest of ``bins`` equal parts of the ``span`` to ``now``
    (what the mean rate of a bursty trace hides)."""
    if not len(times) or span <= 0:
        return 0.0
    counts, _ = np.histogram(times, bins=bins, range=(now - span, now))
    return float(counts.max()) / (span / bins)


def drain_rate(
    times: Sequence[float], tokens: Sequence[float], deadline_s: float, percentile: float = 90.0
) -> float:
    """Prompt tokens a second that let ``percentile`` % of the arrivals meet ``deadline_s``.

    Prefill as one fluid server: arrival ``k`` (at ``t_k``, arrivals in time
    order) meets its deadline when everything that arrived from some earlier
    ``t_j`` up to it is done by ``t_k + deadline_s``, for every ``j``; so it
    needs ``max_j tokens[j..k] / (t_k - t_j + deadline_s)`` tokens a second. A
    burst of many prompts at one instant asks for their sum over the deadline;
    a steady stream for about its mean rate.
    """
    t = np.asarray(times, dtype=np.float64)
    if not len(t) or deadline_s <= 0:
        return 0.0
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(tokens, dtype=np.float64))])
    return float(np.percentile(_max_rates(t.tolist(), cum.tolist(), deadline_s), percentile))


def _max_rates(t: list[float], cum: list[float], deadline_s: float) -> list[float]:
    """``need[k] = max over j <= k of (cum[k+1] - cum[j]) / (t[k] - t[j] + deadline_s)``.

    The slope from point ``(t[j], cum[j])`` up to ``(t[k] + deadline_s, cum[k+1])``,
    right of every point: its maximum lies on the points' lower convex hull, where
    it rises then falls, so each arrival costs a binary search (O(n log n) in all).
    """
    hx: list[float] = []  # the lower hull of the points so far, left to right
    hy: list[float] = []
    need = []
    for k, x in enumerate(t):
        y = cum[k]
        while len(hx) > 1 and (hx[-1] - hx[-2]) * (y - hy[-2]) <= (hy[-1] - hy[-2]) * (x - hx[-2]):
            hx.pop()
            hy.pop()
        hx.append(x)
        hy.append(y)
        qx, qy = x + deadline_s, cum[k + 1]
        lo, hi = 0, len(hx) - 1
        while lo < hi:  # the vertex of the largest slope to the query: slopes rise, then fall
            mid = (lo + hi) // 2
            if (qy - hy[mid]) * (qx - hx[mid + 1]) < (qy - hy[mid + 1]) * (qx - hx[mid]):
                lo = mid + 1
            else:
                hi = mid
        need.append((qy - hy[lo]) / (qx - hx[lo]))
    return need
