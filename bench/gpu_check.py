"""Everything GPU-related in one command, for a bare GPU machine.

    python3 bench/gpu_check.py --out gpu-results        (or: make gpu-check)

Needs torch (CUDA build), triton, msgpack, grpcio, safetensors, tokenizers,
numpy, pyyaml, jinja2 and pytest; not Ray, not a network, not an install of
pdserve: it imports pdserve from this source tree through a tree of links
that follows pyproject.toml's package map. ``transformers`` is needed for the
parity tests (they are reported as skipped without it). Steps, each writing
into ``--out``:

1. the CUDA tests and the Triton kernel tests, natively (TRITON_INTERPRET
   unset): ``pytest.log`` and ``junit.xml``;
2. ``pdserve bench kernels``: the kernels against the torch reference and the
   HBM floor, and an 8B-shaped decode: ``kernels.json``;
3. ``summary.json``: the device, the versions, each step's exit status.

Run with ``--dry-run`` on any machine to check the import tree and the
dependency report without a GPU (the test suite does).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"torch": "torch", "triton": "triton", "msgpack": "msgpack", "grpc": "grpcio",
            "safetensors": "safetensors", "tokenizers": "tokenizers", "numpy": "numpy",
            "yaml": "pyyaml", "jinja2": "jinja2", "pytest": "pytest"}  # fmt: skip
OPTIONAL = {"transformers": "transformers (the parity tests' reference)"}
TESTS = ["tests/parallel/test_cuda.py", "tests/parallel/test_kernels.py"]
# Modules the GPU steps import: none of them may need Ray.
GPU_MODULES = ["pdserve", "pdserve.bench.kernels", "pdserve.parallel.model_runner"]


# `pdserve bench kernels` without the command line (which would import the cluster, and Ray).
KERNELS = """import argparse, sys
from pdserve.bench.cli import add_kind
parser = argparse.ArgumentParser()
add_kind(parser.add_subparsers(), "kernels")
args = parser.parse_args(["kernels", *sys.argv[1:]])
sys.exit(args.func(args))
"""


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


def run_step(name: str, command: list[str], env: dict[str, str], out: Path) -> int:
    print(f"== {name}: {' '.join(command)}", flush=True)
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"   exit {code}; log: {out / f'{name}.log'}", flush=True)
    return code


def check_imports(env: dict[str, str]) -> int:
    """Import the GPU steps' modules with Ray made unimportable."""
    probe = "import sys; sys.modules['ray'] = None\n" + "".join(
        f"import {m}\n" for m in GPU_MODULES
    )
    return subprocess.call([sys.executable, "-c", probe], cwd=ROOT, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--dry-run", action="store_true", help="check imports and packages only")
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
        env = {**os.environ, "PYTHONPATH": f"{import_tree(Path(tmp))}{os.pathsep}{ROOT}"}
        env.pop("TRITON_INTERPRET", None)
        if check_imports(env) != 0:
            print("pdserve's GPU modules do not import without Ray: see the error above")
            return 1
        if args.dry_run:
            print("dry run: the import tree works and no required package is missing")
            return 0
        return _run_all(out, env)


def _run_all(out: Path, env: dict[str, str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False")
        return 2
    steps = {
        "pytest": run_step(
            "pytest",
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *TESTS,
                f"--junitxml={out / 'junit.xml'}",
            ],
            env,
            out,
        ),
        "kernels": run_step(
            "kernels",
            [sys.executable, "-c", KERNELS, "--out", str(out / "kernels.json")],
            env,
            out,
        ),
    }
    summary = {
        "device": torch.cuda.get_device_name(0),
        "devices": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "steps": steps,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if not any(steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
