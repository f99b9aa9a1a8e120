"""Where one rank sits in its instance, and the collectives its layers call.

Layers never look up global state: each is built with a :class:`ParallelContext`
that says its tensor-, pipeline- and expert-parallel rank and size and holds the
process groups. On one rank every collective is a no-op, so the same layer code
runs with and without ``torch.distributed``. Where a group's ranks share a host
(on CPU), its shared-memory communicator (``tp_shm``, ``ep_shm``) carries the
collective instead of the process group.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from pdserve.distributed.shm_comm import ShmCommunicator


@dataclass
class CommStats:
    """Time and bytes this rank spent in collectives and point-to-point transfers.

    The time includes waiting for the slowest peer, so it is the step time that
    communication (and load imbalance) costs this rank.
    """

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0

    @contextmanager
    def timed(self, nbytes: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            self.bytes += nbytes
            self.calls += 1


@dataclass(frozen=True)
class ParallelContext:
    """This rank's coordinates; groups are None when that dimension has size 1."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: Any = None
    ep_group: Any = None
    pp_group: Any = None
    tp_shm: ShmCommunicator | None = None
    ep_shm: ShmCommunicator | None = None
    comm: CommStats = field(default_factory=CommStats, compare=False)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            with self.comm.timed(x.numel() * x.element_size()):
                if self.tp_shm is not None:
                    self.tp_shm.all_reduce(x)
                else:
                    dist.all_reduce(x, group=self.tp_group)
        return x

    def tp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each TP rank's ``x`` along the last dimension."""
        if self.tp_size == 1:
            return x
        with self.comm.timed(x.numel() * x.element_size() * self.tp_size):
            parts = all_gather(x.contiguous(), self.tp_size, self.tp_group, self.tp_shm)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = ParallelContext()


def all_gather(
    x: torch.Tensor, size: int, group: Any, shm: ShmCommunicator | None
) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape on all), in rank order, over ``shm`` or ``group``."""
    if shm is not None:
        return list(shm.all_gather(x).unbind(0))
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return parts


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``total`` items are split in ``parts``."""
    size = -(-total // parts)
    start = min(index * size, total)
    return start, min(start + size, total)
