"""Run the pytest suite in two lanes at once (``make pytest``; ``make test`` adds mypy).

The **cluster lane** runs the modules of :data:`CLUSTER_LANE` one after another in
one pytest process: tests that kill instances, wait on deadlines or compare
timings, plus enough others to even the lanes. The **rest lane** runs every
other test in a second process beside it: first the unit tests, then (ordered
last by tests/conftest.py) the remaining tests that start Ray, on a Ray session
of their own. Those mostly wait on their actors, so the rest lane's clusters cost
the cluster lane's deadlines little, while a lane of all the clusters left the
second core half idle for most of the run. ``--typecheck PREFIX`` runs
``tests.typecheck PREFIX`` at the head of the rest lane.

Both lanes share one cache folder. Each lane's lines are printed as they come,
prefixed with its name; the exit status is the worst step's.

    python -m tests.lanes [--typecheck PREFIX] [PYTEST ARGS ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

# Test modules (under tests/) whose tests run in the cluster lane; conftest.py marks
# them `cluster_lane`. Alone, the cluster lane took ~1,030 s of a 1,570 s lane of
# every Ray test (2 vCPUs, --durations, 2026-11-30).
CLUSTER_LANE = (
    "e2e/test_cluster.py",
    "e2e/test_cluster_scaling.py",
    "e2e/test_cold_start.py",
    "e2e/test_commands.py",
    "e2e/test_disaggregated.py",
    "e2e/test_models.py",
    "e2e/test_peer_prefill.py",
    "parallel/test_elastic_ep.py",
    "parallel/test_multirank.py",
    "sim/test_replay_live.py",
    "sim/test_validation.py",
)
LANES = {"cluster": "cluster_lane", "rest": "not cluster_lane"}  # name -> marker expression
NO_TESTS = 5  # pytest's exit status when a lane selected nothing


def _run_lane(name: str, commands: list[list[str]], codes: list[int], started: float) -> None:
    for cmd in commands:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
        codes.append(proc.wait())
    print(f"lanes: {name} ended ({codes}) after {time.monotonic() - started:.0f} s", flush=True)


def lane_commands(args: list[str]) -> dict[str, list[list[str]]]:
    """Each lane's commands, in order, from this module's command line."""
    typecheck = []
    if args[:1] == ["--typecheck"]:
        if len(args) < 2:
            raise SystemExit("--typecheck needs a module prefix, e.g. pdserve")
        typecheck, args = [[sys.executable, "-m", "tests.typecheck", args[1]]], args[2:]
    pytest = {name: [sys.executable, "-m", "pytest", "-m", m, *args] for name, m in LANES.items()}
    return {"cluster": [pytest["cluster"]], "rest": [*typecheck, pytest["rest"]]}


def main(args: list[str]) -> int:
    started = time.monotonic()
    # one cache of built-in models and compiled kernels for both (each is written atomically)
    os.environ.setdefault("PDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pdserve-test-cache-"))
    codes: dict[str, list[int]] = {name: [] for name in LANES}
    threads = [
        threading.Thread(target=_run_lane, args=(name, commands, codes[name], started))
        for name, commands in lane_commands(args).items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ran = [c for lane in codes.values() for c in lane if c != NO_TESTS]
    return max(ran) if ran else NO_TESTS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
