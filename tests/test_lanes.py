"""The lanes of `make test` (tests/lanes.py) name real modules and put mypy first."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.lanes import CLUSTER_LANE, lane_commands


def test_every_cluster_lane_module_exists() -> None:
    tests = Path(__file__).parent
    assert [m for m in CLUSTER_LANE if not (tests / m).is_file()] == []


def test_typecheck_heads_the_rest_lane_and_pytest_gets_the_other_arguments() -> None:
    lanes = lane_commands(["--typecheck", "pdserve", "-q", "-x"])
    assert lanes["cluster"] == [[sys.executable, "-m", "pytest", "-m", "cluster_lane", "-q", "-x"]]
    typecheck, pytest = lanes["rest"]
    assert typecheck == [sys.executable, "-m", "tests.typecheck", "pdserve"]
    assert pytest[3:] == ["-m", "not cluster_lane", "-q", "-x"]
    assert lane_commands(["-q"])["rest"] == [
        [sys.executable, "-m", "pytest", "-m", "not cluster_lane", "-q"]
    ]
