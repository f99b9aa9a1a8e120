"""Imports run one way, down the request path, and no module is part of an import loop.

Every ``import`` of every source module is read with ``ast`` (module level,
inside functions, and under ``if TYPE_CHECKING:``) and mapped to the part of
pdserve it lands in. A part may import its own modules and any lower part;
parts on one level may not import each other. ``from package import name``
counts as importing the module ``package.name`` when there is one, and as
importing ``package`` otherwise; importing a module is not counted as importing
its parent package.

Loops are looked for among the imports that run (type-only imports are left
out: they never execute, and a type named in both directions is not a loop).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.package_map import package_dirs, source_modules

# Lowest first. ``api`` is the package mapped to ``pdserve`` itself (pdserve,
# pdserve.llm, pdserve.backends); ``bench`` is a client of the cluster and the
# API; ``sim`` drives the real engine, router and planner objects and replays
# bench's workloads into bench's reports, so it sits above both; ``deploy`` (the
# command line) above everything it runs. Below the engine, what a rank computes:
# ``kernels`` (C and Triton ops, attention backends), ``distributed`` (a rank's place in
# its instance and the collectives its layers call), ``models`` (families, layers,
# weight loading, the built-in models); ``parallel`` (groups, the rank worker and its
# instance) runs the engine's plans on a model.
LEVELS: list[set[str]] = [
    {"core"},
    {"kernels"},
    {"distributed"},
    {"models"},
    {"engine"},
    {"parallel"},
    {"transfer"},
    {"prefill", "decode"},
    {"router"},
    {"cluster"},
    {"api"},
    {"bench"},
    {"sim"},
    {"deploy"},
]

# The router reaches workers only through Ray actor handles and core messages,
# never through the code that runs them (it may use the engine's pure helpers:
# block hashing for its prefix index, the detokenizer for its streams).
FORBIDDEN: dict[str, set[str]] = {
    "router": {"kernels", "distributed", "models", "parallel", "transfer", "prefill", "decode"}
}

# Upward imports that exist today: (importer, imported module) -> what should change.
# Remove an entry when its import goes; the test fails on an entry that no longer
# matches an upward import, so the list only shrinks.
ALLOWED: dict[tuple[str, str], str] = {}

# Import loops that exist today: the modules of the loop -> what should change.
ALLOWED_LOOPS: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    runs: bool  # False for an import under ``if TYPE_CHECKING:``


def part_of(module: str) -> str:
    """``pdserve.router.frontdoor.auth`` -> ``router``; the top-level package -> ``api``."""
    parts = module.split(".")
    if len(parts) > 1 and any(parts[1] in level for level in LEVELS):
        return parts[1]
    return "api"


def level_of(part: str) -> int:
    return next(i for i, level in enumerate(LEVELS) if part in level)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    nodes: list[ast.stmt] | list[ast.AST], runs: bool = True
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement among ``nodes`` and inside them, and whether it runs."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, runs
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, runs=False)
            yield from _walk(node.orelse, runs)
        else:
            yield from _walk(list(ast.iter_child_nodes(node)), runs)


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """The pdserve modules ``module`` (source at ``path``) imports."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = []
    for node, runs in _walk(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for target in dict.fromkeys(targets):
            if target.split(".")[0] == "pdserve" and target != module:
                found.append(Import(module, target, node.lineno, runs))
    return found


@functools.cache
def all_imports() -> tuple[Import, ...]:
    modules = source_modules()
    known = set(modules)
    return tuple(imp for name, path in modules.items() for imp in imports_of(name, path, known))


def breaks_layering(imp: Import) -> str | None:
    """Why an import runs the wrong way, or None."""
    src, dst = part_of(imp.importer), part_of(imp.imported)
    if src == dst:
        return None
    if dst in FORBIDDEN.get(src, set()):
        return f"{src} may not import {dst}"
    if level_of(dst) > level_of(src):
        return f"{src} is below {dst}"
    if level_of(dst) == level_of(src):
        return f"{src} and {dst} are on one level"
    return None


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_every_mapped_package_has_a_level() -> None:
    """A new top-level folder must be placed in LEVELS before its imports can be judged."""
    parts = {package.split(".")[1] for package in package_dirs() if package != "pdserve"}
    assert not [p for p in sorted(parts) if not any(p in level for level in LEVELS)]


def test_every_import_names_a_source_module() -> None:
    """The map is complete: an import the test cannot place would go unchecked."""
    known = set(source_modules())
    unknown = [
        f"{i.importer}:{i.line} imports {i.imported}"
        for i in all_imports()
        if i.imported not in known
    ]
    assert not unknown, "\n".join(unknown)


def test_imports_only_run_downward() -> None:
    imports = all_imports()
    wrong = [
        f"{i.importer}:{i.line} imports {i.imported} ({why})"
        for i in imports
        if (why := breaks_layering(i)) and (i.importer, i.imported) not in ALLOWED
    ]
    assert not wrong, "upward imports:\n" + "\n".join(wrong)
    seen = {(i.importer, i.imported) for i in imports}
    stale = [
        edge
        for edge in ALLOWED
        if edge not in seen or breaks_layering(Import(*edge, 0, True)) is None
    ]
    assert not stale, f"allowed imports that no longer break the layering: {stale}"


def test_no_import_loops() -> None:
    edges: dict[str, set[str]] = {name: set() for name in source_modules()}
    for imp in all_imports():
        if imp.runs and imp.imported in edges:
            edges[imp.importer].add(imp.imported)
    loops = find_cycles(edges)
    assert not [loop for loop in loops if frozenset(loop) not in ALLOWED_LOOPS], loops
    stale = [sorted(loop) for loop in ALLOWED_LOOPS if sorted(loop) not in loops]
    assert not stale, f"allowed import loops that are gone: {stale}"


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    """An upward import, a same-level import and a function-level loop are all seen."""
    (tmp_path / "a.py").write_text(
        "from pdserve.router.router import Router\n"
        "def f():\n    from pdserve.decode import server\n"
    )
    known = {"pdserve.decode.server", "pdserve.router.router"}
    upward, sideways = imports_of("pdserve.prefill.server", tmp_path / "a.py", known)
    assert breaks_layering(upward) == "prefill is below router"
    assert breaks_layering(sideways) == "prefill and decode are on one level"
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert part_of("pdserve") == part_of("pdserve.llm") == "api"
