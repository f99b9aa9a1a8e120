"""One validation point of the simulator against a real local cluster, in CI.

``pdserve sim-validate`` measures six points (``bench/RESULTS.md``); this runs
one small one: builtin:tiny disaggregated (a prefill and a decode instance),
1,024-token prompts at 0.5 req/s, after the same calibration (single requests,
then bursts of 8). The tolerance is what this 2-core machine reaches, not the
10%/15% the simulator aims at: the router, the load generator and Ray share
the cores with the engines, which the simulator models only as calibrated
overheads.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from pdserve.sim.validate import (
    Overhead,
    Point,
    calibrate,
    calibration_args,
    compare_point,
    measure,
    nonnegative_lstsq,
    setup_profiles,
    simulate,
    workload_args,
)

TOLERANCE = 0.40  # |sim - real| / real for TTFT and TPOT p50 at this point, on 2 shared cores
# (measured here: TTFT p50 -10%, TPOT p50 -22%; the simulator is optimistic, see RESULTS)


@pytest.mark.slow
def test_simulated_p50s_are_near_the_measured_ones(ray_session) -> None:
    args = argparse.Namespace(model="builtin:tiny", cores=[0, 1], num_requests=12, seed=0,
                              length_scale=0.25, calibration_requests=8)  # fmt: skip
    point = Point("disaggregated", "long", 0.5)
    text, book = setup_profiles(point.setup, args)
    cal, ns = calibration_args(args), workload_args(point, args)
    *real_cal, real = measure(text, point.setup, [*cal, (ns, point.rate)], args)
    assert real["num_ok"] == real["num_requests"] == 12
    overhead = calibrate(text, book, real_cal, cal)
    sim = simulate(text, book, ns, point.rate, overhead)
    result = compare_point(real, sim)
    for key in ("ttft_p50", "tpot_p50"):
        c = result[key]
        assert c["error"] is not None and abs(c["error"]) <= TOLERANCE, (key, c, overhead)


def test_nonnegative_lstsq_keeps_what_it_can_and_zeroes_the_rest() -> None:
    a = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert nonnegative_lstsq(a, a @ np.array([2.0, 3.0, 0.0])) == pytest.approx([2, 3, 0])
    # The unconstrained answer has a negative second part: it is 0, the first refitted.
    assert nonnegative_lstsq(a, np.array([2.0, -1.0, 1.5])) == pytest.approx([1.75, 0, 0])


def test_calibration_recovers_the_overheads_a_simulated_system_has() -> None:
    args = argparse.Namespace(model="builtin:tiny", cores=[0, 1], num_requests=12, seed=0,
                              length_scale=0.25, calibration_requests=8)  # fmt: skip
    text, book = setup_profiles("disaggregated", args)
    cal = calibration_args(args)
    truth = Overhead(step_s=0.002, seq_s=0.0003, handoff_s=0.015, request_s=0.030)
    got = calibrate(text, book, [simulate(text, book, ns, rate, truth) for ns, rate in cal], cal)
    for name in ("step_s", "seq_s", "handoff_s", "request_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.1, abs=1e-4), name
