"""The proactive P:D planner: forecast each region's traffic, size it from a latency model.

Every interval, per region:

1. :class:`Forecaster` updates its forecast from the window's metrics: the
   arrival rate by Holt's linear trend (a level and a slope, smoothed by
   ``planner.smoothing`` and half of it) looked ``horizon_s`` ahead; and, by
   exponential smoothing, the mean prompt and output lengths and how bursty
   the arrivals are: the prompt tokens a second prefill must drain for 90% of
   the window's arrivals to meet the TTFT SLO (``arrival_drain_rate``) or,
   where that is not measured, the ratio of the window's busiest quarter to
   its mean rate;
2. a :class:`CapacityModel` (for example the profile-based model of
   :mod:`pdserve.sim.capacity`) turns the forecast, its rate grown by
   ``headroom``, into the prefill and decode counts the region needs to meet
   its SLOs (the drain rate is a measured percentile: it is not grown);
3. the planner adds what the role furthest below its target lacks (relative
   to the target), at once and without waiting out the cooldown: the model,
   not the effect of the last change, says how many. With nothing to add for
   the forecast, the reactive rules still apply (an SLO missed now adds an
   instance). A role gives back only when it has had more than one spare
   instance over its target at every interval for ``idle_s`` and its own
   latencies are under ``low`` x their SLO; then it gives back, in one step,
   down to one spare over the highest target of that ``idle_s``: never below
   what the recent peak needed, and one spare (the textbook's N+1) for a
   shift the window has not shown yet, since a new instance takes a start-up
   to help.

Cooldown (for reactive adds and for removals), min/max bounds and the decision
log are the reactive planner's.
The last forecast and target of each region are kept in ``plans`` for the
dashboard and ``pdserve status``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.cluster.config import PlannerConfig, RegionConfig
from pdserve.cluster.planner import Planner, PlannerDecision, PlannerPolicy, RegionMetrics


@dataclass(frozen=True)
class Forecast:
    rate: float  # requests/s expected ``horizon_s`` from now
    prompt_len: float  # mean prompt tokens
    output_len: float  # mean output tokens
    level: float  # the smoothed rate now
    trend: float  # its slope, requests/s per second
    peak_ratio: float = 1.0  # the busiest quarter-window's rate over the mean
    # prompt tokens a second prefill must drain for 90% of arrivals to meet the
    # TTFT SLO (0: not measured; ``peak_ratio`` sizes prefill then)
    drain: float = 0.0


@dataclass(frozen=True)
class Target:
    """The counts a region needs for a forecast, and why (for the decision log)."""

    prefill: int
    decode: int
    why: str = ""


class CapacityModel(Protocol):
    """How many instances of each role a region needs for a rate and length mix."""

    def counts(self, region: str, forecast: Forecast) -> Target: ...


@dataclass
class Forecaster:
    """One region's forecast, updated once per planning interval."""

    smoothing: float
    horizon_s: float
    level: float | None = None
    trend: float = 0.0
    prompt_len: float | None = None
    output_len: float | None = None
    peak_ratio: float = 1.0
    drain: float = 0.0  # prompt tokens a second to drain for the TTFT SLO (0: not measured)
    last: float | None = None

    def observe(self, m: RegionMetrics, now: float) -> Forecast | None:
        """Fold in a window; None until the region has seen a prompt and an output."""
        a = self.smoothing
        if self.level is None or self.last is None:
            self.level = m.arrival_rate
        else:
            dt = max(now - self.last, 1e-9)
            level = a * m.arrival_rate + (1 - a) * (self.level + self.trend * dt)
            b = a / 2  # the slope is smoothed harder than the level: it is noisier
            self.trend = b * (level - self.level) / dt + (1 - b) * self.trend
            self.level = level
        self.last = now
        if m.arrival_rate > 0 and m.prompt_mean > 0:
            self.prompt_len = _smooth(self.prompt_len, m.prompt_mean, a)
            peak = max(m.arrival_peak_rate / m.arrival_rate, 1.0)
            self.peak_ratio = a * peak + (1 - a) * self.peak_ratio
            if m.arrival_drain_rate > 0:
                self.drain = _smooth(self.drain or None, m.arrival_drain_rate, a)
        if m.requests > 0 and m.output_mean > 0:
            self.output_len = _smooth(self.output_len, m.output_mean, a)
        if self.prompt_len is None or self.output_len is None:
            return None
        # the slope may at most double the level, or halve it, over the horizon
        ahead = min(max(self.trend * self.horizon_s, -self.level / 2), self.level)
        rate = max(0.0, self.level + ahead)
        return Forecast(
            rate,
            self.prompt_len,
            self.output_len,
            self.level,
            self.trend,
            self.peak_ratio,
            self.drain,
        )


def _smooth(old: float | None, new: float, a: float) -> float:
    return new if old is None else a * new + (1 - a) * old


@dataclass
class RegionPlan:
    """What the proactive planner last concluded for a region."""

    at: float  # time.time()
    forecast: Forecast
    target: Target


@dataclass
class ProactivePlanner(Planner):
    capacity: CapacityModel | None = None
    plans: dict[str, RegionPlan] = field(default_factory=dict)
    _forecasters: dict[str, Forecaster] = field(default_factory=dict)
    # each region's counts to keep (its target and one spare) over the last ``idle_s``
    _keep: dict[str, deque[tuple[float, Target]]] = field(default_factory=dict)
    # (region, role): since when the role has been above its count to keep at every interval
    _over_since: dict[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity is None:
            raise ValueError("the proactive planner needs a capacity model")

    def decide(self, m: RegionMetrics, now: float | None = None) -> PlannerDecision | None:
        now = time.monotonic() if now is None else now
        target = self._target(m, now)
        state = self._region_state(m.region, now)
        if target is None:  # no traffic seen yet: nothing to forecast from
            return super().decide(m, now)
        keep = Target(target.prefill + 1, target.decode + 1)
        self._track(m, keep, now)
        toward = self._toward(m, target)
        if toward is not None:  # the model says how many: no cooldown to see an effect
            action, count = toward
            return self._record(m.region, action, "forecast", self._describe(m, target), now, count)
        if now - state.last_change < self.config.cooldown_s:
            return None
        pressure = self._pressure(m)
        if pressure is not None:
            return self._record(m.region, *pressure, now)
        return self._shrink(m, target, now)

    def _target(self, m: RegionMetrics, now: float) -> Target | None:
        c = self.config
        fc = self._forecasters.setdefault(m.region, Forecaster(c.smoothing, c.horizon_s))
        forecast = fc.observe(m, now)
        if forecast is None:
            return None
        assert self.capacity is not None
        grown = dataclasses.replace(forecast, rate=forecast.rate * (1 + c.headroom))
        need = self.capacity.counts(m.region, grown)
        b = self.regions[m.region]
        target = Target(
            min(max(need.prefill, b.prefill.min), b.prefill.max),
            min(max(need.decode, b.decode.min), b.decode.max),
            need.why,
        )
        self.plans[m.region] = RegionPlan(time.time(), forecast, target)
        return target

    def _track(self, m: RegionMetrics, keep: Target, now: float) -> None:
        """Remember the last ``idle_s`` of counts to keep, and run each role's clock
        above them."""
        history = self._keep.setdefault(m.region, deque())
        history.append((now, keep))
        while history[0][0] < now - self.config.idle_s:
            history.popleft()
        for role, have, want in (
            ("prefill", m.prefill_count + m.prefill_starting, keep.prefill),
            ("decode", m.decode_count + m.decode_starting, keep.decode),
        ):
            if have > want:
                self._over_since.setdefault((m.region, role), now)
            else:
                self._over_since.pop((m.region, role), None)

    def _describe(self, m: RegionMetrics, target: Target) -> str:
        f = self.plans[m.region].forecast
        bursts = f"drain {f.drain / 1e3:.0f}k tokens/s" if f.drain else f"peaks x{f.peak_ratio:.1f}"
        return (
            f"forecast {f.rate:.3g} req/s ({bursts}) in {self.config.horizon_s:.0f} s (prompt "
            f"{f.prompt_len:.0f}, output {f.output_len:.0f} tokens) needs {target.prefill} "
            f"prefill, {target.decode} decode; have {m.prefill_count}, {m.decode_count}"
            + (
                f" (+{m.prefill_starting}, +{m.decode_starting} starting)"
                if m.prefill_starting or m.decode_starting
                else ""
            )
        )

    def _toward(self, m: RegionMetrics, target: Target) -> tuple[str, int] | None:
        """(action, count): add what the role furthest below its target (relative to
        the target) lacks, if any. The model, not the last change's effect, says how
        many: so the whole gap is asked for at once."""
        have_p = m.prefill_count + m.prefill_starting
        have_d = m.decode_count + m.decode_starting
        short_p = (target.prefill - have_p) / max(target.prefill, 1)
        short_d = (target.decode - have_d) / max(target.decode, 1)
        if max(short_p, short_d) <= 0:
            return None
        if short_p >= short_d:
            return "add_prefill", target.prefill - have_p
        return "add_decode", target.decode - have_d

    def _role_calm(self, m: RegionMetrics, role: str) -> bool:
        """The role's own latencies (and, for decode, KV usage) are well under their SLO."""
        c = self.config
        if m.cold_waiting:
            return False
        if role == "prefill":
            return max(m.ttft_p90_s or 0.0, m.prefill_queue_s) <= c.low * self.ttft_slo_s
        tpot = m.tpot_p90_s or 0.0
        return tpot <= c.low * self.tpot_slo_s and m.decode_kv_usage <= c.kv_high / 2

    def _shrink(self, m: RegionMetrics, target: Target, now: float) -> PlannerDecision | None:
        """Give back, of a calm role above its count to keep (target and one spare)
        at every interval for ``idle_s``, what the highest such count leaves over."""
        best: tuple[str, int] | None = None
        for role, have in (
            ("prefill", m.prefill_count + m.prefill_starting),
            ("decode", m.decode_count + m.decode_starting),
        ):
            since = self._over_since.get((m.region, role))
            if since is None or now - since < self.config.idle_s or not self._role_calm(m, role):
                continue
            floor = max(getattr(k, role) for _, k in self._keep[m.region])
            if have - floor > (best[1] if best else 0):
                best = (role, have - floor)
        if best is None:
            return None
        role, count = best
        reason = f"{self._describe(m, target)}; {role} over it and a spare for {self.config.idle_s:.0f} s"
        return self._record(m.region, f"remove_{role}", "forecast", reason, now, count)


def make_planner(
    config: PlannerConfig,
    ttft_slo_s: float,
    tpot_slo_s: float,
    regions: dict[str, RegionConfig],
    capacity: CapacityModel | None = None,
) -> PlannerPolicy:
    """The planner ``config.policy`` names; the proactive one needs ``capacity``."""
    if config.policy == "proactive":
        if capacity is None:
            from pdserve.core.errors import InvalidArgumentError

            raise InvalidArgumentError(
                "planner.profile",
                "the proactive planner needs a latency model: give planner.profile "
                "(a `pdserve profile` file) for this model and layout",
            )
        return ProactivePlanner(config, ttft_slo_s, tpot_slo_s, regions, capacity=capacity)
    return Planner(config, ttft_slo_s, tpot_slo_s, regions)
