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

import pytest

from pdserve.sim.validate import (
    Point,
    calibrate,
    calibration_args,
    compare_point,
    measure,
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
