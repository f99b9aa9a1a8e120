"""Run the pytest suite in two lanes at once (``make pytest``).

Tests that start Ray or a whole cluster (marked ``cluster`` by tests/conftest.py)
run one after another in one pytest process; every other test runs in a second
process beside it. Two clusters at once on a two-core machine would slow each
other past their deadlines, while a cluster test mostly waits on its actors and
leaves a core to the unit tests. Both lanes share one cache folder. Each lane's lines are printed as they come,
prefixed with its name; the exit status is the worse lane's.

    python -m tests.lanes [PYTEST ARGS ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

LANES = {"cluster": "cluster", "rest": "not cluster"}  # name -> marker expression
NO_TESTS = 5  # pytest's exit status when a lane selected nothing


def _relay(name: str, out: IO[str]) -> None:
    for line in out:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def main(args: list[str]) -> int:
    started = time.monotonic()
    # one cache of built-in models and compiled kernels for both (each is written atomically)
    os.environ.setdefault("PDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pdserve-test-cache-"))
    procs, relays = {}, []
    for name, marker in LANES.items():
        cmd = [sys.executable, "-m", "pytest", "-m", marker, *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        relay = threading.Thread(target=_relay, args=(name, proc.stdout), daemon=True)
        relay.start()
        procs[name], relays = proc, [*relays, relay]
    codes = {}
    for name, proc in procs.items():
        codes[name] = proc.wait()
        print(f"lanes: {name} ended ({codes[name]}) after {time.monotonic() - started:.0f} s")
    for relay in relays:
        relay.join()
    ran = [c for c in codes.values() if c != NO_TESTS]
    return max(ran) if ran else NO_TESTS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
