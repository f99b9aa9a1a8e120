"""Where ``make test``'s time went: the JUnit reports tests/lanes.py writes, summed.

    python -m tests.durations [FOLDER] [--top N]

prints each step's total, the files by time, and the N slowest tests (setup and
teardown included: a module's cluster start counts to its first test).
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from tests.lanes import REPORTS


def read(folder: Path) -> dict[str, list[tuple[str, float]]]:
    """Step name -> (test id, seconds) of each test its report lists."""
    steps = {}
    for report in sorted(folder.glob("*.xml")):
        cases = ET.parse(report).getroot().iter("testcase")
        steps[report.stem] = [
            (f"{c.get('classname', '')}::{c.get('name', '')}", float(c.get("time", 0)))
            for c in cases
        ]
    return steps


def by_file(tests: list[tuple[str, float]]) -> list[tuple[str, float, int]]:
    """(module, seconds, tests) from the slowest module down."""
    totals: dict[str, list[float]] = defaultdict(list)
    for test, seconds in tests:
        totals[test.split("::")[0]].append(seconds)
    return sorted(((m, sum(t), len(t)) for m, t in totals.items()), key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=REPORTS)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    steps = read(Path(args.folder))
    if not steps:
        raise SystemExit(f"no JUnit reports in {args.folder} (run `make test` first)")
    everything = [t for tests in steps.values() for t in tests]
    for step, tests in steps.items():
        print(f"{step}: {len(tests)} tests, {sum(s for _, s in tests):.0f} s")
    print("\nby file:")
    for module, seconds, count in by_file(everything)[: args.top]:
        print(f"  {seconds:7.1f} s  {count:4d}  {module}")
    print(f"\nslowest {args.top} tests:")
    for test, seconds in sorted(everything, key=lambda t: -t[1])[: args.top]:
        print(f"  {seconds:7.1f} s  {test}")


if __name__ == "__main__":
    main()
