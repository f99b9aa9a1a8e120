"""The two OS primitives the shared-memory collectives wait with (Linux, x86-64).

:func:`futex` sleeps on, or wakes sleepers on, a 32-bit word of a shared
mapping (``futex(2)``, the shared flavour: the word may be mapped by several
processes); :func:`process_alive` tells a waiter whether the peer it waits for
still exists. Both are used by :mod:`pdserve.distributed.shm_comm`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

SYS_FUTEX = 202  # x86-64
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared (not private): the word is in a shared mapping

_LIBC = ctypes.CDLL(None, use_errno=True)
_SYSCALL = _LIBC.syscall
# Declared once, so a call converts plain ints without building ctypes objects.
_SYSCALL.argtypes = [
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_uint32,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int,
]
_SYSCALL.restype = ctypes.c_long


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex(address: int, op: int, value: int, timeout: Any = None) -> None:
    """``futex(2)`` on the 32-bit word at ``address``; EAGAIN and timeouts are normal.

    ``timeout``: None, or ``ctypes.byref`` of a :class:`Timespec` (FUTEX_WAIT).
    """
    _SYSCALL(SYS_FUTEX, address, op, value, timeout, None, 0)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")
