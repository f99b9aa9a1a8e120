"""Step-time noise (``sim/jitter.py``): factors drawn with mean 1 and the asked spread
and persistence, fitted back from traced steps, and carried into simulations that
stay deterministic."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pdserve.bench.report import Slo
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.messages import StepRecord
from pdserve.sim.calibrate import Overhead, bench_flags, simulate, simulate_once
from pdserve.sim.cluster import SimCluster, SimOptions
from pdserve.sim.jitter import Jitter, fit_jitter
from pdserve.sim.live import LiveFit, live_fit, scaled
from pdserve.sim.profile import StepFeatures, StepModel, profile_from_json
from pdserve.sim.validate_options import ValidateOptions
from tests.sim.helpers import TOY_YAML, book, toy_config, toy_profile, workload

STEP = StepModel(overhead_s=0.010)  # every step 10 ms


def _factors(sigma: float, corr_s: float, gap: float, n: int, key: str = "d0") -> np.ndarray:
    j = Jitter(sigma, corr_s, key)
    return np.array([j.factor(gap) for _ in range(n)])


def test_factors_have_mean_one_the_asked_spread_and_persistence() -> None:
    f = _factors(0.15, 0.05, 0.01, 40_000)
    assert f.mean() == pytest.approx(1.0, abs=0.01)  # the model's mean time stands
    logs = np.log(f)
    assert logs.std() == pytest.approx(0.15, rel=0.05)
    lag1 = np.corrcoef(logs[:-1], logs[1:])[0, 1]
    assert lag1 == pytest.approx(math.exp(-0.01 / 0.05), abs=0.03)
    apart = _factors(0.15, 0.05, 1.0, 4_000)  # steps a second apart: fresh draws
    assert abs(np.corrcoef(np.log(apart[:-1]), np.log(apart[1:]))[0, 1]) < 0.06
    np.testing.assert_array_equal(f[:100], _factors(0.15, 0.05, 0.01, 100))  # seeded by key
    assert not np.array_equal(f[:100], _factors(0.15, 0.05, 0.01, 100, key="d1"))
    assert set(_factors(0.0, 0.05, 0.01, 10)) == {1.0}


def test_the_fit_recovers_spread_and_persistence_whatever_each_trace_level() -> None:
    gap = 0.02
    starts = [np.arange(5_000) * gap] * 2
    slow = 1.4 * _factors(0.12, 0.08, gap, 5_000, "b")  # a run on a slower host
    sigma, corr_s = fit_jitter(starts, [_factors(0.12, 0.08, gap, 5_000, "a"), slow])
    assert sigma == pytest.approx(0.12, rel=0.05)
    assert corr_s == pytest.approx(0.08, rel=0.15)
    sigma, corr_s = fit_jitter(starts[:1], [_factors(0.12, 0.0, gap, 5_000)])
    assert sigma == pytest.approx(0.12, rel=0.05) and corr_s < gap  # no persistence
    assert fit_jitter([np.arange(5.0)], [np.ones(5)]) == (0.0, 0.0)  # too few steps
    zero_model = np.ones(20)
    zero_model[3] = np.inf  # a step the model timed at 0 s
    assert fit_jitter([np.arange(20.0)], [zero_model]) == (0.0, 0.0)


def test_live_fit_measures_the_noise_of_traced_steps() -> None:
    model = StepModel(overhead_s=0.003, s_per_token=2e-4, s_per_ctx=4e-7)
    shapes = [((1,) * b, (c,) * b) for b in (1, 4, 16) for c in (64, 512)] + [((256,), (0,))]
    factors = _factors(0.1, 0.05, 0.01, 1_400)
    trace, now = [], 0.0
    for i, f in enumerate(factors):
        new, cached = shapes[i % len(shapes)]
        rec = StepRecord(now, 0.0, new, cached)
        t = 1.3 * model.time(StepFeatures.of(list(zip(new, cached, strict=True)))) * f
        trace.append(dataclasses.replace(rec, seconds=t))
        now += t
    fit = live_fit(model, [trace])
    assert (fit.compute_scale, fit.memory_scale) == pytest.approx((1.3, 1.3), rel=0.03)
    assert fit.jitter == pytest.approx(0.1, rel=0.1)
    assert fit.jitter_s > 0
    noisy = scaled(model, fit)
    assert (noisy.jitter, noisy.jitter_s) == (fit.jitter, fit.jitter_s)


def _closed_loop(step: StepModel, fast: bool = False, **options) -> SimCluster:  # type: ignore[no-untyped-def]
    work = workload(np.zeros(200), 100, 20)
    sim = SimCluster(
        toy_config(0, 1),
        book(toy_profile(step)),
        work,
        SimOptions(fast=fast, max_concurrency=2, **options),
    )
    run = sim.run()
    for inst in run.instances:
        inst.kv.assert_empty()
        assert not inst.scheduler.requests
    return sim


def test_a_closed_loop_of_equal_requests_spreads_only_with_noise() -> None:
    slo = Slo(1.0, 0.1)
    quiet = _closed_loop(STEP).run_info.recorder.summary(slo)
    assert quiet["ttft_ms"]["p90"] == pytest.approx(quiet["ttft_ms"]["p50"])  # one rhythm
    noisy_step = dataclasses.replace(STEP, jitter=0.2, jitter_s=0.05)
    runs = [_closed_loop(noisy_step) for _ in range(2)]
    noisy = runs[0].run_info.recorder.summary(slo)
    assert noisy["ttft_ms"]["p90"] > 1.1 * noisy["ttft_ms"]["p50"]
    assert noisy["tpot_ms"]["p90"] > 1.05 * noisy["tpot_ms"]["p50"]
    mean_step = [r.run_info.instances[0].stats for r in runs]
    quiet_stats = _closed_loop(STEP).run_info.instances[0].stats
    assert mean_step[0].busy_s / mean_step[0].steps == pytest.approx(
        quiet_stats.busy_s / quiet_stats.steps, rel=0.03
    )
    np.testing.assert_array_equal(  # deterministic: each instance's draws are seeded
        runs[0].run_info.recorder.end, runs[1].run_info.recorder.end
    )
    fast = _closed_loop(noisy_step, fast=True).run_info.recorder.summary(slo)
    assert fast["tpot_ms"]["mean"] == pytest.approx(noisy["tpot_ms"]["mean"], rel=0.05)


def test_request_overheads_spread_about_their_mean() -> None:
    # one request a second, each alone: its TTFT is the overhead plus a 10 ms prefill
    work = workload(np.arange(400.0), 100, 2)
    options = SimOptions(fast=False, request_overhead_s=0.1, request_jitter=0.3)
    rec = SimCluster(toy_config(0, 1), book(toy_profile(STEP)), work, options).run()
    overhead = np.array([r.ttft_s for r in rec.recorder.records()]) - 0.010
    assert overhead.mean() == pytest.approx(0.1, rel=0.05)
    assert np.log(overhead).std() == pytest.approx(0.3, rel=0.1)
    with pytest.raises(InvalidArgumentError, match="request_jitter"):
        SimOptions(request_jitter=math.nan)


def test_noise_is_a_profile_field_and_the_calibration_can_leave_it_out() -> None:
    profile = toy_profile(dataclasses.replace(STEP, jitter=0.12, jitter_s=0.3))
    assert profile_from_json(profile.to_json()).step == profile.step
    raw = profile.to_json()
    raw["step"]["jitter"] = -0.1
    with pytest.raises(InvalidArgumentError, match=r"step\.jitter"):
        profile_from_json(raw)
    noisy = Overhead(LiveFit(jitter=0.1, jitter_s=0.2), {"decode": LiveFit(jitter=0.3)})
    quiet = noisy.quiet()
    assert quiet.live.jitter == quiet.live.jitter_s == quiet.role_live["decode"].jitter == 0.0
    assert quiet.live.compute_scale == noisy.live.compute_scale


def test_a_point_with_noise_is_the_mean_of_its_draws() -> None:
    args = ValidateOptions(num_requests=40, seed=0)
    ns = bench_flags(["--prompt-len", "200", "--output-len", "16", "--arrival", "poisson"], args)
    noisy = Overhead(LiveFit(jitter=0.2, jitter_s=0.05), request_s=0.02)
    bk = book(toy_profile(STEP))
    draws = [simulate_once(TOY_YAML, bk, ns, 20.0, noisy, seed) for seed in range(3)]
    assert len({d["ttft_ms"]["p90"] for d in draws}) == 3  # each seed, its own draws
    mean = simulate(TOY_YAML, bk, ns, 20.0, noisy, draws=3)
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p90"):
            assert mean[metric][q] == pytest.approx(np.mean([d[metric][q] for d in draws]))
    assert mean["noise_draws"] == 3 and mean["num_requests"] == draws[0]["num_requests"]
    assert simulate(TOY_YAML, bk, ns, 20.0, noisy) == draws[0]  # one draw: seed 0
