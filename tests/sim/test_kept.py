"""``pdserve sim-validate --from-traces``: runs kept by ``--keep-traces`` calibrated and
simulated again without measuring, and the calibration taken around the points. The
"measured" runs are simulations with known overheads, so the calibration must recover
those."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.calibrate import Overhead, calibration_args, simulate
from pdserve.sim.live import Measured
from pdserve.sim.validate import cmd_sim_validate
from pdserve.sim.validate_points import Point, workload_args
from tests.sim.helpers import keep_file, tiny_setup, typed


def _validate_args(out: Path, name: str, flag: str) -> argparse.Namespace:
    """``pdserve sim-validate`` of one disaggregated point of the tiny model (12 requests),
    written to ``out`` as ``name``, with ``flag``."""
    from pdserve.deploy.cli import build_parser

    point = ["--points", "disaggregated:long:0.5", "--num-requests", "12"]
    argv = ["sim-validate", "--model", "builtin:tiny", *point, "--out", str(out), "--name", name]
    return build_parser().parse_args([*argv, flag])


def test_kept_runs_are_calibrated_and_simulated_again_without_measuring(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # "Measured" runs that a simulated system with known overheads gave: calibrated
    # again from the kept file, the overheads come back and the point matches.
    args = _validate_args(tmp_path, "again", "--keep-traces")
    point = Point.parse(args.points[0])
    text, book = tiny_setup(point.setup, typed(args))
    truth = Overhead(step_s=0.002, seq_s=0.0003, handoff_s=0.015, request_s=0.030)
    runs = [
        *calibration_args(typed(args), point.setup),
        (workload_args(point, typed(args)), point.rate),
    ]
    real = [Measured(simulate(text, book, ns, rate, truth), {}) for ns, rate in runs]
    setups = keep_file(args, tmp_path, point.setup, text, book, runs, real)
    assert cmd_sim_validate(args) == 0
    out = json.loads((tmp_path / "again.json").read_text())
    fitted = out["calibration"][point.setup]
    assert fitted["handoff_overhead_ms"] == pytest.approx(15.0, rel=0.1)
    assert fitted["request_overhead_ms"] == pytest.approx(30.0, rel=0.1)
    (row,) = out["points"]
    assert all(abs(c["error"]) < 0.02 for c in row["compare"].values()), row["compare"]
    rewritten = json.loads((tmp_path / "again-traces.json").read_text())["setups"]
    assert rewritten == json.loads(json.dumps(setups))  # what it ran on, kept again
    args.repeat = 2  # the file holds one round of the point, not two
    with pytest.raises(
        InvalidArgumentError,
        match=r"--from-traces.*holds 7 disaggregated runs, these flags measure 8",
    ):
        cmd_sim_validate(args)
    args.repeat, args.calibration_requests = 1, 4  # the same number of runs, other workloads
    with pytest.raises(InvalidArgumentError, match=r"run 1 was measured with other num_requests"):
        cmd_sim_validate(args)
    del setups[point.setup]["workloads"]  # a file that does not say what its runs were
    unlabelled = tmp_path / "old.json"
    unlabelled.write_text(json.dumps({"setups": setups}))
    args.from_traces, args.calibration_requests = str(unlabelled), 8
    with pytest.raises(InvalidArgumentError, match=r"records no workloads of its runs"):
        cmd_sim_validate(args)


def test_calibrating_around_the_points_fits_the_runs_before_and_after_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the host sped up over the points: the calibration runs before them ran with 4 ms
    # more a step and 20 ms less a request than those after; the fit of both lands
    # between the two
    args = _validate_args(tmp_path, "around", "--calibrate-around")
    point = Point.parse(args.points[0])
    text, book = tiny_setup(point.setup, typed(args))
    cal = calibration_args(typed(args), point.setup)
    runs = [*cal, (workload_args(point, typed(args)), point.rate), *cal]
    slow, fast = Overhead(step_s=0.006, request_s=0.03), Overhead(step_s=0.002, request_s=0.05)
    truth = [slow] * len(cal) + [fast] * (1 + len(cal))
    real = [
        Measured(simulate(text, book, ns, rate, o), {})
        for (ns, rate), o in zip(runs, truth, strict=True)
    ]
    keep_file(args, tmp_path, point.setup, text, book, runs, real)
    assert cmd_sim_validate(args) == 0
    out = json.loads((tmp_path / "around.json").read_text())
    fitted = out["calibration"][point.setup]
    assert fitted["around"] and len(fitted["calibration"]) == 2 * len(cal)
    # between 2 and 6 (each run's gap relative to its TPOT: the faster runs' weigh more)
    assert 2.5 <= fitted["step_overhead_ms"] <= 5.5
    assert fitted["request_overhead_ms"] == pytest.approx(40.0, rel=0.15)  # 30 and 50
    (row,) = out["points"]  # the point is the one run between the calibrations
    assert row["real"] == json.loads(json.dumps(real[len(cal)].summary))
    args.calibrate_around = False  # the file holds the calibration twice
    held, measured = 2 * len(cal) + 1, len(cal) + 1
    with pytest.raises(InvalidArgumentError, match=rf"holds {held} .* flags measure {measured}"):
        cmd_sim_validate(args)
