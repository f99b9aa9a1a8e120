"""Everything GPU-related in one command, for a bare GPU machine.

    python3 bench/gpu_check.py --out gpu-results        (or: make gpu-check)

Needs torch (CUDA build), triton, msgpack, grpcio, safetensors, tokenizers,
numpy, pyyaml, jinja2 and pytest; not Ray, not a network, not an install of
pdserve: it imports pdserve from this source tree through a tree of links
that follows pyproject.toml's package map. ``transformers`` is needed for the
parity tests and the peer (reported as skipped or as an error without it).
Steps, in this order, each under a time limit, all output in ``gpu-check.log``:

1. ``gpu``: ``pdserve bench gpu``, an 8B-shaped model's decode (eager and CUDA
   graph) against the HBM floor, prefill MFU, transformers as the peer: ``gpu.json``;
2. ``pytest``: the CUDA tests (the CUDA IPC connector's among them) and the Triton kernel tests, natively
   (TRITON_INTERPRET unset); the bf16 agreement figures: ``bf16_agreement.jsonl``;
3. ``profile``: ``pdserve profile --grid gpu`` of that model with dummy weights,
   the simulator's measured GPU profile: ``profile-gpu.json``;
4. ``cuda-ipc``: ``pdserve bench cuda-ipc``, KV pages into another process's pool
   over CUDA IPC against a copy inside one process: ``cuda_ipc.json``;
5. ``ttft``: ``pdserve bench ttft``, the 8B-shaped model's TTFT disaggregated
   (a prefill and a decode instance on Ray actors sharing the GPU, paired over
   cuda_ipc) against colocated, at low load: ``ttft.json``. The one step that
   needs Ray: skipped without it (``bench/gpu_wheels.py`` makes wheels of it
   small enough to carry to a machine with no network);
6. ``kernels``: ``pdserve bench kernels``, each Triton kernel against torch and
   the bandwidth floor: ``kernels.json``;

then ``summary.json``: the device, the versions, each step's exit status (and
the steps skipped, with why).
``--steps`` runs some of them. Run with ``--dry-run`` on any machine to check the
import tree and the dependency report without a GPU (the test suite does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {
    "torch": "torch",
    "triton": "triton",
    "msgpack": "msgpack",
    "grpc": "grpcio",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "jinja2": "jinja2",
    "pytest": "pytest",
}
OPTIONAL = {"transformers": "transformers (the parity tests' reference)"}
TESTS = [
    "tests/parallel/test_cuda.py",
    "tests/kernels/test_kernels.py",
    "tests/kernels/test_quant_kernels.py",
    "tests/transfer/test_cuda_ipc.py",
]
# Modules the GPU steps but ttft import: none of them may need Ray.
GPU_MODULES = [
    "pdserve",
    "pdserve.deploy.cli",
    "pdserve.bench.kernels",
    "pdserve.bench.gpu",
    "pdserve.bench.cuda_ipc",
    "pdserve.sim.measure",
    "pdserve.parallel.model_runner",
    "pdserve.transfer.cuda_ipc",
    "pdserve.transfer.rank",
]


# The command line without Ray: `pdserve bench <kind>` and `pdserve profile` import
# only their own modules.
PDSERVE = "import sys; from pdserve.deploy.cli import main; sys.exit(main(sys.argv[1:]))"
STEPS = ("gpu", "pytest", "profile", "cuda-ipc", "ttft", "kernels")
# Each step's time limit, seconds.
LIMITS = {"gpu": 200, "pytest": 240, "profile": 150, "cuda-ipc": 60, "ttft": 300, "kernels": 120}
NEEDS_RAY = {"ttft"}


def missing(modules: dict[str, str]) -> list[str]:
    return [pip for name, pip in modules.items() if importlib.util.find_spec(name) is None]


def package_dirs() -> dict[str, str]:
    """``[tool.setuptools.package-dir]`` of pyproject.toml (read without tomllib on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^"([\w.]+)"\s*=\s*"([\w/]+)"', section, re.MULTILINE))


def import_tree(where: Path) -> Path:
    """Links making ``import pdserve.X`` find this source tree; returns the path to add."""
    top = where / "pdserve"
    top.mkdir(parents=True)
    for package, folder in package_dirs().items():
        parts = package.split(".")
        if package == "pdserve":  # the top-level API: its files go into pdserve/ itself
            for path in (ROOT / folder).glob("*.py"):
                (top / path.name).symlink_to(path)
        elif len(parts) == 2:  # nested packages live inside their parent's folder
            (top / parts[1]).symlink_to(ROOT / folder, target_is_directory=True)
    return where


def run_step(name: str, command: list[str], env: dict[str, str], out: Path, limit: float) -> int:
    """Run one step, its output appended to ``gpu-check.log``; 124 when it ran past ``limit``."""
    print(f"== {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(out / "gpu-check.log", "a") as log:
        log.write(f"\n== {name}: {' '.join(command)}\n")
        log.flush()
        try:
            code = subprocess.run(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit
            ).returncode
        except subprocess.TimeoutExpired:
            code = 124
        log.write(f"== {name}: exit {code} after {time.perf_counter() - start:.0f} s\n")
    print(f"   exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
    return code


def check_imports(env: dict[str, str]) -> int:
    """Import the GPU steps' modules with Ray made unimportable."""
    probe = "import sys; sys.modules['ray'] = None\n" + "".join(
        f"import {m}\n" for m in GPU_MODULES
    )
    return subprocess.call([sys.executable, "-c", probe], cwd=ROOT, env=env)


@dataclass(frozen=True)
class CheckRun:
    """What the steps of a run need of its flags (built by hand in :func:`main`: this
    file runs before pdserve can be imported)."""

    steps: list[str]  # the steps run, of STEPS
    tests: list[str]  # the pytest step's files
    time_scale: float = 1.0  # multiplies each step's time limit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--dry-run", action="store_true", help="check imports and packages only")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies each limit")
    parser.add_argument("--tests", nargs="+", default=TESTS, help="the pytest step's files")
    args = parser.parse_args(argv)
    lacking = missing(REQUIRED)
    if lacking:
        print(f"missing Python packages: {', '.join(lacking)} (pip install them first)")
        return 1
    for pip in missing(OPTIONAL):
        print(f"note: {pip} is not installed; the tests that need it will be skipped")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-") as tmp:
        tree = import_tree(Path(tmp))
        sys.path.insert(0, str(tree))  # this process writes the 8B config with pdserve's help
        paths = [str(tree), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # Ray's actors too
        env.pop("TRITON_INTERPRET", None)
        if check_imports(env) != 0:
            print("pdserve's GPU modules do not import without Ray: see the error above")
            return 1
        if args.dry_run:
            for name, why in skipped(args.steps).items():
                print(f"{name} would be skipped: {why}")
            print("dry run: the import tree works and no required package is missing")
            return 0
        return _run_all(out, env, CheckRun(args.steps, args.tests, args.time_scale))


def _pdserve(out: Path, figures: str, *argv: str) -> list[str]:
    """A pdserve command that writes its figures to ``out / figures``."""
    return [sys.executable, "-c", PDSERVE, *argv, "--out", str(out / figures)]


def step_commands(out: Path, config: Path, tests: list[str]) -> dict[str, list[str]]:
    pytest = ["-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--timeout", "120"]
    dummy = ["--model", str(config), "--load-format", "dummy", "--dtype", "bfloat16"]
    profile = ["profile", *dummy, "--grid", "gpu", "--repeats", "2"]
    memory = ["--gpus-per-instance", "0.3", "--kv-cache-mib", "4096"]
    ttft = ["bench", "ttft", *dummy, *memory, "--prompt-len", "1024", "--requests", "10"]
    return {
        "pytest": [sys.executable, *pytest, *tests],
        "gpu": _pdserve(out, "gpu.json", "bench", "gpu"),
        "profile": _pdserve(out, "profile-gpu.json", *profile),
        "cuda-ipc": _pdserve(out, "cuda_ipc.json", "bench", "cuda-ipc"),
        "ttft": _pdserve(out, "ttft.json", *ttft, "--connector", "cuda_ipc"),
        "kernels": _pdserve(out, "kernels.json", "bench", "kernels"),
    }


def skipped(steps: list[str]) -> dict[str, str]:
    """The steps of ``steps`` this machine cannot run, with why."""
    if importlib.util.find_spec("ray") is not None:
        return {}
    why = "Ray is not installed (python3 bench/gpu_wheels.py makes wheels to carry here)"
    return {name: why for name in steps if name in NEEDS_RAY}


def _run_all(out: Path, env: dict[str, str], args: CheckRun) -> int:
    import torch

    from pdserve.bench.gpu import write_config

    if not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False")
        return 2
    env = {**env, "PDSERVE_GPU_OUT": str(out)}
    skips = skipped(args.steps)
    for name, why in skips.items():
        print(f"== {name}: skipped: {why}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-8b-") as folder:
        commands = step_commands(out, write_config(Path(folder) / "llama3-8b"), args.tests)
        codes = {
            name: run_step(name, commands[name], env, out, LIMITS[name] * args.time_scale)
            for name in STEPS
            if name in args.steps and name not in skips
        }
    summary = {
        "device": torch.cuda.get_device_name(0),
        "devices": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "steps": codes,
        "skipped": skips,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if not any(codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
