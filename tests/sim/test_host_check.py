"""``sim-validate --host-check``: each role's steps scaled by how much slower its engine
ran a short check before a point's run than the same requests in the calibration."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.core.messages import StepRecord
from pdserve.sim.calibrate import (
    Overhead,
    calibration_args,
    host_check_args,
    host_check_baseline,
    rescaled,
    simulate,
)
from pdserve.sim.live import LiveFit, Measured
from pdserve.sim.validate import Point, cmd_sim_validate, setup_profiles, workload_args
from tests.sim.helpers import keep_file, step_timeline


def test_host_checks_scale_each_roles_steps_by_the_hosts_drift(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The calibration's single long requests ran their steps at the fitted model; the
    # check before the point's run ran the same requests 1.25x slower on the prefill
    # and 1.1x on the decode: the point is simulated again with steps that much longer.
    from pdserve.deploy.cli import build_parser

    args = build_parser().parse_args(
        ["sim-validate", "--model", "builtin:tiny", "--points", "disaggregated:long:0.5",
         "--num-requests", "12", "--out", str(tmp_path), "--name", "checked", "--host-check"]
    )  # fmt: skip
    point = Point.parse(args.points[0])
    text, book = setup_profiles(point.setup, args)
    model = book.profiles[0].step
    cal = calibration_args(args, point.setup)
    runs = [*cal, host_check_args(args), (workload_args(point, args), point.rate)]
    real = [Measured(simulate(text, book, ns, rate, Overhead()), {}) for ns, rate in runs]

    def steps(prefill: float, decode: float) -> dict[str, list[StepRecord]]:
        shapes = {"prefill0": [((1024,), (0,))] * 4,
                  "decode1": [((1,), (1024 + i,)) for i in range(31)] * 4}  # fmt: skip
        return {name: step_timeline(model, shape, 0.0, LiveFit(r, r), [False] * len(shape))
                for (name, shape), r in zip(shapes.items(), (prefill, decode), strict=True)}  # fmt: skip

    base = host_check_baseline(cal)
    real[base] = Measured(real[base].summary, steps(1.0, 1.0))
    real[len(cal)] = Measured(real[len(cal)].summary, steps(1.25, 1.1))
    keep_file(args, tmp_path, point.setup, text, book, runs, real)
    assert cmd_sim_validate(args) == 0
    (row,) = json.loads((tmp_path / "checked.json").read_text())["points"]
    assert row["host_factors"] == pytest.approx({"prefill": 1.25, "decode": 1.1}, rel=0.01)
    slower = row["sim_host_checked"]
    assert slower["ttft_ms"]["p50"] > 1.1 * row["sim"]["ttft_ms"]["p50"]
    assert slower["tpot_ms"]["p50"] > 1.05 * row["sim"]["tpot_ms"]["p50"]
    assert set(row["compare_host_checked"]) == set(row["compare"])
    # the steps of each role, that many times as long; the fit of all, by their mean
    overhead = Overhead(LiveFit(1.0, 2.0, 0.001), {"decode": LiveFit(0.5, 1.0)})
    again = rescaled(overhead, {"decode": 1.2, "prefill": 1.4})
    assert again.role_live["decode"] == LiveFit(0.6, 1.2)
    assert dataclasses.astuple(again.live) == pytest.approx(
        dataclasses.astuple(LiveFit(1.3, 2.6, 0.0013))
    )
    assert rescaled(overhead, {}) == overhead
