"""``pdserve bench scheduler``: it measures the real scheduler, in child processes,
this tree against a baseline tree, and refuses what is not a source tree."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench.scheduler import measure, run, table
from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_measure_steps_a_whole_batch() -> None:
    schedule_s, update_s = measure(8, 20)
    assert 0 < schedule_s < 0.1 and 0 < update_s < 0.1


def test_this_tree_against_itself_as_the_baseline(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = [
        "bench",
        "scheduler",
        "--batch",
        "2",
        "5",
        "--steps",
        "20",
        "--repeat",
        "1",
        "--baseline",
        str(ROOT),
        "--out",
        str(tmp_path),
        "--name",
        "s",
    ]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "s.json").read_text())
    assert [row["batch"] for row in payload["rows"]] == [2, 5]
    for row in payload["rows"]:
        for tree in ("this", "baseline"):
            figures = row[tree]
            assert figures["schedule_us"] > 0 and figures["update_us"] > 0
            total = figures["schedule_us"] + figures["update_us"]
            assert figures["per_row_us"] == pytest.approx(total / row["batch"])
    out = capsys.readouterr().out
    assert "| 5 |" in out and "x) |" in out and "--baseline" in payload["command"]


def test_the_table_without_a_baseline_has_plain_figures() -> None:
    rows = [{"batch": 3, "this": {"schedule_us": 6.0, "update_us": 3.0, "per_row_us": 3.0}}]
    assert table(rows).splitlines()[-1] == "| 3 | 6.0 | 3.0 | 3.0 |"


def test_a_baseline_that_is_not_a_source_tree_is_refused(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["bench", "scheduler", "--baseline", str(tmp_path), "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "is not a pdserve source tree" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_zero_steps_are_refused() -> None:
    args = argparse.Namespace(batch=[4], steps=0, repeat=1, baseline=None, out="-", name="-")
    with pytest.raises(InvalidArgumentError, match="--steps"):
        run(args)
