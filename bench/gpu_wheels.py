"""Wheels that bring Ray to a GPU machine with no network, small enough to copy there.

    python3 bench/gpu_wheels.py                       (writes .whl/)

A GPU image with torch, triton, grpcio, msgpack and aiohttp but no Ray can run
every step of ``bench/gpu_check.py`` but one: ``ttft`` (disaggregated against
colocated TTFT) starts instances as Ray actors, as a cluster does. Ray's
wheel alone is ~79 MB, so this writes a slimmed copy of it: without its Java
jar, its dashboard's web client and the libraries pdserve never imports
(rllib, tune, train, data, serve, llm, air), its RECORD rewritten to match;
beside it the wheels of Ray's needs such an image lacks (jsonschema and its
own three). Versions are this environment's. It prints the wheels' size and
the source tree's against ``--budget-mib`` (what the copy may hold, tree and
wheels together) and fails when they do not fit. On the GPU machine::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 bench/gpu_check.py --steps ttft
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Ray's needs that a torch GPU image (with aiohttp, grpcio, requests ...) lacks.
NEEDS = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
# Parts of Ray's wheel that a cluster of Python actors never loads.
DROPPED = (
    "ray/jars/",  # the Java worker
    "ray/dashboard/client/",  # the dashboard's web pages (pdserve runs Ray without them)
    *(f"ray/{lib}/" for lib in ("rllib", "tune", "train", "data", "serve", "llm", "air")),
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MIB = 1 << 20


def download(names: list[str], dest: Path, python_version: str) -> None:
    """Binary wheels of ``names`` (pinned: ``name==version``) for CPython ``python_version``."""
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(dest),
            *names,
        ],
        check=True,
    )


def slim(wheel: Path, dest: Path, dropped: tuple[str, ...] = DROPPED) -> Path:
    """A copy of ``wheel`` in ``dest`` without the files under ``dropped``, whose RECORD
    lists only the files kept."""
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if name.startswith(dropped):
                continue
            data = src.read(info)
            if name.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not line.startswith(dropped)]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return out


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files git tracks or would track (untracked, not ignored) under ``root``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    paths = (root / p.decode() for p in listed.split(b"\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file())


def pinned(name: str) -> str:
    return f"{name}=={importlib.metadata.version(name)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--budget-mib", type=float, default=64.0)
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="pdserve-wheels-") as tmp:
        download([pinned("ray")], Path(tmp), args.python_version)
        (ray_wheel,) = Path(tmp).glob("ray-*.whl")
        slim(ray_wheel, dest)
        print(
            f"{ray_wheel.name}: {ray_wheel.stat().st_size / MIB:.1f} MiB, slimmed to "
            f"{(dest / ray_wheel.name).stat().st_size / MIB:.1f} MiB"
        )
    download([pinned(name) for name in NEEDS], dest, args.python_version)
    wheels = sum(p.stat().st_size for p in dest.glob("*.whl"))
    tree = tree_bytes()
    total = (wheels + tree) / MIB
    print(
        f"wheels {wheels / MIB:.1f} MiB + source tree {tree / MIB:.1f} MiB = {total:.1f} MiB "
        f"of {args.budget_mib:g} MiB"
    )
    if total > args.budget_mib:
        print("over the budget: they do not fit in one copy")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
