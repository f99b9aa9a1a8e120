"""The lanes of `make test` (tests/lanes.py): mypy heads the rest lane, the second-lane
cluster files run in the rest lane only, the solo tests after both lanes."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.lanes import CLUSTER, MULTINODE, REPORTS, REST, SECOND_LANE, SOLO, lane_commands

PYTEST = [sys.executable, "-m", "pytest"]
ROOT = Path(__file__).resolve().parent.parent


def test_typecheck_heads_the_rest_lane_and_pytest_gets_the_other_arguments() -> None:
    lanes = lane_commands(["--typecheck", "pdserve", "-q", "-x"])
    ignore = [f"--ignore={path}" for path in SECOND_LANE]
    assert lanes["cluster"] == [[*PYTEST, "-m", CLUSTER, *ignore, _report("cluster"), "-q", "-x"]]
    typecheck, rest, second, multinode = lanes["rest"]
    assert typecheck == [sys.executable, "-m", "tests.typecheck", "pdserve"]
    assert rest == [*PYTEST, "-m", REST, _report("rest"), "-q", "-x"]
    assert second == [*PYTEST, "-m", CLUSTER, _report("second"), "-q", "-x", *SECOND_LANE]
    assert multinode == [*PYTEST, "-m", MULTINODE, _report("multinode"), "-q", "-x"]
    assert lanes["solo"] == [[*PYTEST, "-m", SOLO, _report("solo"), "-q", "-x"]]
    assert lane_commands(["-q"])["rest"][0] == [*PYTEST, "-m", REST, _report("rest"), "-q"]


def _report(step: str) -> str:
    return f"--junitxml={REPORTS}/{step}.xml"


def test_every_second_lane_path_exists() -> None:
    """A path that moved would leave its tests in both lanes (or in none)."""
    assert [p for p in SECOND_LANE if not (ROOT / p).exists()] == []
