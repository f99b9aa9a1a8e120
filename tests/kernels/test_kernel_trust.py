"""A compiled CPU kernel is loaded only from a private folder and only if its bytes are
the ones built: a library planted under the predictable name is never run."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from pdserve.kernels import cpu_build

PROBE = "int pdserve_probe(void) { return 7; }\n"
# Run by the dynamic loader the moment the library is loaded: it leaves a mark.
PLANTED = """#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PDSERVE_PLANTED_MARK"), "w");
    if (f) fclose(f);
}
int pdserve_probe(void) { return 666; }
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A kernel source, the name its library gets, and a planted library."""
    monkeypatch.setenv("PDSERVE_PLANTED_MARK", str(tmp_path / "planted-ran"))
    source = tmp_path / f"probe_{tmp_path.name}.c"  # a new key (and name) per test
    source.write_text(PROBE)
    (tmp_path / "planted.c").write_text(PLANTED)
    planted = tmp_path / "planted.so"
    cmd = ["cc", "-shared", "-fPIC", str(tmp_path / "planted.c"), "-o", str(planted)]
    subprocess.run(cmd, check=True)
    # Built once elsewhere to learn the predictable name an attacker would plant under.
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "elsewhere"))
    cpu_build.compile_library.cache_clear()
    assert _probe(source) == 7
    (built,) = (tmp_path / "elsewhere" / "kernels").glob("probe_*.so")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cpu_build.compile_library.cache_clear()
    yield source, built.name, planted
    cpu_build.compile_library.cache_clear()


def _probe(source: Path) -> int:
    lib = cpu_build.compile_library(source, "probe")
    assert lib is not None
    return int(cpu_build.declare(lib, "pdserve_probe", [])())


def _plant(folder: Path, name: str, planted: Path, mode: int) -> None:
    folder.mkdir(parents=True)
    os.chmod(folder, mode)
    shutil.copyfile(planted, folder / name)
    # A record that matches: anyone who can write the folder can write both.
    digest = hashlib.sha256(planted.read_bytes()).hexdigest()
    (folder / f"{name}.sha256").write_text(digest)


def test_built_library_and_its_record_are_private(probe, tmp_path):
    source, name, _ = probe
    assert _probe(source) == 7
    lib = tmp_path / "cache" / "kernels" / name
    assert stat.S_IMODE(lib.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(lib.stat().st_mode) == 0o600
    assert stat.S_IMODE(lib.with_name(f"{name}.sha256").stat().st_mode) == 0o600
    cpu_build.compile_library.cache_clear()
    assert _probe(source) == 7  # loaded from the cache, its hash matching


def test_library_planted_in_a_private_folder_without_its_record_is_rebuilt(probe, tmp_path):
    source, name, planted = probe
    folder = tmp_path / "cache" / "kernels"
    _plant(folder, name, planted, 0o700)
    (folder / f"{name}.sha256").write_text(hashlib.sha256(b"what was built").hexdigest())
    assert _probe(source) == 7
    assert not (tmp_path / "planted-ran").exists(), "the planted library was loaded"


def test_library_planted_in_a_world_writable_folder_is_not_loaded(probe, tmp_path, caplog):
    source, name, planted = probe
    _plant(tmp_path / "cache" / "kernels", name, planted, 0o777)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert _probe(source) == 7
    assert not (tmp_path / "planted-ran").exists(), "the planted library was loaded"
    assert "not private" in caplog.text
