"""The lanes of `make test` (tests/lanes.py): mypy heads the second lane."""

from __future__ import annotations

import sys

from tests.lanes import lane_commands


def test_typecheck_heads_the_rest_lane_and_pytest_gets_the_other_arguments() -> None:
    lanes = lane_commands(["--typecheck", "pdserve", "-q", "-x"])
    assert lanes["cluster"] == [
        [sys.executable, "-m", "pytest", "-m", "cluster and not readme", "-q", "-x"],
        [sys.executable, "-m", "pytest", "-m", "cluster and readme", "-q", "-x"],
    ]
    typecheck, pytest = lanes["rest"]
    assert typecheck == [sys.executable, "-m", "tests.typecheck", "pdserve"]
    assert pytest[3:] == ["-m", "not cluster", "-q", "-x"]
    rest = [[sys.executable, "-m", "pytest", "-m", "not cluster", "-q"]]
    assert lane_commands(["-q"])["rest"] == rest
