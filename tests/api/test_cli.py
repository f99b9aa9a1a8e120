"""The pdserve command line, run as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


def test_generate_prints_text_and_timings() -> None:
    proc = run("generate", "--prompt", "Hello", "--prompt", "The router", "--max-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--- prompt:") == 2
    assert "tokens: 6, finish: length" in proc.stdout
    assert "tok/s" in proc.stdout


def test_bad_flag_value_names_the_field() -> None:
    proc = run("generate", "--prompt", "Hello", "--top-p", "1.5")
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("generate", "--prompt", "Hello", "--repetition-penalty", "0")
    assert proc.returncode == 2
    assert "repetition_penalty" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_is_one_clear_line(tmp_path) -> None:
    proc = run("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert proc.returncode == 2
    assert "model:" in proc.stderr and "config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the flag is valid")
def test_cuda_without_cuda_is_one_clear_line() -> None:
    # it was torch's "AssertionError: Torch not compiled with CUDA enabled" traceback
    proc = run("generate", "--device", "cuda", "--prompt", "Hello", "--max-tokens", "2")
    assert proc.returncode == 2
    assert "device: cuda asked, but this process has none" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_with_tensor_parallel_ranks() -> None:
    proc = run("generate", "--tp", "2", "--prompt", "Hello", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens: 4, finish: length" in proc.stdout


def test_layout_the_model_cannot_take_is_refused() -> None:
    proc = run("generate", "--tp", "3", "--prompt", "Hello")
    assert proc.returncode == 2
    assert "tensor_parallel_size: 3 does not divide the model's 8 attention heads" in proc.stderr


def test_an_abbreviated_flag_is_refused_not_read_as_another(capsys) -> None:  # type: ignore[no-untyped-def]
    # `plan` has --tpot-slo-ms and no --tp: a prefix match would set the TPOT SLO to 2 ms
    from pdserve.deploy.cli import main

    for argv, flag in (
        (["plan", "--model", "llama-7b", "--rate", "east=1", "--tp", "2"], "--tp 2"),
        (["bench", "serve", "--target", "grpc://h:1", "--num-req", "5"], "--num-req 5"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_generate_runs_the_prompts_under_the_lora_adapter_it_loads(
    reference_models, tmp_path
) -> None:
    from tests.lora_adapters import ADAPTERS, make_adapter

    base = reference_models("llama")
    make_adapter(base, ADAPTERS[1], tmp_path / "all")
    flags = ["generate", "--model", str(base), "--prompt", "Hello", "--max-tokens", "8"]
    flags += ["--dtype", "float32"]

    def output(*more: str) -> str:
        proc = run(*flags, *more)
        assert proc.returncode == 0, proc.stderr
        return next(line for line in proc.stdout.splitlines() if "output:" in line)

    plain = output()
    lora = f"all={tmp_path / 'all'}"
    assert output("--lora", lora) != plain  # the only adapter loaded is the one used
    assert output("--lora", lora, "--adapter", "all") == output("--lora", lora)
    proc = run(*flags, "--lora", lora, "--adapter", "sql")
    assert proc.returncode == 2 and "--adapter" in proc.stderr and "Traceback" not in proc.stderr
