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
from pdserve.sim.validate import cmd_sim_validate
from pdserve.sim.validate_points import Point, workload_args
from tests.sim.helpers import keep_file, step_timeline, tiny_setup, typed


def sim_args(out, repeat: int = 1, around: bool = False):  # type: ignore[no-untyped-def]
    from pdserve.deploy.cli import build_parser

    return build_parser().parse_args(
        [
            "sim-validate",
            "--model",
            "builtin:tiny",
            "--points",
            "disaggregated:long:3",
            "--num-requests",
            "12",
            "--calibration-requests",
            "3",
            "--out",
            str(out),
            "--name",
            "checked",
            "--host-check",
            "--repeat",
            str(repeat),
            *(["--calibrate-around"] if around else []),
        ]
    )


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The disaggregated setup's cluster and its fixed profile (TINY_STEP), once for the module."""
    return tiny_setup("disaggregated", typed(sim_args(tmp_path_factory.mktemp("profiles"))))


def checked_row(tmp_path, checks: list[tuple[float, float]], profiles, after=None):  # type: ignore[no-untyped-def]
    """The row of ``disaggregated:long:3`` measured once per entry of ``checks``, each
    run after a host check that ran the prefill's and the decode's steps that many times
    slower than the calibration (whose single long requests ran at the profile's
    model); ``profiles``: the setup's cluster and profiles (measured here: keep one for
    rows compared with each other); ``after``: the calibration measured again after
    the points (``--calibrate-around``), its long requests that many times slower."""
    out = tmp_path / str(len(list(tmp_path.iterdir())))
    args = sim_args(out, len(checks), after is not None)
    point = Point.parse(args.points[0])
    text, book = profiles
    model = book.profiles[0].step
    cal = calibration_args(typed(args), point.setup)
    rounds = [host_check_args(typed(args)), (workload_args(point, typed(args)), point.rate)] * len(
        checks
    )
    runs = [*cal, *rounds, *(cal if after is not None else [])]
    real = [Measured(simulate(text, book, ns, rate, Overhead()), {}) for ns, rate in runs]

    def steps(prefill: float, decode: float) -> dict[str, list[StepRecord]]:
        shapes = {
            "prefill0": [((1024,), (0,))] * 4,
            "decode1": [((1,), (1024 + i,)) for i in range(31)] * 4,
        }
        return {
            name: step_timeline(model, shape, 0.0, LiveFit(r, r), [False] * len(shape))
            for (name, shape), r in zip(shapes.items(), (prefill, decode), strict=True)
        }

    base = host_check_baseline(cal)
    real[base] = Measured(real[base].summary, steps(1.0, 1.0))
    for run, factors in enumerate(checks):
        check = len(cal) + 2 * run
        real[check] = Measured(real[check].summary, steps(*factors))
    if after is not None:
        again = len(cal) + len(rounds) + base
        real[again] = Measured(real[again].summary, steps(*after))
    out.mkdir()
    keep_file(args, out, point.setup, text, book, runs, real)
    assert cmd_sim_validate(args) == 0
    (row,) = json.loads((out / "checked.json").read_text())["points"]
    return row


def test_host_checks_scale_each_roles_steps_by_the_hosts_drift(tmp_path, profiles) -> None:  # type: ignore[no-untyped-def]
    # The check before the point's run ran the calibration's requests 1.25x slower on
    # the prefill and 1.1x on the decode: the point is simulated again with steps that
    # much longer.
    row = checked_row(tmp_path, [(1.25, 1.1)], profiles)
    (factors,) = row["host_factors"]
    assert factors == pytest.approx({"prefill": 1.25, "decode": 1.1}, rel=0.01)
    slower = row["sim_host_checked"]
    assert slower["ttft_ms"]["p50"] > 1.1 * row["sim"]["ttft_ms"]["p50"]
    assert slower["tpot_ms"]["p50"] > 1.05 * row["sim"]["tpot_ms"]["p50"]
    assert set(row["compare_host_checked"]) == set(row["compare"])


def test_each_run_is_simulated_on_its_own_hosts_drift(tmp_path, profiles) -> None:  # type: ignore[no-untyped-def]
    # Two runs of a point, the second on a host 1.7x slower: each run is simulated with
    # the steps of its own check and the figures averaged, not once at the mean factor.
    quick = checked_row(tmp_path, [(1.0, 1.0)], profiles)
    slow = checked_row(tmp_path, [(1.7, 1.7)], profiles)
    both = checked_row(tmp_path, [(1.0, 1.0), (1.7, 1.7)], profiles)
    assert [f["prefill"] for f in both["host_factors"]] == pytest.approx([1.0, 1.7], rel=0.01)
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p90"):
            runs = [row["sim_host_checked"][metric][q] for row in (quick, slow)]
            assert both["sim_host_checked"][metric][q] == pytest.approx(sum(runs) / 2)


def test_with_the_calibration_around_the_points_checks_compare_with_both(
    tmp_path, profiles
) -> None:  # type: ignore[no-untyped-def]
    # The calibration ran the long requests at the model's time before the points and
    # 1.4x slower after them; the fit took both. A check 1.2x slower than the first
    # ran as fast as the calibration did on average: no drift to correct.
    row = checked_row(tmp_path, [(1.2, 1.2)], profiles, after=(1.4, 1.4))
    (factors,) = row["host_factors"]
    assert factors == pytest.approx({"prefill": 1.0, "decode": 1.0}, rel=0.03)


def test_rescaled_lengthens_each_roles_steps() -> None:
    # the steps of each role, that many times as long; the fit of all, by their mean
    overhead = Overhead(LiveFit(1.0, 2.0, 0.001), {"decode": LiveFit(0.5, 1.0)})
    again = rescaled(overhead, {"decode": 1.2, "prefill": 1.4})
    assert again.role_live["decode"] == LiveFit(0.6, 1.2)
    assert dataclasses.astuple(again.live) == pytest.approx(
        dataclasses.astuple(LiveFit(1.3, 2.6, 0.0013))
    )
    assert rescaled(overhead, {}) == overhead
