"""Run the pytest suite in two lanes at once (``make pytest``; ``make test`` adds mypy).

Tests that start Ray or a whole cluster are marked ``cluster`` by tests/conftest.py.
The ``cluster`` lane runs most of them one after another in one pytest process
(one Ray session). The ``rest`` lane runs every other test beside it, then the
cluster tests of :data:`SECOND_LANE` in a Ray session of its own (its own Ray
temp folder, so nothing that looks for "the" local Ray finds it): files of
ranks and engines without cluster-wide deadlines, chosen by measured time so
the lanes end together. A cluster test mostly waits on its actors, so two at
once share the two cores without passing their deadlines.

The tests marked ``multinode`` (tests/e2e/test_multinode.py: a Ray cluster of three
nodes on this machine, to which their process connects) end the rest lane in a
pytest process of their own, since a process holds one Ray connection.

The rest lane's mypy and unit tests run at a lower CPU priority (``nice``): the cluster
lane's tests have deadlines and timings, and tests/conftest.py runs its timed ones
(simulator against a real cluster) first, while those steps run.

``pdserve serve``'s "auto" joins only the Ray cluster announced in its Ray temp
folder (``pdserve.cluster.connect.found_address``), never the lanes' own: the
commands and README's serving examples run in the lanes like any cluster test.
``--typecheck PREFIX`` runs ``tests.typecheck PREFIX`` at the head of the rest lane.

Every lane shares one cache folder. Each lane's lines are printed as they come,
prefixed with its name; the exit status is the worst step's. Each pytest step writes
a JUnit report under ``test-artifacts/lanes/``, every test's time in it
(``python -m tests.durations`` sums them by file and lists the slowest). Last it
prints how busy the machine's cores were over the run (``/proc/stat``): near 100%,
the run is as long as its CPU time over the cores, however the lanes are cut.

    python -m tests.lanes [--typecheck PREFIX] [PYTEST ARGS ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CLUSTER = "cluster and not multinode"
REST = "not cluster and not multinode"
MULTINODE = "multinode"
# Cluster test files the rest lane runs after its own tests, chosen so the lanes end
# together (clean clone, 2026-12-03: cluster lane 798 s, rest lane 773 s of which mypy
# 77 s, since cut to 37 s; the cold-start tests, 32 s, moved here then. Later, 3cc05a9:
# cluster lane 737 s, rest lane 818 s; the cluster calibration, 36 s, moved back.
# 98a5ba0: cluster 789 s, rest 811 s; then the solo tests, 41 s, joined the cluster
# lane and the tenants' file, 12 s, came here. 32f04c4: cluster 608 s, rest 654 s; the
# cold-start tests, ~20 s, moved back).
SECOND_LANE = (
    "tests/bench",
    "tests/cluster",
    "tests/engine",
    "tests/frontdoor",
    "tests/distributed",
    "tests/kernels",
    "tests/models",
    "tests/parallel",
    "tests/e2e/test_disaggregated.py",
    "tests/e2e/test_quant_disaggregated.py",
    "tests/e2e/test_tenants.py",
    "tests/sim/test_profile.py",
)
# mypy and the unit tests yield the CPU to the cluster lane's tests, whose deadlines and
# timings count (tests/conftest.py runs the timed ones then); they need none of it.
NICE = 5
NO_TESTS = 5  # pytest's exit status when a step selected nothing
REPORTS = "test-artifacts/lanes"  # each step's JUnit report (tests/durations.py reads them)


def _run_lane(
    name: str,
    commands: list[list[str]],
    codes: list[int],
    started: float,
    env: dict | None,
) -> None:
    """Run ``commands`` one after another, mypy's and the unit tests' at a lower CPU
    priority (:data:`NICE`)."""
    for cmd in commands:
        niceness = ["nice", "-n", str(NICE)] if yields_cpu(cmd) else []
        proc = subprocess.Popen(
            [*niceness, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
        codes.append(proc.wait())
    print(f"lanes: {name} ended ({codes}) after {time.monotonic() - started:.0f} s", flush=True)


def yields_cpu(cmd: list[str]) -> bool:
    """mypy and the unit tests: the steps without deadlines or timings."""
    return "tests.typecheck" in cmd or REST in cmd


def lane_commands(args: list[str]) -> dict[str, list[list[str]]]:
    """Each lane's commands, in order, from this module's command line: ``cluster`` and
    ``rest`` run at once."""
    typecheck = []
    if args[:1] == ["--typecheck"]:
        if len(args) < 2:
            raise SystemExit("--typecheck needs a module prefix, e.g. pdserve")
        typecheck, args = [[sys.executable, "-m", "tests.typecheck", args[1]]], args[2:]
    pytest = [sys.executable, "-m", "pytest"]
    ignore = [f"--ignore={path}" for path in SECOND_LANE]

    def report(step: str) -> str:
        return f"--junitxml={REPORTS}/{step}.xml"

    return {
        "cluster": [[*pytest, "-m", CLUSTER, *ignore, report("cluster"), *args]],
        "rest": [
            *typecheck,
            [*pytest, "-m", REST, report("rest"), *args],
            [*pytest, "-m", CLUSTER, report("second"), *args, *SECOND_LANE],
            [*pytest, "-m", MULTINODE, report("multinode"), *args],
        ],
    }


def main(args: list[str]) -> int:
    started, cpu = time.monotonic(), cpu_times()
    # one cache of built-in models and compiled kernels for all (each is written atomically)
    os.environ.setdefault("PDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pdserve-test-cache-"))
    # a lane is one core's work: its tests' torch runs one thread (the ranks they start
    # set their own). Two threads a lane, the lanes beside each other on two cores, spent
    # a quarter more CPU on the same tests (tests/engine: 52 CPU-s against 41 alone)
    # waiting for each other's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The suite starts hundreds of Python processes (ranks, routers, commands, README blocks)
    # and five pytest runs that each collect every test: with bytecode caches written
    # (__pycache__, ignored by git) they compile pdserve and rewrite the tests once,
    # not each time (collecting: 8.5 -> 5.6 s on a 2-core VM).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    commands = lane_commands(args)
    # the rest lane's Ray writes its address in a temp folder of its own (short: sockets)
    own_ray = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}
    codes: dict[str, list[int]] = {name: [] for name in commands}
    threads = [
        threading.Thread(
            target=_run_lane,
            args=(name, commands[name], codes[name], started, own_ray if name == "rest" else None),
        )
        for name in ("cluster", "rest")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(cpu_line(cpu, time.monotonic() - started), flush=True)
    ran = [c for lane in codes.values() for c in lane if c != NO_TESTS]
    return max(ran) if ran else NO_TESTS


def cpu_times() -> tuple[float, float] | None:
    """(busy, idle) CPU-seconds of this machine since boot, all cores (Linux's
    /proc/stat; None elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, idle / hz


def cpu_line(before: tuple[float, float] | None, wall_s: float) -> str:
    """How busy the machine's cores were since ``before`` (:func:`cpu_times`): a run that
    kept them busy lasts its CPU time over the cores, however its lanes are cut."""
    after = cpu_times()
    if before is None or after is None:
        return "lanes: no /proc/stat here to count the CPU time"
    busy, idle = after[0] - before[0], after[1] - before[1]
    cores = os.cpu_count() or 1
    return (
        f"lanes: the machine's {cores} cores were busy {busy:.0f} CPU-s and idle {idle:.0f} "
        f"in {wall_s:.0f} s ({busy / max(busy + idle, 1e-9):.0%} busy)"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
