"""The proactive P:D planner: its forecast, its moves toward the latency model's counts,
its give-backs, and the conversation-to-code replay it is measured on (simulated)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.report import Slo
from pdserve.cluster.config import PlannerConfig, load_config, parse_config
from pdserve.cluster.planner import Planner, RegionMetrics
from pdserve.cluster.proactive import Forecast, Forecaster, ProactivePlanner, make_planner
from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.build import book_for
from pdserve.sim.capacity import ProfileCapacity, capacity_for
from pdserve.sim.metrics import drain_rate
from pdserve.sim.replay import compare, outcome, phased_workload, with_policy
from pdserve.sim.textbook import safe_utilisation

CONFIG = """
model: llama-7b
connector: p2p
engine: {max_num_seqs: 256, max_num_batched_tokens: 8192, enable_prefix_caching: false}
regions:
  - name: east
    prefill: {count: 2, min: 1, max: 12}
    decode: {count: 2, min: 1, max: 12}
slo: {ttft_ms: 500, tpot_ms: 50}
router: {max_inflight_per_region: 100000}
planner: {mode: "on", policy: proactive, interval_s: 10, cooldown_s: 30, idle_s: 60, horizon_s: 30}
"""


def metrics(**values) -> RegionMetrics:
    base = dict(
        region="east",
        prefill_count=2,
        decode_count=2,
        requests=100,
        ttft_p90_s=0.1,
        tpot_p90_s=0.02,
        prefill_queue_s=0.0,
        decode_kv_usage=0.2,
        decode_batch=8.0,
        arrival_rate=10.0,
        prompt_mean=1000.0,
        output_mean=200.0,
        arrival_peak_rate=10.0,
    )
    return RegionMetrics(**{**base, **values})


@pytest.fixture(scope="module")
def config():
    return parse_config(CONFIG)


@pytest.fixture(scope="module")
def capacity(config) -> ProfileCapacity:
    return ProfileCapacity(config, book_for(config, [], "h100"))


def proactive(config, capacity) -> ProactivePlanner:
    p = make_planner(config.planner, 0.5, 0.05, {g.name: g for g in config.regions}, capacity)
    assert isinstance(p, ProactivePlanner)
    return p


def test_forecast_follows_a_steady_rate_and_leans_into_a_ramp() -> None:
    steady = Forecaster(smoothing=0.5, horizon_s=30)
    for t in range(10):
        f = steady.observe(metrics(arrival_rate=20.0), now=10.0 * t)
    assert f is not None and f.rate == pytest.approx(20.0, rel=1e-6)
    assert f.prompt_len == 1000.0 and f.output_len == 200.0
    ramp = Forecaster(smoothing=0.5, horizon_s=30)
    for t in range(10):  # +1 req/s every 10 s
        f = ramp.observe(metrics(arrival_rate=10.0 + t), now=10.0 * t)
    assert f is not None and f.level < 19.0 < f.rate  # ahead of the last window
    assert Forecaster(0.5, 30).observe(metrics(arrival_rate=5.0, requests=0), 0.0) is None


def test_capacity_model_is_the_textbook_plan_at_the_slo_percentile(config, capacity) -> None:
    conv = capacity.counts("east", Forecast(30.0, 1155.0, 211.0, 30.0, 0.0))
    code = capacity.counts("east", Forecast(30.0, 2048.0, 28.0, 30.0, 0.0))
    assert code.prefill > conv.prefill and code.decode < conv.decode  # prompt-heavy
    one = capacity.single("east", 2048.0, 28.0)
    rho = safe_utilisation(one.prefill_s, 0.5, tail=math.log(10))
    assert code.prefill == math.ceil(30.0 / (rho / one.prefill_s))
    bursty = capacity.counts("east", Forecast(30.0, 2048.0, 28.0, 30.0, 0.0, peak_ratio=2.0))
    assert bursty.prefill > code.prefill and bursty.decode == code.decode


def test_moves_the_whole_gap_at_once_and_counts_what_is_starting(config, capacity) -> None:
    p = proactive(config, capacity)
    heavy = metrics(arrival_rate=40.0, arrival_peak_rate=40.0, prompt_mean=2048.0, output_mean=28.0)
    d = p.decide(heavy, now=0.0)
    target = p.plans["east"].target
    assert d is not None and d.action == "add_prefill" and d.cause == "forecast"
    assert d.count == target.prefill - 2 > 1 and "needs" in d.reason
    # asked for and starting: nothing more, even with the cooldown over
    starting = metrics(**{**heavy.__dict__, "prefill_starting": d.count})
    assert p.decide(starting, now=40.0) is None


def test_gives_back_after_idle_s_above_target_down_to_one_spare(config, capacity) -> None:
    p = proactive(config, capacity)
    light = metrics(prefill_count=6, decode_count=6, arrival_rate=2.0, arrival_peak_rate=2.0)
    assert p.decide(light, now=0.0) is None  # over target: the clock starts
    assert p.decide(light, now=30.0) is None  # not yet idle_s (60 s)
    target = p.plans["east"].target
    d = p.decide(light, now=61.0)
    assert d is not None and d.action == "remove_prefill" and d.cause == "forecast"
    assert d.count == 6 - (target.prefill + 1)  # in one step, keeping one spare
    assert p.decide(light, now=70.0) is None  # cooldown


def _drain_for(capacity: ProfileCapacity, instances: float) -> float:
    """The drain rate (prompt tokens/s, prompts of 1,000) that ``instances`` prefill meet."""
    s = capacity.single("east", 1000.0, 200.0).prefill_s
    return instances * 1000.0 / s * (0.5 - s) / 0.5


def test_a_give_back_needs_consecutive_intervals_calm_and_the_recent_peak(config, capacity) -> None:
    light = metrics(
        prefill_count=6,
        decode_count=6,
        arrival_rate=2.0,
        arrival_peak_rate=2.0,
        arrival_drain_rate=1000.0,
    )

    def after(drain_at_30: float, last: RegionMetrics = light):
        p = proactive(config, capacity)
        assert p.decide(light, now=0.0) is None
        # the forecast's drain is smoothed by 0.5: this window brings it to ``drain_at_30``
        bump = metrics(**{**light.__dict__, "arrival_drain_rate": 2 * drain_at_30 - 1000.0})
        assert p.decide(bump, now=30.0) is None
        return p, p.plans["east"].target.prefill, p.decide(last, now=61.0)

    # 4 needed at 30 s: still two over (one spare kept), so the clock runs on, but
    # the give-back stops at one spare over that recent peak
    _, peak, d = after(_drain_for(capacity, 3.5))
    assert peak == 4 and d is not None and d.action == "remove_prefill" and d.count == 1
    # 5 needed at 30 s: only the spare is over, so the clock starts again then
    _, peak, d = after(_drain_for(capacity, 4.5))
    assert peak == 5 and d is None
    # prompts wait 300 ms (under the SLO, over low x SLO): not calm, nothing given back
    _, _, d = after(_drain_for(capacity, 3.5), metrics(**{**light.__dict__, "ttft_p90_s": 0.3}))
    assert d is None


def test_drain_rate_is_its_definition_on_steady_bursty_and_tied_arrivals() -> None:
    # need[k] = max over j <= k of tokens[j..k] / (t[k] - t[j] + deadline), each j tried
    rng = np.random.default_rng(1)
    for trial in range(60):
        n = int(rng.integers(1, 300))
        times = [
            np.sort(rng.uniform(0, 8, n)),
            np.repeat(np.sort(rng.uniform(0, 8, n)), 4)[:n],
            np.round(np.sort(rng.uniform(0, 4, n)), 1),
        ][trial % 3]
        tokens = rng.integers(0, 2000, n).astype(np.float64)
        deadline = [0.01, 0.5, 2.0][trial % 3]
        cum = np.concatenate([[0.0], np.cumsum(tokens)])
        need = [
            max((cum[k + 1] - cum[j]) / (times[k] - times[j] + deadline) for j in range(k + 1))
            for k in range(n)
        ]
        for q in (50.0, 90.0):
            got = drain_rate(times, tokens, deadline, q)
            assert got == pytest.approx(float(np.percentile(need, q)), rel=1e-12)


def test_bursty_arrivals_size_prefill_above_poisson_of_the_same_rate(config, capacity) -> None:
    rng = np.random.default_rng(0)
    poisson = np.sort(rng.uniform(0.0, 40.0, 800))  # 20 req/s over a 40 s window
    bursts = np.repeat(np.arange(5.0, 40.0, 5.0), 800 // 7)[:800]  # 7 instants, ~114 each
    tokens = np.full(800, 1000.0)
    steady, bursty = drain_rate(poisson, tokens, 0.5), drain_rate(bursts, tokens, 0.5)
    assert 20_000 < steady < 40_000  # about the mean 20,000 tokens/s, plus its noise
    # a burst's 90th percentile prompt waits for ~0.9 x 114 prompts ahead of it
    assert bursty == pytest.approx(0.9 * 114 * 1000 / 0.5, rel=0.05)
    targets = {}
    for name, drain in (("steady", steady), ("bursty", bursty)):
        p = proactive(config, capacity)
        m = metrics(
            arrival_rate=20.0,
            arrival_peak_rate=20.0,
            arrival_drain_rate=drain,
            prompt_mean=1000.0,
            prefill_count=1,
        )
        p.decide(m, now=0.0)
        targets[name] = p.plans["east"].target
        assert "drain" in p.plans["east"].target.why
    assert targets["bursty"].prefill > 3 * targets["steady"].prefill
    assert targets["bursty"].decode == targets["steady"].decode  # decode: the mean rate


def test_reactive_rules_still_add_on_a_miss(config, capacity) -> None:
    p = proactive(config, capacity)
    # the model is content with the counts, but TTFT is missed now
    m = metrics(prefill_count=4, decode_count=4, ttft_p90_s=2.0)
    d = p.decide(m, now=0.0)
    assert d is not None and d.action == "add_prefill" and d.cause == "ttft_slo"


def test_proactive_needs_a_latency_model(config, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        make_planner(config.planner, 0.5, 0.05, {g.name: g for g in config.regions})
    assert e.value.field == "planner.profile"
    with pytest.raises(InvalidArgumentError) as e:
        capacity_for(config)
    assert e.value.field == "planner.profile"
    file = tmp_path / "c.yaml"
    file.write_text(CONFIG.replace("policy: proactive,", "policy: proactive, profile: no.json,"))

    with pytest.raises(InvalidArgumentError, match="no such file"):
        capacity_for(load_config(file))
    assert isinstance(
        make_planner(PlannerConfig(), 0.5, 0.05, {g.name: g for g in config.regions}), Planner
    )
    with pytest.raises(InvalidArgumentError) as e:
        PlannerConfig(policy="psychic")
    assert e.value.field == "planner.policy"


def test_replay_conversation_then_code_shifts_toward_prefill(config) -> None:
    book = book_for(config, [], "h100")
    work, starts = phased_workload(["azure-conv", "azure-code"], 20.0, 120.0, 4000, 2000)
    runs = compare(with_policy(config, "reactive"), book, work, ["reactive", "proactive"], 20.0)
    slo = Slo(0.5, 0.05)
    out = {p: outcome(run, slo, starts[1]) for p, (run, _) in runs.items()}
    pro, re_ = out["proactive"], out["reactive"]
    assert pro["first_add_prefill_after_switch_s"] is not None
    end = pro["end_counts"]
    assert end["east.prefill"] > end["east.decode"]  # prompt-heavy: more prefill than decode
    # the model acts on the new mix before the SLO is missed
    assert re_["first_add_prefill_after_switch_s"] is None or (
        pro["first_add_prefill_after_switch_s"] <= re_["first_add_prefill_after_switch_s"]
    )
    assert any(d["reason"].startswith("forecast") for d in runs["proactive"][0].decisions)
