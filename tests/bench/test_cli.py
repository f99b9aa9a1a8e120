"""``pdserve bench`` loads only the benchmark a command line names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.cli import KINDS, named_kind
from pdserve.deploy.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _fresh(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], str]:
    """``pdserve`` run with ``argv`` in a fresh process; its output, and the bench
    modules and heavy packages it had loaded when it exited."""
    script = (
        "import atexit, sys\n"
        "def loaded():\n"
        "    mods = sorted(m for m in sys.modules if m.startswith('pdserve.bench.'))\n"
        "    heavy = [m for m in ('torch', 'ray') if m in sys.modules]\n"
        "    print('LOADED', ' '.join(heavy + mods), file=sys.stderr)\n"
        "atexit.register(loaded)\n"
        "from pdserve.deploy.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    loaded = next(ln for ln in done.stderr.splitlines() if ln.startswith("LOADED"))
    return done, loaded


def test_bench_help_lists_every_benchmark_and_imports_none() -> None:
    done, loaded = _fresh(["bench", "--help"])
    assert done.returncode == 0, done.stderr
    for name in KINDS:
        assert name in done.stdout
    # serve's module is loaded anyway: `pdserve sim` takes its workload flags
    benchmarks = {f"pdserve.bench.{kind.module}" for kind in KINDS.values()}
    assert benchmarks & set(loaded.split()) == {"pdserve.bench.serve"}, loaded
    assert "torch" not in loaded.split() and "ray" not in loaded.split()


def test_the_load_generators_command_loads_neither_torch_nor_ray() -> None:
    # `bench serve` is a client of a running cluster; a flag error stops it after its
    # module and parser are loaded, before it dials anything
    done, loaded = _fresh(["bench", "serve", "--rate", "0"])
    assert done.returncode == 2 and "--rate" in done.stderr
    assert "torch" not in loaded.split() and "ray" not in loaded.split()
    assert "pdserve.bench.serve" in loaded and "pdserve.bench.kernels" not in loaded


def test_a_benchmark_gets_its_own_flags_and_help() -> None:
    done, loaded = _fresh(["bench", "scheduler", "--help"])
    assert done.returncode == 0, done.stderr
    assert KINDS["scheduler"].help in done.stdout and "--batch" in done.stdout
    assert "pdserve.bench.offline" not in loaded


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["bench", "serve", "--rate", "2"], "serve"),
        (["--log-level", "INFO", "bench", "-h", "ttft"], "ttft"),
        (["bench", "--help"], None),
        (["bench", "nosuch"], None),
        (["sim", "--config", "bench"], None),
        (["generate", "--prompt", "x"], None),
    ],
)
def test_named_kind(argv: list[str], kind: str | None) -> None:
    assert named_kind(argv) == kind


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--rate", "1", "--prompt-len", "-5"], "prompt_len: must be >= 1, got -5"),
        (["--rate", "1", "--num-requests", "0"], "num_requests: must be >= 1, got 0"),
        (["--trace", "/nonexistent.csv"], "trace: no such file: /nonexistent.csv"),
        ([], "rate: is required without --trace"),
    ],
)
def test_workload_flags_are_named_before_the_target_is_dialled(
    tmp_path, capsys, flags, why
) -> None:  # type: ignore[no-untyped-def]
    # they were checked only once connected: an unreachable target was reported
    # instead, or a long wait for a cluster's start preceded the flag error
    import socket

    from pdserve.deploy.cli import main

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        target = f"grpc://127.0.0.1:{server.getsockname()[1]}"
        rc = main(
            [
                "bench",
                "serve",
                "--target",
                target,
                *flags,
                "--no-progress",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert rc == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_router_benchmark_times_decisions_alone_without_a_cluster(tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    assert main(["bench", "router", "--decisions-only", "--rounds", "20", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "pdserve bench router --decisions-only --rounds 20"
    assert result["load"] is None  # no cluster was started
    rows = result["decisions"]
    assert len(rows) == 2 * 3 * 3  # holders (4, all) x instances (10, 100, 1000) x policies
    assert all(0 < row["p50_us"] <= row["p99_us"] for row in rows)
