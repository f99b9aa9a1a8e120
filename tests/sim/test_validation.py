"""One validation point of the simulator against a real local cluster, in CI.

``pdserve sim-validate`` measures six points (``docs/results/simulator.md``); this runs
one small one: builtin:tiny disaggregated (a prefill and a decode instance),
1,024-token prompts arriving at 0.5 req/s (Poisson), after the same calibration
with the engines' steps traced. One of its runs sends the same prompts one at
a time (fixed gaps), so what this point adds to it is the queueing of random
arrivals and the end-to-end path: measure, trace, calibrate, simulate. The tolerance is what this
2-core machine reaches, not the 10%/15% the simulator aims at: the router, the
load generator and Ray share the cores with the engines and slow their steps in
proportion to the load (on two cores a decode step beside a prefill step ran
1.4-1.9x its profile against 1.2-1.4x alone, docs/results/simulator.md), which a calibration at
low load cannot see; and two measured runs of one point differ by up to 32%
themselves (docs/results/simulator.md, "The real system against itself").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.messages import StepRecord
from pdserve.sim.calibrate import (
    Overhead,
    beside_fits,
    calibrate,
    calibration_args,
    role_fits,
    simulate,
)
from pdserve.sim.figures import mean_figures
from pdserve.sim.fit import nonnegative_lstsq
from pdserve.sim.live import (
    LiveFit,
    Measured,
    cold_flags,
    kind_ratios,
    live_fit,
    loop_periods,
    predicted,
    scaled,
    shared_flags,
    slow_share,
    step_kinds,
)
from pdserve.sim.profile import MAX_FACTOR, StepModel
from pdserve.sim.validate import cmd_sim_validate
from pdserve.sim.validate_compare import per_point
from pdserve.sim.validate_measure import measure, setup_profiles
from pdserve.sim.validate_options import ValidateOptions
from pdserve.sim.validate_points import Point, workload_args
from pdserve.sim.validate_report import (
    compare_point,
    failed_lines,
    point_row,
    repeat_table,
)
from tests.sim.helpers import step_timeline, tiny_setup

# |sim - real| / real for TTFT and TPOT p50 at this point, on 2 shared cores: 8 requests,
# measured before and after calibration runs of 4 (until 2026-12-03: once after them); a CI run of 12 after runs of 8 measured TTFT
# p50 0.42 off (sim 114.9 ms, real 80.9 ms); 8 after 4 here: 0.07 and 0.03
TOLERANCE = 0.50


def _tiny_args() -> ValidateOptions:
    """The options of a small validation of the tiny model: 8 requests a point after
    calibration runs of 4, on cores 0 and 1."""
    return ValidateOptions(
        model="builtin:tiny",
        cores=[0, 1],
        num_requests=8,
        seed=0,
        length_scale=0.25,
        calibration_requests=4,
    )


@pytest.mark.slow
def test_simulated_p50s_are_near_the_measured_ones(ray_session) -> None:
    args = _tiny_args()
    point = Point("disaggregated", "long", 0.5)
    text, book = setup_profiles(point.setup, args)
    cal, ns = calibration_args(args), workload_args(point, args)
    # The point runs once before the calibration and once after it: the two runs' spread
    # then holds how far this host drifted over the calibration it is judged against
    # (two runs after it missed that: a clean-clone CI run fitted 108 ms per request in a
    # slow spell, and the point, run once the host was fast again, measured TTFT p50
    # 121 ms against the simulation's 243 ms, with 8% between its two runs).
    before, *real_cal, after = measure(
        text, point.setup, [(ns, point.rate), *cal, (ns, point.rate)], args
    )
    for run in (before, after):
        assert run.summary["num_ok"] == run.summary["num_requests"] == 8
        # both engines' steps were traced: the prefill ran the prompts, decode the rest
        assert {Measured.role_of(name) for name in run.steps} == {"prefill", "decode"}
    prompts = [r for name, rs in after.steps.items() if name.startswith("prefill") for r in rs]
    assert sum(sum(r.new_tokens) for r in prompts) >= 8 * 1024 - 8 * 16  # less cache hits
    overhead = calibrate(
        text, book, [m.summary for m in real_cal], cal, Measured.role_traces(real_cal)
    )
    assert overhead.live.steps > 0 and overhead.live.memory_scale > 0
    assert set(overhead.role_live) == {"prefill", "decode"}  # as sim-validate fits them
    sim = simulate(text, book, ns, point.rate, overhead)
    result = compare_point(mean_figures([before.summary, after.summary]), sim)
    itself = compare_point(before.summary, after.summary)  # the real system against itself
    for key in ("ttft_p50", "tpot_p50"):
        c, spread = result[key], abs(itself[key]["error"] or 0.0)
        # judged beside the real system's own spread over the calibration's span: two
        # runs of one point differ by up to 82% on two loaded cores
        bound = max(TOLERANCE, 2 * spread)
        assert c["error"] is not None and abs(c["error"]) <= bound, (key, c, spread, overhead)


def test_live_fit_recovers_the_scales_and_offset_of_slower_steps() -> None:
    model = StepModel(overhead_s=0.003, s_per_token=2e-4, s_per_ctx=4e-7)
    shapes = [((1,) * b, (c,) * b) for b in (1, 4, 16) for c in (64, 512)]
    shapes += [((n,), (0,)) for n in (16, 256, 1024)]
    records = [StepRecord(0.0, 0.0, new, cached) for new, cached in shapes]
    compute = StepModel(s_per_token=2e-4)  # the compute part of the model's time
    times, computes = predicted(model, records), predicted(compute, records)
    # prefill-heavy steps slowed more than the rest: 1.6x compute, 1.2x the rest; every
    # fourth step starts after the instance idled (a second), and takes 1.5x that
    fitted = [1.6 * c + 1.2 * (t - c) + 0.0005 for t, c in zip(times, computes, strict=True)]
    slower, now = [], 0.0
    for i, (r, t) in enumerate(zip(records * 3, fitted * 3, strict=True)):
        cold = i % 4 == 0
        now += 1.0 if cold else 0.0  # the next loop turn at once, or after a second
        slower.append(dataclasses.replace(r, start_s=now, seconds=t * (1.5 if cold else 1.0)))
        now += slower[-1].seconds
    assert sum(cold_flags(model, slower)) == 7  # of 27
    fit = live_fit(model, [slower])
    got = (fit.compute_scale, fit.memory_scale, fit.offset_s, fit.cold_compute, fit.cold_factor)
    assert got == pytest.approx((1.6, 1.2, 0.0005, 0.5, 0.5), rel=0.02)
    assert fit.steps == len(slower)
    again = live_fit(scaled(model, fit), [slower])
    assert (again.compute_scale, again.memory_scale, again.offset_s) == pytest.approx(
        (1.0, 1.0, 0.0), abs=0.02
    )
    # a model with no compute terms: one scale for both parts
    flat = StepModel(overhead_s=0.003, s_per_ctx=4e-7)
    same = [
        dataclasses.replace(r, seconds=1.3 * t)
        for r, t in zip(records, predicted(flat, records), strict=True)
    ]
    one = live_fit(flat, [same])
    assert (one.compute_scale, one.memory_scale) == pytest.approx((1.3, 1.3))
    assert live_fit(model, []) == LiveFit()
    # steps whose times fall as their batches grow (a loaded host): one scale, their
    # mean ratio to the model, and their noise about it, not the profile unchanged
    decodes = [StepRecord(0.0, 0.0, (1,) * b, (256,) * b) for b in (1, 4, 16, 64) * 4]
    falling = [
        dataclasses.replace(r, start_s=0.05 * i, seconds=0.02 - 2e-4 * len(r.new_tokens))
        for i, r in enumerate(decodes)
    ]
    odd = live_fit(model, [falling])
    ratio = np.array([r.seconds for r in falling]) / predicted(model, falling)
    assert odd.compute_scale == odd.memory_scale > 1.0 and odd.offset_s == 0.0
    assert ratio.min() < odd.compute_scale < ratio.max() and odd.jitter > 0


def test_a_loop_turn_is_a_step_and_the_gap_after_it() -> None:
    # steps of 10 ms, 2 ms apart, then a second idle: the step before the idle
    # takes the instance's usual 2 ms gap, not the second
    trace = [StepRecord(t, 0.010, (1,), (8,)) for t in (0.0, 0.012, 0.024, 1.034, 1.046)]
    periods = [r.seconds for r in loop_periods(trace)]
    assert periods == pytest.approx([0.012] * 5)
    assert list(cold_flags(StepModel(), loop_periods(trace))) == [True, False, False, True, False]


def test_steps_by_kind_say_which_kind_the_model_missed() -> None:
    # an instance idles, then runs chunks 1.0x the model, chunks beside a decode row
    # 1.2x and decode steps 1.5x, all back to back; its first step starts cold
    model = StepModel(
        overhead_s=0.003, s_per_token=2e-4, s_per_ctx=4e-7, cold_compute=1.0, cold_factor=1.0
    )
    shapes = [((256,), (0,)), ((256, 1), (256, 300)), ((1, 1), (512, 300))] * 4
    trace, now = [], 0.0
    for i, (new, cached) in enumerate(shapes):
        r = StepRecord(now, 0.0, new, cached)
        t = predicted(model, [r])[0] * ([1.0, 1.2, 1.5][i % 3] if i else 2.0)
        trace.append(dataclasses.replace(r, seconds=t))
        now += t
    kinds = kind_ratios(step_kinds(model, trace))
    assert kinds == {
        "decode": {"ratio": pytest.approx(1.5), "steps": 4},
        "chunks": {"ratio": pytest.approx(1.0), "steps": 3},
        "chunks with decode": {"ratio": pytest.approx(1.2), "steps": 4},
        "after idling": {"ratio": pytest.approx(1.0), "steps": 1},
    }
    # totals add up over runs: the same trace twice gives the same ratios, twice the steps
    run = Measured({}, {"decode0": trace})
    both = Measured.kinds([run, run], {}, model)["decode0"]
    assert {k: v["steps"] for k, v in both.items()} == {k: 2 * v["steps"] for k, v in kinds.items()}
    assert both["decode"]["ratio"] == pytest.approx(1.5)
    assert run.ratios({}, model)["decode0"]["kinds"] == kinds


def test_nonnegative_lstsq_keeps_what_it_can_and_zeroes_the_rest() -> None:
    a = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert nonnegative_lstsq(a, a @ np.array([2.0, 3.0, 0.0])) == pytest.approx([2, 3, 0])
    # The unconstrained answer has a negative second part: it is 0, the first refitted.
    assert nonnegative_lstsq(a, np.array([2.0, -1.0, 1.5])) == pytest.approx([1.75, 0, 0])
    # A bound: the first part wants 5; held at 4, the second takes up what it can.
    b = np.array([5.0, 1.0, 6.0])
    assert nonnegative_lstsq(a, b) == pytest.approx([5, 1, 0])
    assert nonnegative_lstsq(a, b, [4.0, None, None]) == pytest.approx([4, 1.5, 0])


def test_a_cold_factor_fitted_on_steps_with_no_compute_stays_within_bounds() -> None:
    # decode steps of almost no compute whose cold turns take 5 ms more: unbounded, the
    # cold compute factor explains that with hundreds of times the tiny compute part
    model = StepModel(overhead_s=0.002, s_per_token=1e-7, s_per_ctx=4e-7)
    trace, now = [], 0.0
    for i in range(40):
        cold = i % 5 == 0
        now += 1.0 if cold else 0.0
        r = StepRecord(now, 0.0, (1, 1), (400, 300) if i % 2 else (100, 50))
        t = predicted(model, [r])[0] + (0.005 if cold else 0.0)
        trace.append(dataclasses.replace(r, seconds=t))
        now += t
    fit = live_fit(model, [trace])
    assert 0 <= fit.cold_compute <= MAX_FACTOR and 0 <= fit.cold_factor <= MAX_FACTOR
    scaled(model, fit)  # a model the profile's checks accept


def test_calibration_recovers_the_overheads_a_simulated_system_has() -> None:
    args = _tiny_args()
    text, book = tiny_setup("disaggregated", args)
    cal = calibration_args(args)
    truth = Overhead(step_s=0.002, seq_s=0.0003, handoff_s=0.015, request_s=0.030)
    got = calibrate(text, book, [simulate(text, book, ns, rate, truth) for ns, rate in cal], cal)
    for name in ("step_s", "seq_s", "handoff_s", "request_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.1, abs=1e-4), name
    # a role's own step model (sim-validate's "own steps"): decode steps four times as
    # long leave the prefill's first token alone and slow every later one
    ns, rate = cal[0]
    slow_decode = dataclasses.replace(truth, role_live={"decode": LiveFit(4.0, 4.0, steps=1)})
    base, slow = (simulate(text, book, ns, rate, o) for o in (truth, slow_decode))
    assert slow["ttft_ms"]["p50"] == pytest.approx(base["ttft_ms"]["p50"], rel=0.01)
    assert slow["tpot_ms"]["p50"] > 1.3 * base["tpot_ms"]["p50"]


def _summary(ttft: tuple[float, float], tpot: tuple[float, float]) -> dict[str, Any]:
    return {
        "ttft_ms": {"p50": ttft[0], "p90": ttft[1]},
        "tpot_ms": {"p50": tpot[0], "p90": tpot[1]},
        "num_failed": 0,
    }


def test_a_repeated_point_is_compared_with_its_runs_mean_and_each_run_with_the_first() -> None:
    runs = [
        Measured(_summary((100, 200), (10, 20)), {}),
        Measured(_summary((120, 160), (12, 20)), {}),
    ]
    sim = _summary((110, 180), (11, 24))
    row = point_row("colocated:conv:1", sim, runs, StepModel())
    assert row["real_mean"] == {
        k: v for k, v in _summary((110, 180), (11, 20)).items() if k != "num_failed"
    }
    assert row["failed"] == {"real": [0, 0], "sim": 0}
    errors = {k: c["error"] for k, c in row["compare"].items()}
    assert errors == pytest.approx({"ttft_p50": 0, "ttft_p90": 0, "tpot_p50": 0, "tpot_p90": 0.2})
    assert not row["compare"]["tpot_p90"]["ok"]  # 20% over, against a 15% tolerance
    (apart,) = row["compare_runs"]
    assert {k: c["error"] for k, c in apart.items()} == pytest.approx(
        {"ttft_p50": 0.2, "ttft_p90": -0.2, "tpot_p50": 0.2, "tpot_p90": 0.0}
    )
    text = repeat_table([row])
    assert "1 of 4 figures within the tolerance" in text and "run 1 / run 2" in text
    # one run: compared with it, nothing about repeats
    once = point_row("colocated:conv:1", sim, runs[:1], StepModel())
    assert "compare_runs" not in once and once["compare"]["ttft_p50"]["error"] == pytest.approx(0.1)


def test_sim_validate_refuses_a_repeat_below_one() -> None:
    args = argparse.Namespace(
        points=["colocated:conv:1"], repeat=0, calibration_requests=1, model="builtin:tiny"
    )
    with pytest.raises(InvalidArgumentError, match="--repeat"):
        cmd_sim_validate(args)
    with pytest.raises(InvalidArgumentError, match="SETUP:WORKLOAD:RATE"):
        cmd_sim_validate(argparse.Namespace(points=["colocated"]))
    # a bad workload flag is refused before a cluster starts (no Ray here)
    from pdserve.deploy.cli import build_parser

    for flags, message in (
        (["--num-requests", "0"], "num_requests: must be >= 1"),
        (["--length-scale", "0"], "length_scale: must be > 0"),
        (["--calibration-requests", "0"], "--calibration-requests: must be at"),
        (["--cores", "0", "0"], "cores: must name distinct cores"),
        (["--noise-draws", "-1"], "--noise-draws: must be at least 0"),
    ):
        args = build_parser().parse_args(["sim-validate", "--points", "colocated:conv:1", *flags])
        with pytest.raises(InvalidArgumentError, match=message):
            cmd_sim_validate(args)


def test_rounds_of_points_are_grouped_back_by_point() -> None:
    # what validate() measures: every point in turn, then again
    rounds = ["conv:0.3", "conv:2", "long:1"] * 3
    measured = [Measured({"n": i, "point": p}, {}) for i, p in enumerate(rounds)]
    grouped = per_point(measured, 3)
    assert [[m.summary["point"] for m in runs] for runs in grouped] == [
        ["conv:0.3"] * 3,
        ["conv:2"] * 3,
        ["long:1"] * 3,
    ]
    assert [m.summary["n"] for m in grouped[1]] == [1, 4, 7]  # in the order they ran


def test_a_run_kept_with_its_traces_reads_back_as_it_was() -> None:
    steps = {"prefill0": [StepRecord(1.5, 0.02, (256, 1), (0, 300))], "decode1": []}
    run = Measured(_summary((100, 200), (10, 20)), steps)
    again = Measured.from_json(json.loads(json.dumps(run.to_json())))
    assert again == run


def test_each_role_gets_the_fit_of_its_own_steps_beside_the_other_roles() -> None:
    # a prefill and a decode instance on one host slow differently, alone and beside
    # each other; one fit of both steps cannot say so, a fit per role does
    model = StepModel(overhead_s=0.003, s_per_token=2e-4, s_per_ctx=4e-7)
    prefill = [((n,), (c,)) for n in (64, 256, 1024) for c in (0, 512)] * 4
    decode = [((1,) * b, (c,) * b) for b in (1, 4, 16) for c in (64, 1024)] * 60
    truth = {
        "prefill": LiveFit(1.5, 1.1, shared_compute=0.3, shared_factor=0.2),
        "decode": LiveFit(1.2, 1.3, shared_compute=0.4, shared_factor=0.6),
    }
    flags = {"prefill": [False] * len(prefill), "decode": [False] * len(decode)}
    for _ in range(20):  # until who is beside whom no longer changes the steps' times
        p = step_timeline(model, prefill, 0.0, truth["prefill"], flags["prefill"])
        d = step_timeline(model, decode, p[len(p) // 2].start_s, truth["decode"], flags["decode"])
        again = {"prefill": list(shared_flags(p, [d])), "decode": list(shared_flags(d, [p]))}
        if again == flags:
            break
        flags = again
    assert flags == again and all(0 < sum(f) < len(f) for f in flags.values()), flags
    fits = role_fits(model, {"prefill": [p], "decode": [d]})
    assert set(fits) == {"prefill", "decode"}
    for role, fit in fits.items():
        want = truth[role]
        got = (fit.compute_scale, fit.memory_scale, fit.shared_compute, fit.shared_factor)
        assert got == pytest.approx(
            (want.compute_scale, want.memory_scale, want.shared_compute, want.shared_factor),
            rel=0.05,
            abs=0.01,
        ), role
    # pooled, neither role's steps come out right
    pooled = live_fit(model, [p, d])
    assert not any(
        pooled.compute_scale == pytest.approx(t.compute_scale, rel=0.05)
        and pooled.memory_scale == pytest.approx(t.memory_scale, rel=0.05)
        for t in truth.values()
    )
    assert role_fits(model, {"decode": [d]}) == {}  # one role: the pooled fit stands
    # a live run's fits (sim-planners --live): per role where both ran steps ...
    pooled, fits = beside_fits(model, {"prefill": [p], "decode": [d]})
    assert pooled == live_fit(model, [p, d]) and fits == role_fits(
        model, {"prefill": [p], "decode": [d]}
    )
    # ... one role alone (colocated) the fit of its steps, not its profile ...
    pooled, fits = beside_fits(model, {"decode": [d]})
    assert fits["decode"] == pooled == live_fit(model, [d]) != LiveFit()
    fitted = scaled(model, fits["decode"])  # its steps' total time, not the profile's
    lived = [r.seconds for r in loop_periods(d)]
    assert predicted(fitted, loop_periods(d)).sum() == pytest.approx(sum(lived), rel=0.12)
    assert predicted(model, loop_periods(d)).sum() < 0.8 * sum(lived)
    # ... and a role that ran no step keeps its profile
    assert fits["prefill"] == LiveFit()
    assert beside_fits(model, {"prefill": [], "decode": [d]})[1]["prefill"] == LiveFit()


def test_steps_in_episodes_of_a_slower_host_are_counted() -> None:
    # 200 s of steps, one every 0.1 s at their model's time, but 40 s of them (two
    # 20-s windows) at twice it: a fifth of the steps ran in slow windows. A window
    # at 1.2x, as a step beside another instance's runs, is not slow.
    starts = np.arange(0.0, 200.0, 0.1)
    ratios = np.ones_like(starts)
    ratios[(starts >= 60) & (starts < 100)] = 2.0
    ratios[(starts >= 140) & (starts < 160)] = 1.2
    assert slow_share(ratios, starts) == pytest.approx(0.2)
    assert slow_share(np.ones_like(starts), starts) == 0.0
    assert slow_share(np.array([]), np.array([])) == 0.0


def test_a_closed_loop_point_holds_arrivals_in_the_simulation_as_the_load_generator_does() -> None:
    point = Point.parse("disaggregated:long:50:c1")
    assert point == Point("disaggregated", "long", 50.0, 1)
    assert point.name == "disaggregated:long:50:c1"
    assert Point.parse("colocated:conv:0.3").concurrency is None
    limited = Point.parse("colocated:long:3:t6.5:c2")  # either order
    assert (limited.concurrency, limited.timeout_s) == (2, 6.5)
    assert limited.name == "colocated:long:3:c2:t6.5" and Point.parse(limited.name) == limited
    for bad in (
        "colocated:conv:1:4",
        "colocated:conv:1:c0",
        "colocated:conv:inf:c2",
        "colocated:conv:1:c2:x",
        "colocated:conv:1:cx",
        "colocated:conv:1:c2:c3",
        "colocated:conv:1:t0",
        "colocated:conv:1:tinf",
        "colocated:conv:1:t",
        "colocated:conv",
    ):
        with pytest.raises(InvalidArgumentError, match="point"):
            Point.parse(bad)
    args = _tiny_args()
    closed = workload_args(point, args)
    assert closed.max_concurrency == 1
    assert workload_args(limited, args).request_timeout == 6.5
    text, book = tiny_setup(point.setup, args)
    # 50 req/s is far past what the instances serve: open, the prompts queue and TTFT
    # grows with each; closed at one in flight, each request is sent when the one
    # before ends and its TTFT is a lone prefill's
    opened = workload_args(Point("disaggregated", "long", 50.0), args)
    lone = simulate(text, book, opened, 0.01, Overhead())["ttft_ms"]["p50"]
    open_run = simulate(text, book, opened, 50.0, Overhead())
    closed_run = simulate(text, book, closed, 50.0, Overhead())
    assert closed_run["ttft_ms"]["p90"] == pytest.approx(lone, rel=0.05)
    assert open_run["ttft_ms"]["p90"] > 3 * lone
    assert closed_run["window_s"] > open_run["window_s"]


def test_the_report_names_failed_requests_where_either_side_had_them() -> None:
    runs = [Measured({**_summary((100, 200), (10, 20)), "num_failed": n}, {}) for n in (5, 7)]
    sim = {
        **_summary((110, 180), (11, 24)),
        "num_failed": 6,
        "errors": {"DEADLINE_EXCEEDED: Deadline Exceeded": 6},
    }
    row = point_row("colocated:long:3:t6", sim, runs, StepModel())
    once = [Measured(_summary((1, 2), (1, 2)), {})]
    quiet = point_row("colocated:long:1", _summary((1, 2), (1, 2)), once, StepModel())
    assert failed_lines([row, quiet]) == [
        "colocated:long:3:t6: failed requests, real 5, 7 / sim 6 "
        "(6 DEADLINE_EXCEEDED: Deadline Exceeded)"
    ]
