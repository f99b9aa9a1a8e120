"""The one-command GPU check: its import tree and package report work without a GPU or Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_dry_run_imports_the_gpu_paths_without_ray(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "import tree works" in done.stdout


def test_without_cuda_it_says_so(tmp_path) -> None:
    if torch.cuda.is_available():
        return  # on a GPU machine the full check is `make gpu-check` itself
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "no CUDA device" in done.stdout


def test_gpu_benchmarks_refuse_a_machine_without_cuda(capsys) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from pdserve.deploy.cli import main

    if torch.cuda.is_available():
        return  # there they run: `make gpu-check`
    for kind in ("gpu", "cuda-ipc", "kernels"):
        with pytest.raises(SystemExit, match="CUDA GPU"):
            main(["bench", kind, "--out", "/nonexistent/x.json"])


def test_the_ttft_step_is_skipped_by_name_where_ray_is_missing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pdserve.bench.gpu_check import STEPS, skipped

    assert skipped(list(STEPS)) == {}  # Ray is installed here
    monkeypatch.setitem(sys.modules, "ray", None)  # as on a bare GPU machine
    why = skipped(list(STEPS))
    assert list(why) == ["ttft"] and "bench/gpu_wheels.py" in why["ttft"]
    assert skipped(["gpu", "kernels"]) == {}
