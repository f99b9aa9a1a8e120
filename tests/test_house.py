"""The house rule on size: no function over 50 lines.

Short functions keep each step of the request path readable in one screen. Every
function and method of the source folders (read from pyproject's package map) is
held to the limit, except the Triton kernels under ``parallel/kernels/``, whose
bodies follow the kernel's math. Files have no line limit: a file holds one
responsibility and is as long as that responsibility is (the 400-line limit it
had became a target files were cut to, not a seam). Pure ``ast`` and text: no
import of pdserve, no Ray.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.package_map import ROOT, package_dirs

MAX_FUNCTION_LINES = 50
KERNELS = ROOT / "parallel" / "kernels"


def source_folders() -> list[Path]:
    """The top folders of the package map (a mapped subfolder is searched with its parent)."""
    folders = sorted(set(package_dirs().values()))
    return [f for f in folders if not any(p in folders for p in f.parents)]


def python_files(folders: list[Path]) -> Iterator[Path]:
    for folder in folders:
        yield from sorted(folder.rglob("*.py"))


def long_functions(folders: list[Path]) -> list[str]:
    found = []
    for path in python_files(folders):
        if path.is_relative_to(KERNELS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}, {n} lines")
    return found


def test_no_function_is_over_the_limit() -> None:
    over = long_functions(source_folders())
    assert not over, (
        f"{len(over)} function(s) over {MAX_FUNCTION_LINES} lines; give part of each "
        "a named helper:\n" + "\n".join(over)
    )


def test_the_rules_see_the_source_folders() -> None:
    names = {f.name for f in source_folders()}
    assert {"core", "engine", "parallel", "router", "cluster", "api", "sim", "deploy"} <= names
