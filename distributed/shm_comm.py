"""Shared-memory collectives for the ranks of one process group on one host.

gloo moves every collective through TCP loopback, ~100-200 µs of round trips
per call; a decode step makes about twenty of them. A :class:`ShmCommunicator`
moves the data through one segment under ``/dev/shm`` that every rank of the
group maps instead::

    offset 0             header, one 64-byte line per rank r:
                           [r*64 + 0]  int64  calls rank r has entered (its counter)
                           [r*64 + 8]  int64  pid of rank r (checked while waiting)
                           [r*64 + 16] int64  1 once rank r aborted the group
    offset 64 * world    slots[phase][rank], phase = call % 2, slot_bytes each

Call ``n`` on every rank: write this rank's part into ``slots[n % 2][rank]``,
store ``n`` in its counter, wait until every counter is >= ``n``, read what it
needs. A rank entering call ``n + 2`` (the same phase) has seen every counter
>= ``n + 1``, so every peer has finished reading call ``n``: two phases make one
barrier per call enough. Larger tensors go through in slot-sized chunks, one
call each. Every rank sums the slots in rank order with the same ops, so every
rank gets the same bits (for two ranks, the bits of gloo's ``a + b``).

Ordering relies on x86-64's total store order (the data stores are visible
before the counter store after them), so the communicator is only offered
there (:func:`shm_supported`); elsewhere groups stay on gloo.

Waiting spins for a few tens of µs (a follower waiting for the next plan: up to 1 ms, the
leader's work between two steps), then sleeps on a futex (:mod:`pdserve.distributed.futex`) on
the lagging rank's counter (its low 32 bits), which that rank wakes after each store: a
waiting rank gives its core back, which matters when ranks share cores with other processes,
and wakes within microseconds. A peer whose process is gone, or a wait longer than the
timeout, raises :class:`ShmCollectiveError` (a ``RuntimeError``, as gloo's failures are),
and the communicator refuses every later call; so does every peer's wait, however patient,
once a rank gave the group up (:meth:`ShmCommunicator.abort`).

Set-up (:func:`open_group_shm`, collective over the group's gloo channel): every rank
gathers a host key (hostname, boot id, pid namespace); if all keys match, the group's
first rank creates the segment file (0600: only this user may map it) and broadcasts its
path, the others map it, and all agree (a gloo MIN) that every rank attached. Then the
creator unlinks the file: the memory lives exactly as long as some rank maps it, so
nothing is left behind when a rank is killed.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import re
import socket
import struct
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdserve.core.private_files import open_private
from pdserve.distributed.futex import FUTEX_WAIT, FUTEX_WAKE, Timespec, futex, process_alive

logger = logging.getLogger(__name__)

LINE = 64  # bytes of header per rank: counter, pid, padding (one cache line)
DEFAULT_SLOT_BYTES = 4 << 20  # per rank and phase; larger tensors go in chunks
SPIN_S = 50e-6  # spin this long before sleeping on the futex (1 ms measured slower)
PATIENT_SPIN_S = 1e-3  # a follower waiting for the next plan: the leader's between-step work
PARTS_CACHED = 64  # (dtype, length, phase) slot views kept for the one-slot path
LIVENESS_PERIOD_S = 0.05  # longest futex sleep: how often a waiter checks its peers
SHM_DIR = Path("/dev/shm")
_PATTERN = re.compile(r"pdserve-coll-(\d+)-[0-9a-f]+$")


class ShmCollectiveError(RuntimeError):
    """A shared-memory collective could not complete: a peer died or timed out."""


def shm_supported() -> tuple[bool, str]:
    """Whether this host can run shared-memory collectives, and why not if it cannot."""
    if not sys.platform.startswith("linux"):
        return False, f"{sys.platform} has no futex(2)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"{platform.machine()} is not x86-64 (store order not guaranteed)"
    if not SHM_DIR.is_dir():
        return False, "no /dev/shm"
    return True, ""


def segment_bytes(world: int, slot_bytes: int) -> int:
    return LINE * world + 2 * world * slot_bytes


class ShmCommunicator:
    """Collectives of one group through a mapped segment; ``rank`` is the index in the group.

    Calls must come from one thread at a time, and every rank of the group must
    make the same calls in the same order with tensors of the same shape and
    dtype, as with any process group. The segment file may be unlinked once
    every rank has mapped it: the mapping keeps the memory.
    """

    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float) -> None:
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of a group of {world}: need 0 <= rank < world >= 2")
        self.path, self.rank, self.world = path, rank, world
        self.slot_bytes = slot_bytes - slot_bytes % LINE
        self.timeout_s = timeout_s
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), segment_bytes(world, self.slot_bytes))
        header = np.frombuffer(self._mm, dtype=np.int64, count=world * LINE // 8)
        self._header = header.reshape(world, LINE // 8)  # [world, 8]
        self._counters = self._header[:, 0]  # [world]
        # The same counters read as Python ints (cheaper than numpy per call).
        self._count = memoryview(self._mm)[: world * LINE].cast("q")
        self._peer_words = [r * LINE // 8 for r in range(world) if r != rank]
        self._calls = int(self._counters[rank])
        self._header[rank, 1] = os.getpid()
        base = self._header.ctypes.data
        self._addresses = [base + r * LINE for r in range(world)]  # low word of each counter
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._views: dict[torch.dtype, torch.Tensor] = {}
        self._parts: dict[tuple[torch.dtype, int, int], tuple[torch.Tensor, ...]] = {}
        self.error: str | None = None

    @classmethod
    def create(cls, path: str, world: int, slot_bytes: int, timeout_s: float) -> ShmCommunicator:
        """Create the segment file (zeroed, sparse, 0600 from the start); map it as rank 0."""
        slot_bytes -= slot_bytes % LINE
        with open_private(path, "xb") as f:
            f.truncate(segment_bytes(world, slot_bytes))
        return cls(path, 0, world, slot_bytes, timeout_s)

    # -- collectives -------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the group, in place; every rank gets the same bits."""
        flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
        numel = flat.numel()
        if numel * flat.element_size() <= self.slot_bytes:  # one call: every decode step's
            n = self._calls + 1
            parts = self._slot_parts(flat.dtype, numel, n % 2)
            parts[self.rank].copy_(flat)
            self._enter(n)
            self._sum(parts, flat)
        else:
            for lo, hi in self._chunks(flat):
                part = flat[lo:hi]
                slots = self._exchange(part)[:, : hi - lo]  # [world, hi - lo]
                self._sum(slots.unbind(0), part)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))

    @staticmethod
    def _sum(parts: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        """``out = parts[0] + parts[1] + ...``, in rank order (the same bits on every rank)."""
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order: ``[world, *x.shape]``."""
        flat = x.reshape(-1)
        out = x.new_empty((self.world, flat.numel()))
        for lo, hi in self._chunks(flat):
            slots = self._exchange(flat[lo:hi])
            out[:, lo:hi].copy_(slots[:, : hi - lo])
        return out.view(self.world, *x.shape)

    def broadcast(self, x: torch.Tensor, src: int) -> None:
        """Copy ``x`` of group rank ``src`` into ``x`` of every other rank, in place."""
        flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
        mine = self.rank == src
        for lo, hi in self._chunks(flat):
            slots = self._exchange(flat[lo:hi] if mine else None, flat.dtype)
            if not mine:
                flat[lo:hi].copy_(slots[src, : hi - lo])
        if not mine and flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))

    def broadcast_bytes(
        self, payload: bytes | None, src: int = 0, patient: bool = False
    ) -> bytes | None:
        """Group rank ``src``'s ``payload`` (None included) on every rank.

        ``patient``: wait for the first part past the timeout (an idle follower
        waiting for the next plan); a dead peer still raises.
        """
        mine = self.rank == src
        room = self.slot_bytes - 8
        head = b""
        if mine:
            length = -1 if payload is None else len(payload)
            head = struct.pack("<q", length) + (payload or b"")[:room]
        start = self._exchange_bytes(head if mine else None, src, patient)
        length = struct.unpack("<q", self._mm[start : start + 8])[0]
        if length < 0:
            return None
        if mine:
            assert payload is not None
            self._send_rest(payload, src)
            return payload
        parts = [self._mm[start + 8 : start + 8 + min(length, room)]]
        got = len(parts[0])
        while got < length:
            start = self._exchange_bytes(None, src)
            n = min(length - got, self.slot_bytes)
            parts.append(self._mm[start : start + n])
            got += n
        return b"".join(parts)

    def _send_rest(self, payload: bytes, src: int) -> None:
        room = self.slot_bytes - 8
        for lo in range(room, len(payload), self.slot_bytes):
            self._exchange_bytes(payload[lo : lo + self.slot_bytes], src)

    def abort(self, why: str) -> None:
        """Give the group up: every peer's current or next wait raises, as do later calls."""
        self.error = self.error or why
        self._header[self.rank, 2] = 1
        for address in self._addresses:
            futex(address, FUTEX_WAKE, 1 << 30, None)

    def close(self) -> None:
        """Stop using the segment; remove its file if it is still there."""
        self.error = self.error or "the communicator was closed"
        Path(self.path).unlink(missing_ok=True)

    # -- one call ------------------------------------------------------------------

    def _chunks(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        step = self.slot_bytes // flat.element_size()
        return [(lo, min(lo + step, flat.numel())) for lo in range(0, flat.numel(), step)]

    def _slots(self, dtype: torch.dtype, phase: int) -> torch.Tensor:
        """``[world, slot_bytes / itemsize]`` view of the slots of ``phase``."""
        view = self._views.get(dtype)
        if view is None:
            data = self._bytes[LINE * self.world :]
            itemsize = torch.empty((), dtype=dtype).element_size()
            view = data.view(dtype).view(2, self.world, self.slot_bytes // itemsize)
            self._views[dtype] = view
        return view[phase]

    def _slot_parts(self, dtype: torch.dtype, numel: int, phase: int) -> tuple[torch.Tensor, ...]:
        """Every rank's slot of ``phase`` as a ``[numel]`` view; cached, as a step's shapes repeat."""
        key = (dtype, numel, phase)
        parts = self._parts.get(key)
        if parts is None:
            if len(self._parts) >= PARTS_CACHED:
                self._parts.clear()
            slots = self._slots(dtype, phase)
            parts = self._parts[key] = tuple(slots[r, :numel] for r in range(self.world))
        return parts

    def _arrived(self, n: int) -> bool:
        """Whether every peer has entered call ``n``."""
        return min(map(self._count.__getitem__, self._peer_words)) >= n

    def _exchange(
        self, part: torch.Tensor | None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """One call: publish ``part`` (may be None), wait for every rank; the call's slots."""
        n = self._calls + 1
        slots = self._slots(part.dtype if part is not None else dtype or torch.uint8, n % 2)
        if part is not None:
            slots[self.rank, : part.numel()].copy_(part)
        self._enter(n)
        return slots

    def _exchange_bytes(self, data: bytes | None, src: int, patient: bool = False) -> int:
        """One call carrying ``data`` from ``src``; the byte offset of src's slot."""
        n = self._calls + 1
        base = LINE * self.world + self.slot_bytes * ((n % 2) * self.world)
        if data is not None:
            at = base + self.slot_bytes * self.rank
            self._mm[at : at + len(data)] = data
        self._enter(n, patient)
        return base + self.slot_bytes * src

    def _enter(self, n: int, patient: bool = False) -> None:
        if self.error is not None:
            raise ShmCollectiveError(f"shared-memory collectives unusable: {self.error}")
        self._calls = n
        self._counters[self.rank] = n
        futex(self._addresses[self.rank], FUTEX_WAKE, 1 << 30)
        if not self._arrived(n):
            self._wait(n, patient)

    def _wait(self, n: int, patient: bool) -> None:
        counters = self._counters
        start = time.monotonic()
        while time.monotonic() - start < (PATIENT_SPIN_S if patient else SPIN_S):
            if self._arrived(n):
                return
        next_check = start + LIVENESS_PERIOD_S
        while (low := int(counters.min())) < n:
            now = time.monotonic()
            if self._header[:, 2].any():
                self.error = "a rank aborted the group"
                raise ShmCollectiveError("a rank aborted the shared-memory group")
            if now >= next_check:
                next_check = now + LIVENESS_PERIOD_S
                self._check_peers(n, 0.0 if patient else now - start)
            r = int(np.argmin(counters))
            pause = Timespec(0, int(LIVENESS_PERIOD_S * 1e9))
            futex(self._addresses[r], FUTEX_WAIT, low & 0xFFFFFFFF, ctypes.byref(pause))

    def _check_peers(self, n: int, waited: float) -> None:
        lagging = [r for r in range(self.world) if int(self._counters[r]) < n]
        for r in lagging:
            pid = int(self._header[r, 1])
            if pid and not process_alive(pid):
                self.error = f"group rank {r} (pid {pid}) died"
                raise ShmCollectiveError(
                    f"group rank {r} (pid {pid}) died during a shared-memory collective"
                )
        if waited > self.timeout_s:
            self.error = f"timed out waiting for group ranks {lagging}"
            raise ShmCollectiveError(
                f"shared-memory collective timed out after {self.timeout_s:.0f} s "
                f"waiting for group ranks {lagging}"
            )


# -- set-up ---------------------------------------------------------------------


def host_key() -> str:
    """What ranks must share to map one segment and see each other's pids."""
    ok, why = shm_supported()
    if not ok:
        return f"unsupported ({why}) pid {os.getpid()}"
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return f"{socket.gethostname()}|{boot.read_text().strip() if boot.exists() else ''}|{pid_ns}"


def open_group_shm(
    group: Any, ranks: list[int], rank: int, timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES
) -> tuple[ShmCommunicator | None, str]:
    """A communicator for ``group`` (global ``ranks``; this is global ``rank``), or None and why.

    Collective: every rank of the group calls it, over the group's gloo channel.
    """
    keys: list[Any] = [None] * len(ranks)
    dist.all_gather_object(keys, host_key(), group=group)
    if len(set(keys)) != 1:
        return None, "ranks on different hosts, or no shared-memory support on one"
    index = ranks.index(rank)
    comm: ShmCommunicator | None = None
    path: list[Any] = [None]
    if index == 0:
        sweep_stale_segments()
        name = f"pdserve-coll-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            comm = ShmCommunicator.create(str(SHM_DIR / name), len(ranks), slot_bytes, timeout_s)
            path[0] = comm.path
        except OSError as e:
            logger.warning("cannot create a shared-memory segment: %s", e)
    dist.broadcast_object_list(path, src=ranks[0], group=group)
    if index != 0 and path[0] is not None:
        try:
            comm = ShmCommunicator(path[0], index, len(ranks), slot_bytes, timeout_s)
        except OSError as e:
            logger.warning("cannot map shared-memory segment %s: %s", path[0], e)
    attached = torch.tensor([1 if comm is not None else 0], dtype=torch.int64)
    dist.all_reduce(attached, op=dist.ReduceOp.MIN, group=group)
    if comm is not None and index == 0:
        Path(comm.path).unlink(missing_ok=True)  # every rank has it mapped
    if not attached.item():
        if comm is not None:
            comm.close()
        return None, "a rank could not map the segment"
    assert comm is not None
    return comm, ""


def sweep_stale_segments() -> int:
    """Remove segment files left by creators that died during set-up; returns how many."""
    removed = 0
    for path in SHM_DIR.glob("pdserve-coll-*"):
        m = _PATTERN.match(path.name)
        if m is not None and not process_alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
