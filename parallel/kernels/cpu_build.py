"""Building the CPU C kernels: compiled with the system C compiler on first use.

Each kernel source next to its Python module (``cpu_kernel.c`` for paged decode
attention, ``cpu_ops.c`` for the fused layer ops) may include the helpers they
share (``cpu_math.h``, beside this module). It is compiled once per source,
header, flags and CPU model (about a second), cached under the built-in models'
cache folder, and loaded with :mod:`ctypes`. Without a compiler, or when the build
fails, :func:`compile_library` returns None and the caller falls back to torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.core.builtin_models import cache_dir
from pdserve.parallel.cpu_features import cpu_model

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_HEADER = Path(__file__).with_name("cpu_math.h")


@functools.cache
def compile_library(source: Path, stem: str) -> ctypes.CDLL | None:
    """``source`` compiled into a shared library named after ``stem``; None if it cannot be."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the C kernels of %s are unavailable", source.name)
        return None
    text = source.read_bytes() + _HEADER.read_bytes()
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + cpu_model().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{stem}_{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *FLAGS, f"-I{_HEADER.parent}", str(source), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            logger.warning("building %s failed:\n%s", source.name, proc.stderr)
            return None
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))


def declare(
    lib: ctypes.CDLL, name: str, argtypes: list[type[ctypes._SimpleCData]]
) -> ctypes._NamedFuncPointer:
    """``lib.name`` returning a C int, taking ``argtypes``."""
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn
