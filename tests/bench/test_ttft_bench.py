"""`pdserve bench ttft`: both setups answer on Ray actors; GPU flags are checked first."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.deploy.cli import main


def test_both_setups_answer_and_the_report_repeats_its_command(ray_session, tmp_path) -> None:
    out = tmp_path / "ttft.json"
    argv = [
        "bench",
        "ttft",
        "--model",
        "builtin:tiny",
        "--prompt-len",
        "32",
        "--output-len",
        "2",
        "--requests",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert set(report["median_ttft_ms"]) == {"colocated", "disaggregated"}
    assert all(ms > 0 for ms in report["median_ttft_ms"].values())
    assert report["command"].startswith(
        "pdserve bench ttft --model builtin:tiny --prompt-len 32 --output-len 2 --requests 2"
    )


def test_a_share_of_the_gpu_is_checked_before_anything_starts(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["bench", "ttft", "--gpus-per-instance", "0.5"])
    assert "between 0 and 1/3 (three instances), got 0.5" in capsys.readouterr().err
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit, match="--gpus-per-instance: needs a CUDA GPU"):
        main(["bench", "ttft", "--gpus-per-instance", "0.3"])


def test_two_nodes_refuse_shm_before_anything_starts(capsys) -> None:  # type: ignore[no-untyped-def]
    """shm between two Ray nodes of one machine works only because they share its memory:
    the cross-node figure must come from a connector that crosses nodes."""
    assert main(["bench", "ttft", "--nodes", "2"]) == 2  # the default connector is shm
    assert "connector: shm reaches only its own node" in capsys.readouterr().err
