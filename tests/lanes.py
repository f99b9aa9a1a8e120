"""Run the pytest suite in two lanes at once (``make pytest``; ``make test`` adds mypy).

Tests that start Ray or a whole cluster (marked ``cluster`` by tests/conftest.py)
run one after another in one pytest process, then README's serving examples
(marked ``readme``) in another; every other test runs in a second
process beside it. Two clusters at once on a two-core machine slow each other
past their deadlines (a run that gave the second lane the Ray tests without
deadlines, after its unit tests, took as long in all and failed a start
deadline), while a cluster test mostly waits on its actors and leaves a core
to the unit tests. ``--typecheck PREFIX`` runs ``tests.typecheck PREFIX`` at the
head of the second lane, which ends long before the cluster lane.

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

LANES = {"cluster": "cluster and not readme", "rest": "not cluster"}  # name -> marker expression
# README's serving examples run after the cluster lane's tests, when no Ray of its own
# runs: `pdserve serve` joins any Ray found on the machine, as Ray's "auto" address does.
README_SERVING = "cluster and readme"
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
    readme = [sys.executable, "-m", "pytest", "-m", README_SERVING, *args]
    return {"cluster": [pytest["cluster"], readme], "rest": [*typecheck, pytest["rest"]]}


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
