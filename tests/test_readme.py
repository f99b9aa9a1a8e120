"""The examples of README.md and the docs pages, run as a user would: each block in a
fresh process.

Every ```python and shell block (```, ```bash, ```sh) of README.md and of the docs
pages in ``PAGES`` is a test, named by its page, its section and the line it starts
on. Python blocks run in a new interpreter; shell blocks run line by line with
``bash`` (the ``pdserve`` of this interpreter's environment first on PATH), in a
scratch folder that sees the repository's files, with no Ray running and no
fixture. An HTML comment on the line before a block says how to take it:

- ``<!-- readme: skip: REASON -->``: not runnable on this machine (a GPU,
  Kubernetes, a remote head, a placeholder for the user's own files); skipped
  with that reason.
- ``<!-- readme: long -->``: runs for minutes (a benchmark, a validation):
  ``make readme`` runs it, ``make test`` skips it by name.
- ``<!-- readme: continues -->``: a Python block run after the Python block
  before it, in the same process (it uses that block's names).
- ``<!-- readme: server -->``: a shell block whose first line serves until it
  is stopped: it is started, the other lines run once it says it serves, then it
  gets SIGTERM and must stop cleanly (exit 0, no traceback).
- ``<!-- readme: with server -->``: a Python or shell block that talks to the
  cluster of the ``server`` block above it on its page: it runs while that
  cluster serves, after the server block's own lines, in page order.

`make test` runs the blocks in the lane of the tests that start no cluster (each
block's Ray is its own), and the serving blocks after the cluster lane's tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The pages whose examples are run, and the docs pages that have none to run.
PAGES = (
    "README.md",
    "docs/features.md",
    "docs/parallelism.md",
    "docs/lora.md",
    "docs/serving.md",
    "docs/requests.md",
    "docs/security.md",
    "docs/operations.md",
    "docs/planning.md",
    "docs/development.md",
)
NOT_RUN = {"docs/ARCHITECTURE.md": "its blocks are diagrams", "docs/config.md": "no examples"}
SHELL = {"", "bash", "sh", "shell"}
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"<!-- readme: (skip: .+?|long|continues|server|with server) -->\s*$")
BLOCK_LIMIT_S = 300  # one block, as written, on a loaded two-core machine
SERVING = "pdserve: serving"  # what `pdserve serve` prints once its endpoints are up


@dataclass(frozen=True)
class Block:
    page: str  # the file, from the repository's root
    line: int  # where the block opens in it
    section: str
    lang: str
    code: str
    mark: str | None

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"{self.page}:{slug}:{self.line}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks = []
    for m in BLOCK.finditer(text):
        lang = m.group(1)
        if lang != "python" and lang not in SHELL:
            continue  # configs and outputs
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        headings = re.findall(r"^#+ (.+)$", text[: m.start()], re.M)
        line = text[: m.start()].count("\n") + 1
        section = headings[-1] if headings else "top"
        mark_name = mark.group(1) if mark else None
        blocks.append(Block(page, line, section, lang, m.group(2), mark_name))
    return blocks


BY_PAGE = {page: readme_blocks((ROOT / page).read_text(), page) for page in PAGES}
BLOCKS = [block for blocks in BY_PAGE.values() for block in blocks]


def commands(code: str) -> list[str]:
    """A shell block's commands: one a line, a trailing backslash joins the next."""
    joined = code.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def python_source(block: Block) -> str:
    """The block's code, after the Python blocks it continues on its page."""
    blocks = BY_PAGE[block.page]
    i = blocks.index(block)
    parts = [block.code]
    while blocks[i].mark == "continues":
        i -= 1
        while blocks[i].lang != "python":
            i -= 1
        parts.insert(0, blocks[i].code)
    return "\n".join(parts)


def served_with(server: Block) -> list[Block]:
    """The ``with server`` blocks after ``server`` on its page, up to the next server."""
    blocks = BY_PAGE[server.page]
    found = []
    for block in blocks[blocks.index(server) + 1 :]:
        if block.mark == "server":
            break
        if block.mark == "with server":
            found.append(block)
    return found


def run_block(block: Block, cwd: Path) -> None:
    """A Python block in a new interpreter, or a shell block line by line."""
    if block.lang == "python":
        check(run([sys.executable, "-c", python_source(block)], cwd), block.name)
    else:
        for command in commands(block.code):
            check(run(["bash", "-c", command], cwd), command)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A folder that sees the repository's files, for what the commands write."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


@pytest.fixture(autouse=True)
def no_ray_around(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray temp folder of the test's own: the blocks find no Ray this suite started."""
    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: sockets


def fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k == "RAY_TMPDIR"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=fresh_env(), capture_output=True, text=True, timeout=BLOCK_LIMIT_S
    )


def check(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, f"{what}:\n{result.stderr[-3000:]}"


def serve_and_run(block: Block, cwd: Path) -> None:
    first, *rest = commands(block.code)
    server = subprocess.Popen(
        ["bash", "-c", f"exec {first}"],
        cwd=cwd,
        env=fresh_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert server.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + BLOCK_LIMIT_S
        while not any(SERVING in line for line in lines):
            line = server.stdout.readline()
            assert line and time.monotonic() < deadline, f"{first} never served:\n{''.join(lines)}"
            lines.append(line)
        for command in rest:
            check(run(["bash", "-c", command], cwd), command)
        for client in served_with(block):
            run_block(client, cwd)
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.communicate()
    log = "".join(lines) + out
    assert server.returncode == 0, f"{first} exited {server.returncode} on SIGTERM:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]


def ids(block: Block) -> str:
    return block.name


@pytest.mark.timeout(BLOCK_LIMIT_S * 3)
@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.mark not in ("server", "with server")], ids=ids
)
def test_readme_block_runs_as_written(block: Block, scratch: Path) -> None:
    if block.mark and block.mark.startswith("skip: "):
        pytest.skip(block.mark.removeprefix("skip: "))
    if block.mark == "long" and not os.environ.get("PDSERVE_README_LONG"):
        pytest.skip("runs for minutes: `make readme` runs it")
    run_block(block, scratch)


# `pdserve serve` finds no Ray the suite started: the blocks get a Ray temp folder of
# their own (no_ray_around), and "auto" joins only a cluster announced there.
@pytest.mark.cluster
@pytest.mark.timeout(BLOCK_LIMIT_S * 3)
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "server"], ids=ids)
def test_readme_serving_block_runs_as_written(block: Block, scratch: Path) -> None:
    serve_and_run(block, scratch)


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_found_and_marks_are_known(page: str) -> None:
    text = (ROOT / page).read_text()
    blocks = BY_PAGE[page]
    marks = re.findall(r"<!-- readme: .*?-->", text)
    assert all(MARK.match(m) for m in marks), marks  # a misspelt mark runs nothing silently
    assert sum(b.mark is not None for b in blocks) == len(marks)  # each mark sits on a block
    served = {c.line for b in blocks if b.mark == "server" for c in served_with(b)}
    clients = {b.line for b in blocks if b.mark == "with server"}
    assert clients == served, "a `with server` block needs a `server` block above it"


def test_every_docs_page_is_run_or_says_why_not() -> None:
    assert len(BLOCKS) >= 5
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    left = pages - set(PAGES) - set(NOT_RUN)
    assert not left, f"add {sorted(left)} to PAGES (or NOT_RUN) in tests/test_readme.py"
