"""The proactive planner's latency model: region counts from a profile, in closed form.

:class:`ProfileCapacity` answers :class:`~pdserve.cluster.proactive.CapacityModel`
for a cluster config and its profiles with the textbook plan of
:mod:`pdserve.sim.textbook` (prefill as an M/D/1 queue at the utilisation its
TTFT SLO allows; decode at the largest batch meeting the TPOT SLO and fitting
the KV cache), without headroom or spares: the planner adds its own headroom,
and its reactive rules catch what the model misses. Prefill is sized for the
SLO's percentile (p90; the wait's tail taken as exponential) at the mean rate,
and at least for the forecast's drain rate: the prompt tokens a second that
finish the SLO's percentile of arrivals within the TTFT SLO, as measured on
the window's arrivals (a burst of tens of prompts at one instant asks for
their sum within the SLO, which no mean-rate queue sees). Each instance
drains one prompt's tokens per ``prefill_s``, and a prompt's own step is not
shared, so ``drain x S / prompt x SLO / (SLO - S)`` instances. Where the drain
rate is not measured, prefill is sized as Poisson arrivals at the rate of the
window's busiest quarter. Decode is sized for the mean rate: a batch
outlives a burst. It runs in microseconds once a length mix is cached, so it
can answer every planning interval, live or simulated.
"""

from __future__ import annotations

import math

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.proactive import Forecast, Target
from pdserve.sim.build import ProfileBook, layout
from pdserve.sim.textbook import SingleInstance, single_instance, textbook_plan


def _quantised(x: float) -> float:
    """``x`` to two significant digits: nearby length mixes share one cached answer."""
    if x <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return round(x / step) * step


class ProfileCapacity:
    def __init__(self, config: ClusterConfig, book: ProfileBook, percentile: float = 90.0) -> None:
        self.config, self.book = config, book
        self.tail = math.log(100 / (100 - percentile))  # p90: 2.3 x the mean wait
        self.regions = {g.name: g for g in config.regions}
        for g in config.regions:  # a profile of every layout, or an error naming the one missing
            for role in ("prefill", "decode"):
                book.get(*layout(config, g, role))
        self._one: dict[tuple[str, float, float], SingleInstance] = {}

    def single(self, region: str, prompt_len: float, output_len: float) -> SingleInstance:
        key = (region, _quantised(prompt_len), _quantised(output_len))
        if key not in self._one:
            g = self.regions[region]
            prefill = self.book.get(*layout(self.config, g, "prefill"))
            decode = self.book.get(*layout(self.config, g, "decode"))
            engine = self.config.engine_config("decode", g)
            kv = None
            if engine.cache.num_blocks:
                kv = engine.cache.num_blocks * engine.cache.block_size
            self._one[key] = single_instance(
                prefill,
                decode,
                max(key[1], 1.0),
                max(key[2], 1.0),
                self.config.router.tpot_slo_s,
                engine.scheduler.max_num_seqs,
                math.inf,
                kv,
            )
        return self._one[key]

    def counts(self, region: str, forecast: Forecast) -> Target:
        one = self.single(region, forecast.prompt_len, forecast.output_len)
        if forecast.rate <= 0:
            return Target(0, 0, "no traffic")
        slo = self.config.router.ttft_slo_s
        output = max(forecast.output_len, 1.0)
        plan = textbook_plan(forecast.rate, one, output, slo, 0, 0, 1.0, self.tail)
        if plan.prefill_rho <= 0 or not one.batch:  # an SLO no count meets: ask for the most
            return Target(10**6, 10**6, "the SLOs cannot be met by one request alone")
        if forecast.drain > 0:  # the bursts' tokens, each drained within the SLO
            drain = forecast.drain
            per_instance = forecast.prompt_len / one.prefill_s * (slo - one.prefill_s) / slo
            prefill = max(plan.prefill_bare, math.ceil(drain / per_instance))
            how = f"drain {drain / 1e3:.0f}k tokens/s at {per_instance / 1e3:.0f}k an instance"
        else:  # the busiest part of the window as Poisson arrivals
            peak = textbook_plan(
                forecast.rate * forecast.peak_ratio, one, output, slo, 0, 0, 1.0, self.tail
            )
            prefill = peak.prefill_bare
            how = f"{one.prefill_s * 1e3:.0f} ms a prompt at rho {plan.prefill_rho:.2f}"
        return Target(
            max(1, prefill),
            max(1, plan.decode_bare),
            f"prefill {how}; decode batch {one.batch} at {one.step_at_batch_s * 1e3:.1f} ms a step",
        )


def capacity_for(config: ClusterConfig) -> ProfileCapacity | None:
    """The proactive planner's model of a live cluster: ``planner.profile`` (relative
    to the config file's folder) for the config's model; None for a reactive planner."""
    from pathlib import Path

    from pdserve.core.errors import InvalidArgumentError
    from pdserve.sim.build import book_for
    from pdserve.sim.profile import load_profile

    if config.planner.policy != "proactive":
        return None
    if not config.planner.profile:
        raise InvalidArgumentError(
            "planner.profile",
            "the proactive planner needs a latency model: a `pdserve profile` file of this "
            "model and layout",
        )
    path = Path(config.planner.profile).expanduser()
    if not path.is_absolute() and Path(config.source).is_file():
        path = Path(config.source).parent / path
    return ProfileCapacity(config, book_for(config, [load_profile(path)], None))
