"""`pdserve profile`, `pdserve sim` and `pdserve plan` end to end: outputs and clear errors."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.deploy.cli import main
from pdserve.sim.profile import StepModel, save_profile
from tests.sim.helpers import toy_profile

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
model: toy
engine: {max_num_seqs: 32, max_num_batched_tokens: 512}
regions:
  - name: east
    latency_ms: {west: 30}
    prefill: {count: 1}
    decode: {count: 2}
  - name: west
    prefill: {count: 0, min: 0}
    decode: {count: 1}
slo: {ttft_ms: 500, tpot_ms: 50}
"""


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG)
    profile = save_profile(
        toy_profile(StepModel(overhead_s=0.003, s_per_token=2e-5, s_per_ctx=1e-7)),
        tmp_path / "toy.json",
    )
    return config, profile


def _argv(line: str, *values: object) -> list[str]:
    """The words of ``line``, each ``{}`` in it the next of ``values`` (paths, as given)."""
    given = iter(values)
    return [str(next(given)) if word == "{}" else word for word in line.split()]


def test_sim_writes_bench_compatible_json(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    config, profile = files
    rc = main(
        _argv(
            "sim --config {} --profile {} --rate 5 10 --num-requests 60 "
            "--prompt-len 200 --output-len 20 --out {} --no-plots "
            "--region-share east=3 west=1",
            config,
            profile,
            tmp_path / "out",
        )
    )
    assert rc == 0
    result = json.loads((tmp_path / "out" / "sim.json").read_text())
    assert {"command", "date", "machine", "options", "runs"} <= set(result)
    run = result["runs"][0]
    assert run["rate"] == 5
    assert set(run["summary"]["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert run["summary"]["num_ok"] == 60 and len(run["requests"]) == 60
    assert set(run["per_region"]) == {"east", "west"}
    assert {"east.prefill", "east.decode", "west.decode"} <= set(run["per_role"])
    assert run["instances_over_time"][0]["east.decode"] == 2
    assert "simulated 60 requests" in capsys.readouterr().out


def test_sim_runs_without_torch_and_still_records_the_machine(files, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The simulator needs no torch (its import is seconds and hundreds of MiB): a
    fresh process simulates and writes its result with torch never loaded."""
    config, profile = files
    argv = _argv(
        "sim --config {} --profile {} --rate 5 --num-requests 20 --out {} --no-plots",
        config,
        profile,
        tmp_path / "out",
    )
    script = (
        "import sys\nfrom pdserve.deploy.cli import main\n"
        f"rc = main({argv!r})\nprint(rc, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 False"
    machine = json.loads((tmp_path / "out" / "sim.json").read_text())["machine"]
    assert machine["torch"] == importlib.metadata.version("torch")
    assert machine["cpu_count"] == os.cpu_count()


def test_sim_rejects_a_trace_with_missing_columns(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    config, profile = files
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,100\n")
    rc = main(["sim", "--config", str(config), "--profile", str(profile), "--trace", str(trace)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "needs columns TIMESTAMP, ContextTokens, GeneratedTokens" in err
    assert "Traceback" not in err
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,100,8\n"
        "2023-11-16 18:15:47,100,-3\n"
    )
    rc = main(["sim", "--config", str(config), "--profile", str(profile), "--trace", str(trace)])
    assert rc == 2
    assert "trace.csv:3: GeneratedTokens is negative" in capsys.readouterr().err


def test_sim_rejects_a_profile_of_another_model(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    config, profile = files
    config.write_text(CONFIG.replace("model: toy", "model: llama-7b"))
    rc = main(["sim", "--config", str(config), "--profile", str(profile), "--rate", "1"])
    assert rc == 2
    assert "profile[0]: profiles model 'toy', not 'llama-7b'" in capsys.readouterr().err


def test_sim_rejects_a_bad_profile_file(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    config, profile = files
    raw = json.loads(profile.read_text())
    del raw["kv_capacity_tokens"]
    profile.write_text(json.dumps(raw))
    rc = main(["sim", "--config", str(config), "--profile", str(profile), "--rate", "1"])
    assert rc == 2
    assert "kv_capacity_tokens" in capsys.readouterr().err


def test_sim_noise_draws_zero_is_the_profile_without_its_noise(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    config, profile = files
    raw = json.loads(profile.read_text())
    raw["step"].update(jitter=0.3, jitter_s=0.05)
    raw.update(request_overhead_s=0.01, request_jitter=0.4)
    profile.write_text(json.dumps(raw))
    raw.update(request_jitter=0.0)
    quiet_file = tmp_path / "quiet.json"  # the same profile, its noise taken out by hand
    quiet_file.write_text(json.dumps(raw | {"step": {**raw["step"], "jitter": 0, "jitter_s": 0}}))

    def p50s(path: Path, *flags: str) -> tuple[float, float]:
        rc = main(
            [
                *_argv(
                    "sim --config {} --profile {} --rate 8 --num-requests 60 "
                    "--prompt-len 200 --output-len 20 --out {} --no-plots",
                    config,
                    path,
                    tmp_path / "out",
                ),
                *flags,
            ]
        )
        assert rc == 0
        (run,) = json.loads((tmp_path / "out" / "sim.json").read_text())["runs"]
        return run["summary"]["ttft_ms"]["p50"], run["summary"]["tpot_ms"]["p50"]

    assert p50s(profile, "--noise-draws", "0") == p50s(quiet_file)
    assert p50s(profile) != p50s(quiet_file)  # one draw of the noise moves them
    assert (
        main(_argv("sim --config {} --profile {} --rate 1 --noise-draws -1", config, profile)) == 2
    )
    assert "noise_draws: must be at least 0, got -1" in capsys.readouterr().err


def test_sim_runs_once_when_no_profile_carries_noise(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    config, profile = files  # measured, not calibrated: no jitter, no request overhead
    assert (
        main(
            _argv(
                "sim --config {} --profile {} --rate 4 --num-requests 20 "
                "--out {} --no-plots --noise-draws 3",
                config,
                profile,
                tmp_path,
            )
        )
        == 0
    )
    assert "--noise-draws 3: no profile carries noise" in capsys.readouterr().err
    (run,) = json.loads((tmp_path / "sim.json").read_text())["runs"]
    assert run["sim"]["draws"] == 1 and "noise_draws" not in run["summary"]


def test_profile_analytic_writes_a_loadable_file(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "h100.json"
    assert (
        main(["profile", "--model", "llama-7b", "--device", "h100", "--tp", "2", "--out", str(out)])
        == 0
    )
    raw = json.loads(out.read_text())
    assert raw["tensor_parallel_size"] == 2 and raw["source"] == "analytic"
    assert "llama-7b tp=2 pp=1 on h100" in capsys.readouterr().out


def test_plan_infeasible_names_the_slo_and_the_gap(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(
        _argv(
            "plan --model llama-7b --device h100 --rate east=5 "
            "--prompt-len 1000 --ttft-slo-ms 20 --tpot-slo-ms 50"
        )
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "TTFT SLO 20 ms cannot be met" in err and "ms over" in err
    assert "Traceback" not in err


def test_plan_refuses_a_mix_past_the_models_context(capsys) -> None:  # type: ignore[no-untyped-def]
    # llama-7b holds 4,096 tokens: every request would be refused, so no count of
    # instances meets the SLO; the error says so instead of "TTFT inf ms"
    rc = main(
        _argv(
            "plan --model llama-7b --device h100 --rate east=5 "
            "--prompt-len 4000 --output-len 256 --ttft-slo-ms 1000 "
            "--tpot-slo-ms 50"
        )
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert (
        "lengths: 4096 of 4096 requests of the mix ask for more than the model's context of 4096"
        in err
    )
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--rate", "east=10,-1"], "rate: 'east=10,-1': rates must be >= 0 and not all 0"),
        (["--rate", "east=0"], "rates must be >= 0 and not all 0"),
        (["--rate", "=5"], "rate: '=5' is not REGION=RATE"),
        (["--rate", "east=5", "--headroom", "nan"], "headroom: headroom and spares must be >= 0"),
        # was "TPOT SLO 50 ms cannot be met ... (-43 ms over)"
        (["--rate", "east=5", "--max-num-seqs", "0"], "max_num_seqs: must be >= 1"),
        (["--forecast", "FILE"], "forecast: FILE: 'east': rates must be numbers"),
        (["--rate", "east=5", "--ttft-slo-ms", "inf"], "slo: TTFT and TPOT SLOs must be > 0 and"),
        (["--rate", "east=5", "--seed", "-1"], "seed: must be >= 0"),
        (["--rate", "east=5", "--jobs", "0"], "jobs: must be >= 1, got 0"),
        # 200 requests at 1e9 req/s are a burst: 124 devices "met" the SLOs at that rate
        (
            ["--rate", "east=1e9", "--num-requests", "200"],
            "num_requests: 200 requests at 1.3e+09 req/s (with headroom) arrive within",
        ),
        (["--rate", "east=1e9"], "rate: region east: 1.3e+09 req/s (with headroom) needs"),
    ],
)
def test_plan_names_a_bad_forecast_or_limit(tmp_path, capsys, flags, why) -> None:  # type: ignore[no-untyped-def]
    forecast = tmp_path / "forecast.json"
    forecast.write_text('{"east": [5, null]}')  # a JSON null was a traceback
    flags = [str(forecast) if f == "FILE" else f for f in flags]
    assert main(["plan", "--model", "llama-7b", "--device", "h100", *flags]) == 2
    assert why.replace("FILE", str(forecast)) in capsys.readouterr().err


def test_plan_meets_the_slo_and_prints_the_textbook_beside_it(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.json"
    rc = main(
        _argv(
            "plan --model llama-7b --device h100 --rate east=2,4 "
            "--prompt-len 1000 --output-len 32 --num-requests 100 "
            "--ttft-slo-ms 500 --tpot-slo-ms 40 --layout disaggregated --out {}",
            out,
        )
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "plan (simulated)" in text and "textbook:" in text
    region = json.loads(out.read_text())["regions"][0]
    assert region["rate"] == 4  # the peak of the day's forecast
    assert region["at_forecast"]["ttft_s"] <= 0.5 and region["at_forecast"]["tpot_s"] <= 0.04
    assert region["prefill"] >= 2 and region["decode"] >= 2  # N+1
    assert "model: llama-7b" in region["cluster_yaml"]


def test_sim_says_why_requests_failed(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # one sequence per decode instance, three of them, at 200 req/s: most find no room
    config, profile = files
    config.write_text(CONFIG.replace("max_num_seqs: 32", "max_num_seqs: 1"))
    rc = main(
        _argv(
            "sim --config {} --profile {} --rate 200 --num-requests 40 "
            "--prompt-len 200 --output-len 20 --out {} --no-plots "
            "--no-progress",
            config,
            profile,
            tmp_path / "out",
        )
    )
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "sim.json").read_text())["runs"][0]["summary"]
    failed = summary["num_failed"]
    assert failed > 0 and summary["errors"] == {"overloaded: no decode instance had room": failed}
    assert f"failed: {failed} x overloaded: no decode instance had room" in capsys.readouterr().out


def test_profile_refuses_a_layout_the_model_cannot_take(capsys) -> None:  # type: ignore[no-untyped-def]
    # the analytic profile asks the engine's layout check (core/layout.py): llama-7b's
    # 32 heads do not split over 3 ranks, nor its 32 layers into 64 stages
    for flags, why in (
        (["--tp", "3"], "tensor_parallel_size: 3 does not divide the model's 32 attention heads"),
        (["--pp", "64"], "pipeline_parallel_size: 64 stages for a model of 32 layers"),
    ):
        assert main(["profile", "--model", "llama-7b", "--device", "h100", *flags]) == 2
        assert why in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--gpus", "16", "0"], "gpus: each count must be at least 2"),  # it divided by zero
        (["--context", "0"], "context: must be at least 1"),
        (["--weight-bytes", "0"], "weight_bytes: must be > 0"),
        (["--tpot-slo-ms", "-5"], "tpot_slo_ms: must be > 0"),
        (["--nvlink-domain", "0"], "nvlink_domain: must be at least 1"),
        (["--step-overhead-ms", "nan"], "step_overhead_s: must be in [0, 1] s"),
    ],
)
def test_afd_estimate_names_a_bad_flag(tmp_path, capsys, flags, why) -> None:  # type: ignore[no-untyped-def]
    assert main(["afd-estimate", *flags, "--out", str(tmp_path / "afd.json")]) == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "afd.json").exists()


def test_profile_refuses_flags_it_would_ignore_or_choke_on(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # --repeats 0 was a traceback (min of no timings); an analytic profile took any
    # --dtype and --block-size and wrote the device's bf16 figures
    out = str(tmp_path / "p.json")
    for flags, why in (
        (["--model", "builtin:tiny", "--repeats", "0"], "repeats: must be at least 1"),
        (["--model", "llama-7b", "--device", "h100", "--block-size", "0"], "block_size: must be"),
        (
            ["--model", "llama-7b", "--device", "h100", "--dtype", "float32"],
            "dtype: an analytic h100 profile is bfloat16, not float32",
        ),
    ):
        assert main(["profile", *flags, "--out", out]) == 2
        assert why in capsys.readouterr().err
    assert main(_argv("profile --model llama-7b --device h100 --dtype bfloat16 --out {}", out)) == 0


def test_sim_refuses_load_flags_bench_serve_refuses(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # the flags both share are checked as bench serve checks them
    config = str(Path(__file__).resolve().parents[2] / "sim" / "configs" / "shift.yaml")
    base = _argv(
        "sim --config {} --device h100 --rate 5 --num-requests 20 "
        "--no-plots --no-progress --out {}",
        config,
        tmp_path,
    )
    for flags, why in (
        (["--temperature", "-1"], "temperature: must be >= 0"),
        (["--max-concurrency", "0"], "max_concurrency: must be >= 1"),
        (["--request-timeout", "0"], "request_timeout: must be > 0"),
        (["--request-timeout", "nan"], "request_timeout: must be > 0"),
        (["--startup-s", "nan"], "startup_s: must be >= 0"),
        (["--seed", "-1"], "seed: must be >= 0"),  # numpy's ValueError
        # the simulation hung: a clock at 1e297 s no longer moves by a step
        (["--step-overhead-ms", "1e300"], "step_overhead_s: must be in [0, 1] s"),
    ):
        assert main([*base, *flags]) == 2
        assert why in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_file_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "profile.json"  # under a file: no folder can be made there
    assert main(["profile", "--model", "llama-7b", "--device", "h100", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve profile: error: --out: cannot create ") and str(blocker) in err
    assert "Traceback" not in err


def test_an_out_folder_that_cannot_be_made_is_refused_before_the_run(files, capsys) -> None:  # type: ignore[no-untyped-def]
    config, profile = files
    blocker = config.parent / "taken"
    blocker.write_text("")
    rc = main(
        _argv(
            "sim --config {} --profile {} --rate 1 --num-requests 5 --out {}",
            config,
            profile,
            blocker / "results",
        )
    )
    assert rc == 2
    captured = capsys.readouterr()
    assert "--out: cannot create" in captured.err and "simulated" not in captured.out


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--rate", "inf"], "rate: must be > 0 and finite"),
        (["--phase-s", "inf"], "phase_s: must be > 0 and finite"),  # OverflowError
        (["--phase-s", "1e300"], "phase_s: 2 req/s for 1e+300 s is over 10000000"),
    ],  # it hung
)
def test_sim_planners_names_a_phase_it_cannot_replay(tmp_path, capsys, flags, why) -> None:  # type: ignore[no-untyped-def]
    config = str(Path(__file__).resolve().parents[2] / "sim" / "configs" / "shift.yaml")
    base = _argv(
        "sim-planners --config {} --device h100 --rate 2 --phase-s 5 --out {}", config, tmp_path
    )
    assert main([*base, *flags]) == 2
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../escaped", "a/b", "", ".."])
@pytest.mark.parametrize("command", ["sim", "sim-planners", "sim-validate", "bench serve"])
def test_a_name_that_is_a_path_is_refused(tmp_path, capsys, command, name) -> None:  # type: ignore[no-untyped-def]
    """``--name ../escaped`` wrote its files outside ``--out``."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:  # the unknown last flag keeps any command from running
        main([*command.split(), "--out", str(out), "--name", name, "--not-a-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"argument --name: must be a file name without '/' (files go in --out), got {name!r}" in err
    )
    assert not tmp_path.joinpath("escaped").exists() and not out.exists()
