"""``sim-validate --write-profiles``: the calibration written as a profile (and the
cluster as YAML) that ``pdserve sim`` reads, giving the validation's own simulation."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.messages import StepRecord
from pdserve.sim.calibrate import (
    Overhead,
    calibration_args,
    host_check_baseline,
    simulate,
)
from pdserve.sim.live import LiveFit, Measured, shared_flags
from pdserve.sim.profile import load_profile, profile_from_json, save_profile
from pdserve.sim.validate import cmd_sim_validate
from pdserve.sim.validate_points import Point, workload_args
from tests.sim.helpers import keep_file, step_timeline, tiny_setup, typed


def noisy(records: list[StepRecord]) -> list[StepRecord]:
    """``records`` back to back again, each step's time off the model by a factor that
    wanders (the calibration fits its spread as the steps' noise)."""
    out, now = [], records[0].start_s
    for i, r in enumerate(records):
        t = r.seconds * math.exp(0.15 * math.sin(i / 3))
        out.append(StepRecord(now, t, r.new_tokens, r.cached_tokens))
        now += t
    return out


def beside_each_other(model, truth: LiveFit) -> dict[str, list[StepRecord]]:  # type: ignore[no-untyped-def]
    """A prefill instance's 8 chunks back to back and a decode instance's 248 steps
    from the start of its fifth chunk, on one host: a step that the other's steps
    cover is as much slower as ``truth``'s shared factors say (found by going round
    until the overlaps stop changing)."""
    shapes = [[((1024,), (0,))] * 8, [((1,), (1024 + i,)) for i in range(31)] * 8]
    flags = [[False] * len(s) for s in shapes]
    for _ in range(10):
        prefill = step_timeline(model, shapes[0], 0.0, truth, flags[0])
        decode = step_timeline(model, shapes[1], prefill[4].start_s, truth, flags[1])
        again = [list(shared_flags(prefill, [decode])), list(shared_flags(decode, [prefill]))]
        if again == flags:
            break
        flags = again
    assert 0 < sum(flags[0]) < 8 and 0 < sum(flags[1]) < 248  # both kinds of step in each
    return {"prefill0": noisy(prefill), "decode1": noisy(decode)}


def test_pdserve_sim_with_the_written_profile_gives_the_validations_simulation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.deploy.cli import build_parser

    args = build_parser().parse_args(
        [
            "sim-validate",
            "--model",
            "builtin:tiny",
            "--points",
            "disaggregated:long:2",
            "--num-requests",
            "12",
            "--out",
            str(tmp_path),
            "--name",
            "cal",
            "--noise-draws",
            "2",
            "--write-profiles",
        ]
    )
    point = Point.parse(args.points[0])
    text, book = tiny_setup(point.setup, typed(args))
    model = book.profiles[0].step
    cal = calibration_args(typed(args), point.setup)
    runs = [*cal, (workload_args(point, typed(args)), point.rate)]
    # the live system: 30 ms a request and 2 ms a step beyond the profiled steps
    live = Overhead(request_s=0.03, step_s=0.002)
    real = [Measured(simulate(text, book, ns, rate, live), {}) for ns, rate in runs]
    base = host_check_baseline(cal)
    # the engines' steps: slower than profiled, and slower still beside each other
    truth = LiveFit(1.2, 1.1, shared_compute=0.6, shared_factor=0.8)
    real[base] = Measured(real[base].summary, beside_each_other(model, truth))
    keep_file(args, tmp_path, point.setup, text, book, runs, real)
    assert cmd_sim_validate(args) == 0
    out = json.loads((tmp_path / "cal.json").read_text())
    (row,) = out["points"]
    written = out["calibration"][point.setup]["written"]
    profile = load_profile(written["profile"])
    assert profile.request_overhead_s > 0.01 and profile.one_host
    assert set(profile.role_steps) == {"prefill", "decode"}
    assert profile.role_steps["decode"].jitter > 0.05  # the steps' noise, fitted
    assert profile.role_steps["decode"].slows  # and how much a step beside another slows
    # the printed command, as a user runs it, simulates the point as the validation did
    from pdserve.sim.validate_points import sim_command

    command = shlex.split(sim_command(point, typed(args), written))[1:]
    sim = build_parser().parse_args(
        [*command, "--out", str(tmp_path), "--name", "again", "--no-plots"]
    )
    assert sim.func(sim) == 0
    (run,) = json.loads((tmp_path / "again.json").read_text())["runs"]
    assert run["summary"]["noise_draws"] == 2  # the mean of two draws, as the validation's
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p90"):
            assert run["summary"][metric][q] == pytest.approx(row["sim"][metric][q], rel=1e-6)


def test_a_calibrated_profile_round_trips_and_its_bad_fields_are_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.sim.profile import StepModel
    from tests.sim.helpers import toy_profile

    step = StepModel(overhead_s=0.001, s_per_token=1e-5)
    profile = toy_profile(step)
    raw = profile.to_json()
    raw.update(
        role_steps={"decode": {**raw["step"], "jitter": 0.2}},
        request_overhead_s=0.02,
        request_jitter=0.1,
        one_host=True,
    )
    again = profile_from_json(raw)
    assert again.role_steps["decode"].jitter == 0.2 and again.request_overhead_s == 0.02
    path = save_profile(again, tmp_path / "p.json")
    assert load_profile(path) == again
    for field, value, named in (
        ("role_steps", {"router": raw["step"]}, "role_steps"),
        ("role_steps", {"decode": {"jitter": -1}}, "role_steps.decode.jitter"),
        ("request_overhead_s", -0.5, "request_overhead_s"),
        ("request_jitter", "much", "request_jitter"),
    ):
        with pytest.raises(InvalidArgumentError) as e:
            profile_from_json({**raw, field: value})
        assert e.value.field == named
