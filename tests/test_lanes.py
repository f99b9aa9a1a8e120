"""The lanes of `make test` (tests/lanes.py): mypy heads the rest lane, the second-lane
cluster files run in the rest lane only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.lanes import (
    CLUSTER,
    MULTINODE,
    REPORTS,
    REST,
    SECOND_LANE,
    cpu_line,
    cpu_times,
    lane_commands,
)

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
    assert set(lanes) == {"cluster", "rest"}
    assert lane_commands(["-q"])["rest"][0] == [*PYTEST, "-m", REST, _report("rest"), "-q"]


def _report(step: str) -> str:
    return f"--junitxml={REPORTS}/{step}.xml"


def test_every_second_lane_path_exists() -> None:
    """A path that moved would leave its tests in both lanes (or in none)."""
    assert [p for p in SECOND_LANE if not (ROOT / p).exists()] == []


def test_the_cpu_line_says_how_busy_the_cores_were() -> None:
    before = cpu_times()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    after = cpu_times()
    if before is None or after is None:
        assert cpu_line(before, 1.0) == "lanes: no /proc/stat here to count the CPU time"
        return
    assert after[0] > before[0]  # the child's work is counted, as any process's would be
    line = cpu_line(before, 1.0)
    assert line.startswith("lanes: the machine's ") and "% busy)" in line
