"""The house rules: no function over 50 lines, ruff format owns the layout, no object
reaches into another one's private members, an object its owner hands itself to (the
controller's health checks, membership, planning, warm pool and status; the simulated
cluster's scaling; a decode server's peer fills; the router's observer) sees the owner
through a Protocol of what it may touch, never the owner's class
(:data:`NARROW_VIEWS`), and argparse's namespace stops at a command's handler (below
it, a command's options are a frozen dataclass).

Short functions keep each step of the request path readable in one screen. Every
function and method of the source folders (read from pyproject's package map) is
held to the limit, except the Triton kernels under ``kernels/``, whose
bodies follow the kernel's math. Files have no line limit: a file holds one
responsibility and is as long as that responsibility is (the 400-line limit it
had became a target files were cut to, not a seam). Pure ``ast`` and text: no
import of pdserve, no Ray.

``ruff format`` owns the layout of every Python file: no ``fmt: skip`` or
``fmt: off`` comment (nor yapf's ``disable``, which ruff honours too) outside
:data:`FORMAT_KEPT`, which names each file or folder allowed one and why, with no
line numbers to go stale. Generated code (the gRPC ``*_pb2*.py`` under a ``gen/``
folder) is not ours to lay out.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path

from tests.package_map import ROOT, package_dirs

MAX_FUNCTION_LINES = 50
KERNELS = ROOT / "kernels"

# Where a formatter-off comment may stay (a file, or a folder and all below it): why.
FORMAT_KEPT: dict[str, str] = {}
FORMAT_OFF = re.compile(r"#\s*(fmt:\s*(off|skip)|yapf:\s*disable)\b")
NOT_SOURCE = {"__pycache__", "build", "dist", "node_modules"}  # besides hidden and egg-info


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
    assert {
        "core",
        "kernels",
        "models",
        "engine",
        "parallel",
        "router",
        "cluster",
        "api",
        "sim",
        "deploy",
    } <= names


def repo_python_files(root: Path = ROOT) -> Iterator[Path]:
    """Every .py file of the tree, less hidden folders (the venv, git), caches and builds."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d not in NOT_SOURCE and not d.endswith(".egg-info")
        )
        yield from (Path(folder) / f for f in sorted(files) if f.endswith(".py"))


def generated(path: Path) -> bool:
    return "_pb2" in path.name and "gen" in path.parts


def format_kept(rel: Path, kept: str | None = None) -> bool:
    """Whether ``rel`` is a place of FORMAT_KEPT (``kept``: that one alone)."""
    return any(rel.is_relative_to(k) for k in ([kept] if kept else FORMAT_KEPT))


def formatter_off(root: Path = ROOT) -> dict[Path, list[str]]:
    """Per file (relative to ``root``): its lines that turn the formatter off."""
    found: dict[Path, list[str]] = {}
    for path in repo_python_files(root):
        rel = path.relative_to(root)
        if generated(rel):
            continue
        lines = enumerate(path.read_text(errors="replace").splitlines(), 1)
        marked = [f"{rel}:{i}: {line.strip()}" for i, line in lines if FORMAT_OFF.search(line)]
        if marked:
            found[rel] = marked
    return found


def test_ruff_format_owns_the_layout() -> None:
    marked = formatter_off()
    outside = [h for rel, hits in marked.items() if not format_kept(rel) for h in hits]
    assert not outside, (
        f"{len(outside)} formatter-off comment(s) outside FORMAT_KEPT; let ruff format lay "
        "the code out (or, for a table whose columns line up, name the file in FORMAT_KEPT "
        "with why):\n" + "\n".join(outside)
    )
    stale = [k for k in FORMAT_KEPT if not any(format_kept(rel, k) for rel in marked)]
    assert not stale, f"FORMAT_KEPT names places with no formatter-off comment left: {stale}"


def test_the_format_rule_sees_each_marker_and_leaves_generated_code(tmp_path: Path) -> None:
    off, skip = "# fmt" + ": off", "# fmt" + ": skip"  # not written whole: this file has none
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "api_pb2.py").write_text(f"x = 1  {skip}\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text(f"{off}\n")
    (tmp_path / "a.py").write_text(f"x = [1,  2]  {skip}\ny = 2  # not fmt: skip\n{off}\n")
    assert formatter_off(tmp_path) == {
        Path("a.py"): [f"a.py:1: x = [1,  2]  {skip}", f"a.py:3: {off}"]
    }


# -- no reach into another object's private members --------------------------------------

# A private member (``_name``) is read or called only on ``self`` or ``cls``: what an
# object's collaborators may use is public, so it is what the object answers for. The
# library internals pdserve leans on, each with why: the leftmost name of the
# expression, or the whole expression.
LIBRARY_PRIVATE: dict[str, str] = {
    "argparse": "argparse types its subparser and group objects only under private names",
    "parser._actions": "argparse: the options a parser has, to list them in help",
    "torch": "torch's packed int4/int8 matmuls and oneDNN ops are private ops",
    "ctypes": "ctypes types its function pointers only under private names",
    "transformers": "the reference model is built from a config without weights",
    "config._attn_implementation": "transformers: the attention the reference model runs",
    "site._server": "aiohttp: the port a site bound to port 0 got",
    "options._timeout": "torch: a ProcessGroupNCCL's timeout is set through its options only",
}


def private_reaches(folders: list[Path]) -> list[str]:
    """``X._name`` in the source folders where X is not ``self`` or ``cls`` (dunders
    and LIBRARY_PRIVATE aside)."""
    return private_reaches_in(
        [p for p in python_files(folders) if not generated(p.relative_to(ROOT))]
    )


def private_reaches_in(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                continue
            text = ast.unparse(node)
            if text in LIBRARY_PRIVATE or text.split(".")[0] in LIBRARY_PRIVATE:
                continue
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            found.append(f"{where}:{node.lineno}: {text}")
    return found


def test_no_object_reaches_into_another_ones_private_members() -> None:
    found = private_reaches(source_folders())
    assert not found, (
        f"{len(found)} reach(es) into another object's private members; make what a "
        "collaborator uses public (or, for a library's, name it in LIBRARY_PRIVATE "
        "with why):\n" + "\n".join(found)
    )


def test_the_private_rule_sees_a_reach_and_leaves_self_alone(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "class A:\n"
        "    def f(self, other):\n"
        "        self._x = other._y\n"
        "        return cls._z, argparse._SubParsersAction, self.__class__\n"
    )
    got = [line.split(": ", 1)[1] for line in private_reaches_in([tmp_path / "m.py"])]
    assert got == ["other._y"]


# Objects an owner hands itself to, the Protocol each takes it as (the part of the
# owner's state it may touch: mypy checks that the owner has it and that the
# collaborator touches nothing else), and the owner's module, which they do not import.
NARROW_VIEWS: dict[str, tuple[str, str]] = {
    "cluster/health.py": ("HealthHost", "pdserve.cluster.controller"),
    "cluster/membership.py": ("MembershipHost", "pdserve.cluster.controller"),
    "cluster/planning.py": ("PlanningHost", "pdserve.cluster.controller"),
    "cluster/pool.py": ("PoolHost", "pdserve.cluster.controller"),
    "cluster/status.py": ("StatusSource", "pdserve.cluster.controller"),
    "sim/scaling.py": ("ScalingHost", "pdserve.sim.cluster"),
    "decode/peer.py": ("PeerFillHost", "pdserve.decode.server"),
    "router/observe.py": ("ObservedRouter", "pdserve.router.router"),
}


def narrow_view_faults(path: Path, protocol: str, owner: str) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    faults = [
        f"imports {owner}"
        for node in ast.walk(tree)
        if (isinstance(node, ast.ImportFrom) and node.module == owner)
        or (isinstance(node, ast.Import) and any(a.name == owner for a in node.names))
    ]
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    found = classes.get(protocol)
    if found is None or not any(
        ast.unparse(b) in ("Protocol", "typing.Protocol") for b in found.bases
    ):
        faults.append(f"defines no Protocol {protocol}")
    return faults


def test_each_collaborator_sees_its_owner_through_a_narrow_typed_view() -> None:
    faults = [
        f"{file}: {fault}"
        for file, (protocol, owner) in NARROW_VIEWS.items()
        for fault in narrow_view_faults(ROOT / file, protocol, owner)
    ]
    assert not faults, "\n".join(faults)


def test_the_narrow_view_rule_sees_an_owner_imported(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "from typing import Protocol\n"
        "from pdserve.cluster.controller import Controller\n"
        "class Host(Protocol):\n    x: int\n"
    )
    got = narrow_view_faults(tmp_path / "m.py", "Host", "pdserve.cluster.controller")
    assert got == ["imports pdserve.cluster.controller"]
    got = narrow_view_faults(tmp_path / "m.py", "Other", "pdserve.cluster.controller")
    assert got[-1] == "defines no Protocol Other"


# argparse's namespace stops at a command's handler (the function a parser's
# ``set_defaults(func=...)``, or an ``add_*`` parser builder, registers): below it a
# command's options are a frozen dataclass (``pdserve.core.options.options_from``).
# Other functions that may take or return a namespace, "path:function" -> why.
NAMESPACE_KEPT: dict[str, str] = {
    "core/options.py:options_from": "the conversion itself, from a handler's namespace",
}


def _is_namespace(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation).strip("'\"")
    return text in ("argparse.Namespace", "Namespace")


def registered_handlers(tree: ast.AST) -> set[str]:
    """Names of the functions a module registers as command handlers."""
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        callee = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if callee == "set_defaults" or callee.startswith("add_"):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Name):
                    names.add(arg.id)
                elif isinstance(arg, ast.Attribute):
                    names.add(arg.attr)
    return names


def namespace_uses(paths: list[Path], root: Path = ROOT) -> tuple[list[str], set[str]]:
    """Functions other than handlers that take or return a namespace, and calls that
    build one by hand; and the NAMESPACE_KEPT entries met."""
    found, kept = [], set()
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        handlers = registered_handlers(tree)
        rel = path.relative_to(root) if path.is_relative_to(root) else Path(path.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "argparse.Namespace",
                "Namespace",
            ):
                found.append(f"{rel}:{node.lineno}: builds a namespace by hand")
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            typed = [p.annotation for p in params if p is not None]
            if not any(map(_is_namespace, [*typed, node.returns])) or node.name in handlers:
                continue
            key = f"{rel}:{node.name}"
            if key in NAMESPACE_KEPT:
                kept.add(key)
            else:
                found.append(f"{rel}:{node.lineno}: {node.name}")
    return found, kept


def test_the_namespace_stops_at_the_command_line_handlers() -> None:
    paths = [p for p in python_files(source_folders()) if not generated(p.relative_to(ROOT))]
    found, kept = namespace_uses(paths)
    assert not found, (
        f"{len(found)} function(s) below a command's handler take or return "
        "argparse.Namespace (or build one); give them the command's options as a frozen "
        "dataclass (pdserve.core.options.options_from, in the handler):\n" + "\n".join(found)
    )
    assert kept == set(NAMESPACE_KEPT), f"stale NAMESPACE_KEPT: {set(NAMESPACE_KEPT) - kept}"


def test_the_namespace_rule_sees_a_function_below_the_handler(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "import argparse\n"
        "def add_arguments(p: argparse.ArgumentParser) -> None:\n"
        "    p.set_defaults(func=run)\n"
        "def run(args: argparse.Namespace) -> int:\n"
        "    return helper(args)\n"
        "def helper(args: 'argparse.Namespace') -> int:\n"
        "    return 0\n"
        "def fake() -> Namespace:\n"
        "    return argparse.Namespace(x=1)\n"
    )
    found, _ = namespace_uses([tmp_path / "m.py"], tmp_path)
    got = sorted(line.split(": ", 1)[1] for line in found)
    assert got == ["builds a namespace by hand", "fake", "helper"]
