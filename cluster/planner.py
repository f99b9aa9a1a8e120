"""The P:D planner: how many prefill and decode instances each region should run.

Every ``interval_s`` the controller hands the planner each region's recent
metrics (from the router). The planner compares them with the SLOs:

- prefill pressure: TTFT p90, or the estimated prefill queue time, above
  ``high`` x the TTFT SLO -> one more prefill instance;
- decode pressure: TPOT p90 above ``high`` x the TPOT SLO, or decode KV usage
  above ``kv_high`` -> one more decode instance;
- calm: everything under ``low`` x its SLO (or no traffic) for ``idle_s`` ->
  one instance fewer, of the role with the most spare capacity.

Between ``low`` and ``high`` nothing changes (hysteresis), and a region that
just changed waits ``cooldown_s`` (no flapping). Counts stay within each
role's [min, max]. Every decision carries its reason; in "advisory" mode
decisions are recorded but not applied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.cluster.config import PlannerConfig, RegionConfig


@dataclass(frozen=True)
class RegionMetrics:
    region: str
    prefill_count: int
    decode_count: int
    requests: int  # finished in the window
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    prefill_queue_s: float
    decode_kv_usage: float
    decode_batch: float


@dataclass(frozen=True)
class PlannerDecision:
    at: float  # time.time()
    region: str
    action: str  # add_prefill, remove_prefill, add_decode, remove_decode
    reason: str  # for people: the measured values against their thresholds
    applied: bool = False
    cause: str = ""  # for metrics, a small fixed set: ttft_slo, tpot_slo, kv_usage, calm


@dataclass
class _RegionState:
    last_change: float = 0.0
    calm_since: float | None = None


@dataclass
class Planner:
    config: PlannerConfig
    ttft_slo_s: float
    tpot_slo_s: float
    regions: dict[str, RegionConfig]
    history: list[PlannerDecision] = field(default_factory=list)
    _state: dict[str, _RegionState] = field(default_factory=dict)

    def decide(self, m: RegionMetrics, now: float | None = None) -> PlannerDecision | None:
        now = time.monotonic() if now is None else now
        state = self._state.setdefault(
            m.region, _RegionState(last_change=now - self.config.cooldown_s)
        )
        if now - state.last_change < self.config.cooldown_s:
            return None
        bounds = self.regions[m.region]
        c = self.config
        ttft = max(m.ttft_p90_s or 0.0, m.prefill_queue_s)
        action = reason = None
        cause = ""
        if ttft > c.high * self.ttft_slo_s and m.prefill_count < bounds.prefill.max:
            action, cause = "add_prefill", "ttft_slo"
            reason = f"TTFT p90 {ttft * 1e3:.0f} ms > {c.high:.0%} of the {self.ttft_slo_s * 1e3:.0f} ms SLO"
        elif (
            m.tpot_p90_s or 0.0
        ) > c.high * self.tpot_slo_s and m.decode_count < bounds.decode.max:
            action, cause = "add_decode", "tpot_slo"
            reason = f"TPOT p90 {m.tpot_p90_s * 1e3:.0f} ms > {c.high:.0%} of the {self.tpot_slo_s * 1e3:.0f} ms SLO"  # type: ignore[operator]
        elif m.decode_kv_usage > c.kv_high and m.decode_count < bounds.decode.max:
            action, cause = "add_decode", "kv_usage"
            reason = f"decode KV usage {m.decode_kv_usage:.0%} > {c.kv_high:.0%}"
        if action is not None:
            state.calm_since = None
            return self._record(m.region, action, cause, reason or "", now)
        calm = ttft <= c.low * self.ttft_slo_s and (m.tpot_p90_s or 0.0) <= c.low * self.tpot_slo_s
        calm = calm and m.decode_kv_usage <= c.kv_high / 2
        if not calm:
            state.calm_since = None
            return None
        if state.calm_since is None:
            state.calm_since = now
            return None
        if now - state.calm_since < c.idle_s:
            return None
        spare_prefill = m.prefill_count - bounds.prefill.min
        spare_decode = m.decode_count - bounds.decode.min
        if spare_prefill <= 0 and spare_decode <= 0:
            return None
        role = "prefill" if spare_prefill >= spare_decode else "decode"
        what = (
            "no traffic"
            if not m.requests
            else f"TTFT p90 {ttft * 1e3:.0f} ms and TPOT under {c.low:.0%} of SLO"
        )
        state.calm_since = now
        return self._record(
            m.region, f"remove_{role}", "calm", f"calm for {c.idle_s:.0f} s ({what})", now
        )

    def _record(
        self, region: str, action: str, cause: str, reason: str, now: float
    ) -> PlannerDecision:
        self._state[region].last_change = now
        decision = PlannerDecision(
            time.time(), region, action, reason, self.config.mode == "on", cause
        )
        self.history.append(decision)
        del self.history[:-200]
        return decision
