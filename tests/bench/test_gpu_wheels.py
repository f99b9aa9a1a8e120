"""Ray's wheel slimmed for a GPU machine with no network: pip installs what is kept."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from pdserve.bench import gpu_wheels

ROOT = Path(__file__).resolve().parents[2]

FILES = {
    "toyray/__init__.py": "VERSION = 1\n",
    "toyray/core/raylet.py": "RUNS = True\n",
    "toyray/jars/dist.jar": "java\n",
    "toyray/rllib/algo.py": "import torch\n",
}


def toy_wheel(folder: Path) -> Path:
    """A wheel of package ``toyray`` whose RECORD lists every file (hashes left out, as
    pip allows)."""
    info = "toyray-1.0.dist-info"
    meta = {
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: toyray\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files = {**FILES, **meta}
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    path = folder / "toyray-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def test_dropped_parts_leave_the_wheel_and_its_record_and_pip_installs_the_rest(
    tmp_path: Path,
) -> None:
    source = toy_wheel(tmp_path)
    out = tmp_path / "slim"
    out.mkdir()
    slimmed = gpu_wheels.slim(source, out, dropped=("toyray/jars/", "toyray/rllib/"))
    with zipfile.ZipFile(slimmed) as z:
        names = set(z.namelist())
        record = z.read("toyray-1.0.dist-info/RECORD").decode()
    assert {"toyray/__init__.py", "toyray/core/raylet.py"} <= names
    assert not any(n.startswith(("toyray/jars/", "toyray/rllib/")) for n in names)
    assert "jars" not in record and "rllib" not in record and "toyray/core/raylet.py" in record

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(site),
            str(slimmed),
        ],
        check=True,
    )
    assert (site / "toyray" / "core" / "raylet.py").read_text() == "RUNS = True\n"
    assert not (site / "toyray" / "jars").exists() and not (site / "toyray" / "rllib").exists()


def test_ray_keeps_what_pdserve_imports() -> None:
    # the parts dropped from Ray are none that pdserve's code imports
    root = ROOT
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    imported = set()
    for path in listed:
        for line in (root / path).read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from") and words[1].startswith("ray."):
                imported.add(words[1].replace(".", "/") + "/")
    assert imported, "no ray submodule found: the scan is broken"
    assert not [m for m in imported if m.startswith(gpu_wheels.DROPPED)]
