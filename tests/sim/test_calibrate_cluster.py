"""``pdserve profile --config``: a profile calibrated on a cluster as it serves, which
``pdserve sim`` uses as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.deploy.cli import main
from pdserve.sim.calibrate_cluster import ClusterCalibration, calibrate_cluster, setup_of
from pdserve.sim.profile import load_profile, save_profile

CONFIG = """\
model: builtin:tiny
connector: shm
engine: {dtype: float32, max_num_batched_tokens: 256}
regions:
  - name: local
    prefill: {count: PREFILL, min: PREFILL, max: PREFILL, num_cpus_per_rank: 0.5,
              engine: {max_num_batched_tokens: 2048}}
    decode: {count: 1, min: 1, max: 1, num_cpus_per_rank: 0.5}
server: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
auth: {api_keys: [calibration-key]}
planner: {mode: "off"}
disaggregation: {local_prefill_max_tokens: 0}
"""


def _config(tmp_path: Path, prefill: int) -> Path:
    path = tmp_path / f"cluster-{prefill}p.yaml"
    path.write_text(CONFIG.replace("PREFILL", str(prefill)))
    return path


def test_the_calibrated_profile_simulates_its_runs_as_they_were_measured(
    ray_session, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, 1)
    opts = ClusterCalibration(str(config), calibration_requests=2)
    calibrated = calibrate_cluster(opts, "pdserve profile --config cluster.yaml")
    assert calibrated.setup == "disaggregated"
    assert len(calibrated.runs) == 6  # single, burst, short, steady, long, long beside decode
    assert all(run["num_ok"] == run["num_requests"] for run in calibrated.runs)  # the key worked
    profile = calibrated.profile
    # what a served request pays beyond its steps, and how the steps ran live, per role
    assert profile.request_overhead_s > 0 and profile.one_host
    assert set(profile.role_steps) == {"prefill", "decode"}
    path = save_profile(profile, tmp_path / "profile.json")
    assert load_profile(path) == profile  # pdserve sim reads it back as written

    # pdserve sim with that profile as it is, on the workload of the first calibration
    # run (one 256-token prompt at a time): its TTFT p50 is what the fit was given
    out = tmp_path / "sim"
    workload = ["--prompt-len", "256", "--output-len", "32", "--arrival", "fixed"]
    args = ["sim", "--config", str(config), "--profile", str(path), *workload]
    quiet = ["--noise-draws", "0"]  # the model's mean times, as the fit was made
    assert main([*args, *quiet, "--rate", "0.5", "--num-requests", "2", "--out", str(out)]) == 0
    simulated = json.loads((out / "sim.json").read_text())["runs"][0]["summary"]
    measured = calibrated.runs[0]
    sim_ttft, real_ttft = simulated["ttft_ms"]["p50"], measured["ttft_ms"]["p50"]
    # the per-request overhead was fitted so that the quiet model meets this run's TTFT
    # p50 (they were equal to the microsecond here): a profile that lost part of the
    # calibration on its way through the file and `pdserve sim` would miss it
    assert abs(sim_ttft - real_ttft) <= 0.1 * real_ttft, (sim_ttft, real_ttft)
    capsys.readouterr()


def test_the_profile_command_checks_its_calibration_flags_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, 0)
    out = ["--out", str(tmp_path / "p.json")]
    for flags, message in (
        (["--config", str(config), "--calibration-requests", "0"], "calibration_requests: must"),
        (["--config", str(config), "--device", "h100"], "device: an analytic profile is not"),
        (["--ray-address", "auto"], "ray_address: is where a --config cluster runs"),
    ):
        assert main(["profile", *flags, *out]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_cluster_without_prefill_instances_is_calibrated_as_colocated(tmp_path: Path) -> None:
    from pdserve.cluster.config import load_config

    assert setup_of(load_config(str(_config(tmp_path, 0)))) == "colocated"
    assert setup_of(load_config(str(_config(tmp_path, 1)))) == "disaggregated"
