"""Files holding request data, keys or weights are this user's alone: 0600 in 0700
folders, whatever the umask and whatever was there before."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.core.private_files import (
    is_private_dir,
    make_private,
    open_private,
    private_dir,
    write_private,
)
from pdserve.models import builtin as builtin_models


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def wide_umask() -> Iterator[None]:
    """The usual umask: files and folders would be 0644 and 0755."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_folders_are_made_or_narrowed_to_0700(tmp_path: Path) -> None:
    deep = private_dir(tmp_path / "a" / "b")
    assert _mode(deep) == _mode(deep.parent) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o777)
    os.chmod(wide, 0o777)
    assert not is_private_dir(wide)
    private_dir(wide)
    assert _mode(wide) == 0o700 and is_private_dir(wide)


def test_files_are_written_0600(tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.write_text("x")
    old.chmod(0o644)
    with open_private(old, "w") as f:
        f.write("new")
    with open_private(tmp_path / "fresh", "ab") as f:
        f.write(b"1")
    write_private(tmp_path / "whole", "text")
    for name in ("old", "fresh", "whole"):
        assert _mode(tmp_path / name) == 0o600, name
    assert (tmp_path / "old").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "old", "whole"]


def test_builtin_model_cache_holds_its_weights_privately(tmp_path, monkeypatch, tiny_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    # One written before its files were private: narrowed when it is next resolved.
    target = tmp_path / "cache" / f"builtin-tiny-v{builtin_models.GENERATOR_VERSION}"
    shutil.copytree(tiny_path, target)
    for path in (target, *target.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert builtin_models.resolve_model("builtin:tiny") == target
    assert _mode(target) == 0o700
    assert {_mode(p) for p in target.iterdir()} == {0o600}
    # And one generated now.
    shutil.rmtree(target)
    made = builtin_models.resolve_model("builtin:tiny")
    assert _mode(made) == _mode(made.parent) == 0o700
    assert {_mode(p) for p in made.iterdir()} == {0o600}
    make_private(made)  # nothing left to narrow
