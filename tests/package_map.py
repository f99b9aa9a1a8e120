"""The source modules of pdserve, by import name, read from pyproject's package map.

pyproject.toml maps each source folder into the ``pdserve`` namespace with
``[tool.setuptools.package-dir]`` (``core/`` is ``pdserve.core``, ``api/`` is
``pdserve`` itself); there is no ``pdserve/`` folder. Tools that need module
names for files (the import-order test, the type check) read that one map here
rather than keeping a copy of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy, a test dependency, installs tomli where tomllib is missing
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> its folder, as ``[tool.setuptools.package-dir]`` lists them."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {package: root / folder for package, folder in mapping.items()}


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file of every module of every mapped package.

    A module with a stub beside it (the generated gRPC code) is given by its
    ``.pyi``, which is what a type checker should read.
    """
    modules: dict[str, Path] = {}
    for package, folder in package_dirs(root).items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            stub = path.with_suffix(".pyi")
            modules[name] = stub if stub.is_file() else path
    return modules
