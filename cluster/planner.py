"""The P:D planner: how many prefill and decode instances each region should run.

Every ``interval_s`` the controller hands the planner each region's recent
metrics (from the router). The planner compares them with the SLOs:

- prefill pressure: TTFT p90, or the estimated prefill queue time, above
  ``high`` x the TTFT SLO -> one more prefill instance;
- decode pressure: TPOT p90 above ``high`` x the TPOT SLO, or decode KV usage
  above ``kv_high`` -> one more decode instance;
- calm: everything under ``low`` x its SLO (or no traffic) for ``idle_s`` ->
  one instance fewer, of the role with the most spare capacity; a role with
  ``min: 0`` goes down to zero (scale to zero), and the calm clock starts again
  whenever the region is back above its minimums (a cold start), so the instance
  that just started keeps serving ``idle_s`` at least. A region with requests
  waiting for a cold start is never calm.

Between ``low`` and ``high`` nothing changes (hysteresis), and a region that
just changed waits ``cooldown_s`` (no flapping). Counts stay within each
role's [min, max]. Every decision carries its reason; in "advisory" mode
decisions are recorded but not applied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

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
    # Traffic over the window, for a forecast: arrivals a second, the mean prompt
    # of those arrivals and the mean output of the requests that finished.
    arrival_rate: float = 0.0
    prompt_mean: float = 0.0
    output_mean: float = 0.0
    # The busiest quarter of the window, in arrivals a second (bursts the mean hides).
    arrival_peak_rate: float = 0.0
    # Prompt tokens a second prefill must finish for 90% of the window's arrivals to
    # meet the TTFT SLO, as a fluid queue: for each arrival, the most over earlier
    # arrivals of the tokens since then over the time to its deadline (0: not measured).
    arrival_drain_rate: float = 0.0
    # Instances asked for and not yet serving (the controller's targets beyond the counts).
    prefill_starting: int = 0
    decode_starting: int = 0
    # Requests the router holds until an instance of the region starts (it is at zero).
    cold_waiting: int = 0


@dataclass(frozen=True)
class PlannerDecision:
    at: float  # time.time()
    region: str
    action: str  # add_prefill, remove_prefill, add_decode, remove_decode
    reason: str  # for people: the measured values against their thresholds
    applied: bool = False
    cause: str = ""  # for metrics, a small fixed set: ttft_slo, tpot_slo, kv_usage, calm, forecast
    count: int = 1  # instances to add or remove


class PlannerPolicy(Protocol):
    """Decides how a region's P:D counts should change from its recent metrics.

    Called once per region per planning interval, from one thread, with the
    caller's clock reading as ``now``; it may keep state across calls (cooldowns,
    calm periods, forecasts) but does no I/O and changes no instance itself: the
    caller applies the decision (or only records it, in advisory mode). The
    controller and the simulator run the same objects through this seam.
    """

    history: list[PlannerDecision]

    def decide(self, m: RegionMetrics, now: float | None = None) -> PlannerDecision | None: ...


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
        state = self._region_state(m.region, now)
        if now - state.last_change < self.config.cooldown_s:
            return None
        pressure = self._pressure(m)
        if pressure is not None:
            state.calm_since = None
            return self._record(m.region, *pressure, now)
        return self._calm(m, state, now)

    def _region_state(self, region: str, now: float) -> _RegionState:
        return self._state.setdefault(
            region, _RegionState(last_change=now - self.config.cooldown_s)
        )

    def _pressure(self, m: RegionMetrics) -> tuple[str, str, str] | None:
        """(action, cause, reason) when an SLO (or KV usage) asks for one more instance."""
        bounds = self.regions[m.region]
        c = self.config
        ttft = max(m.ttft_p90_s or 0.0, m.prefill_queue_s)
        tpot = m.tpot_p90_s or 0.0
        if ttft > c.high * self.ttft_slo_s and m.prefill_count < bounds.prefill.max:
            reason = f"TTFT p90 {ttft * 1e3:.0f} ms > {c.high:.0%} of the {self.ttft_slo_s * 1e3:.0f} ms SLO"
            return "add_prefill", "ttft_slo", reason
        if tpot > c.high * self.tpot_slo_s and m.decode_count < bounds.decode.max:
            reason = f"TPOT p90 {tpot * 1e3:.0f} ms > {c.high:.0%} of the {self.tpot_slo_s * 1e3:.0f} ms SLO"
            return "add_decode", "tpot_slo", reason
        if m.decode_kv_usage > c.kv_high and m.decode_count < bounds.decode.max:
            reason = f"decode KV usage {m.decode_kv_usage:.0%} > {c.kv_high:.0%}"
            return "add_decode", "kv_usage", reason
        return None

    def _is_calm(self, m: RegionMetrics) -> bool:
        c = self.config
        ttft = max(m.ttft_p90_s or 0.0, m.prefill_queue_s)
        calm = ttft <= c.low * self.ttft_slo_s and (m.tpot_p90_s or 0.0) <= c.low * self.tpot_slo_s
        return calm and m.decode_kv_usage <= c.kv_high / 2 and not m.cold_waiting

    def _calm(self, m: RegionMetrics, state: _RegionState, now: float) -> PlannerDecision | None:
        """One instance fewer after ``idle_s`` of calm, of the role with the most spare."""
        c = self.config
        if not self._is_calm(m):
            state.calm_since = None
            return None
        if state.calm_since is None:
            state.calm_since = now
            return None
        if now - state.calm_since < c.idle_s:
            return None
        bounds = self.regions[m.region]
        spare_prefill = m.prefill_count - bounds.prefill.min
        spare_decode = m.decode_count - bounds.decode.min
        if spare_prefill <= 0 and spare_decode <= 0:
            state.calm_since = None  # at the minimums: calm counts again from the next start
            return None
        role = "prefill" if spare_prefill >= spare_decode else "decode"
        ttft = max(m.ttft_p90_s or 0.0, m.prefill_queue_s)
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
        self, region: str, action: str, cause: str, reason: str, now: float, count: int = 1
    ) -> PlannerDecision:
        self._state[region].last_change = now
        decision = PlannerDecision(
            time.time(), region, action, reason, self.config.mode == "on", cause, count
        )
        self.history.append(decision)
        del self.history[:-200]
        return decision
