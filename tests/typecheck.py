"""Type-check pdserve's source folders under their real module names (``make typecheck``).

mypy derives a module's name from its path, and pdserve's folders are mapped
into the ``pdserve`` namespace by pyproject's package map, so plain ``mypy
core/`` would call the modules ``core.*``. This runs mypy's build on every
module of :func:`~tests.package_map.source_modules` under its import name,
with the ``[tool.mypy]`` settings of pyproject.toml.

    python -m tests.typecheck [PREFIX ...]    # default: every module of pdserve

A prefix keeps the modules whose name is it or starts with it plus a dot;
``core`` is short for ``pdserve.core``. Every module is checked either way (so
imports resolve); only the selected modules' errors are reported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

from tests.package_map import ROOT, source_modules


def selected(prefixes: list[str]) -> set[Path]:
    """Source files of the modules named by ``prefixes`` (``core`` is short for ``pdserve.core``)."""
    prefixes = [p if p.split(".")[0] == "pdserve" else f"pdserve.{p}" for p in prefixes]
    return {
        path.resolve()
        for name, path in source_modules().items()
        if any(name == p or name.startswith(p + ".") for p in prefixes)
    }


def main(argv: list[str]) -> int:
    # Every module is built, whatever is selected: a module left out would be
    # missing to the others' imports, which would then check as Any.
    sources = [BuildSource(str(path), name) for name, path in source_modules().items()]
    wanted = selected(argv or ["pdserve"])
    if not wanted:
        print(f"no module matches {argv}", file=sys.stderr)
        return 2
    _, options = process_options(
        ["--config-file", str(ROOT / "pyproject.toml")], require_targets=False
    )
    # A cache of its own: runs with another module list must not share its entries.
    options.cache_dir = str(ROOT / ".mypy_cache" / "package-map")
    # mypy searches the working directory for imports too, where a third-party import of
    # a top-level name pdserve has a folder for (transformers imports ``kernels``, Hugging
    # Face's package) would find pdserve's folder under a second name: build from elsewhere.
    here = os.getcwd()
    (ROOT / ".mypy_cache").mkdir(exist_ok=True)
    os.chdir(ROOT / ".mypy_cache")
    try:
        result = build.build(sources, options)
    finally:
        os.chdir(here)
    lines = [line for line in result.errors if Path(line.split(":", 1)[0]).resolve() in wanted]
    for line in lines:
        print(line)
    errors = [line for line in lines if ": error:" in line]
    if errors:
        files = {line.split(":", 1)[0] for line in errors}
        print(f"Found {len(errors)} errors in {len(files)} files (checked {len(wanted)} modules)")
        return 1
    print(f"Success: no issues found in {len(wanted)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
