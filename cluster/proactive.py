"""The proactive P:D planner: forecast each region's traffic, size it from a latency model.

Every interval, per region:

1. :class:`Forecaster` updates its forecast from the window's metrics: the
   arrival rate by Holt's linear trend (a level and a slope, smoothed by
   ``planner.smoothing`` and half of it) looked ``horizon_s`` ahead, and the
   mean prompt and output lengths and the ratio of the window's busiest
   quarter to its mean rate by exponential smoothing;
2. a :class:`CapacityModel` (for example the profile-based model of
   :mod:`pdserve.sim.capacity`) turns the forecast, grown by ``headroom``, into
   the prefill and decode counts the region needs to meet its SLOs;
3. the planner adds what the role furthest below its target lacks (relative
   to the target), at once and without waiting out the cooldown: the model,
   not the effect of the last change, says how many. With nothing to add for
   the forecast, the reactive rules still apply (an SLO missed now adds an
   instance), and a role above its target for ``idle_s`` gives one back.

Cooldown (for reactive adds and for removals), min/max bounds and the decision
log are the reactive planner's.
The last forecast and target of each region are kept in ``plans`` for the
dashboard and ``pdserve status``.
"""

from __future__ import annotations

import dataclasses
import time
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
        if m.requests > 0 and m.output_mean > 0:
            self.output_len = _smooth(self.output_len, m.output_mean, a)
        if self.prompt_len is None or self.output_len is None:
            return None
        # the slope may at most double the level, or halve it, over the horizon
        ahead = min(max(self.trend * self.horizon_s, -self.level / 2), self.level)
        rate = max(0.0, self.level + ahead)
        return Forecast(
            rate, self.prompt_len, self.output_len, self.level, self.trend, self.peak_ratio
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
    _over_since: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity is None:
            raise ValueError("the proactive planner needs a capacity model")

    def decide(self, m: RegionMetrics, now: float | None = None) -> PlannerDecision | None:
        now = time.monotonic() if now is None else now
        target = self._target(m, now)
        state = self._region_state(m.region, now)
        if target is None:  # no traffic seen yet: nothing to forecast from
            return super().decide(m, now)
        toward = self._toward(m, target)
        if toward is not None:  # the model says how many: no cooldown to see an effect
            self._over_since.pop(m.region, None)
            action, count = toward
            return self._record(m.region, action, "forecast", self._describe(m, target), now, count)
        if now - state.last_change < self.config.cooldown_s:
            return None
        pressure = self._pressure(m)
        if pressure is not None:
            self._over_since.pop(m.region, None)
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

    def _describe(self, m: RegionMetrics, target: Target) -> str:
        f = self.plans[m.region].forecast
        return (
            f"forecast {f.rate:.3g} req/s (peaks x{f.peak_ratio:.1f}) in {self.config.horizon_s:.0f} s (prompt "
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

    def _shrink(self, m: RegionMetrics, target: Target, now: float) -> PlannerDecision | None:
        """Give back one instance of a role that has stayed above its target for ``idle_s``."""
        over_p = m.prefill_count + m.prefill_starting - target.prefill
        over_d = m.decode_count + m.decode_starting - target.decode
        queued = m.prefill_queue_s > self.config.low * self.ttft_slo_s
        if max(over_p, over_d) <= 0:
            self._over_since.pop(m.region, None)
            return None
        since = self._over_since.setdefault(m.region, now)
        if now - since < self.config.idle_s:
            return None
        role = "prefill" if over_p >= over_d else "decode"
        if role == "prefill" and queued:
            return None  # prompts are queueing: the model is optimistic here
        self._over_since[m.region] = now
        return self._record(m.region, f"remove_{role}", "forecast", self._describe(m, target), now)


def make_planner(
    config: PlannerConfig, ttft_slo_s: float, tpot_slo_s: float,
    regions: dict[str, RegionConfig], capacity: CapacityModel | None = None,
) -> PlannerPolicy:  # fmt: skip
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
