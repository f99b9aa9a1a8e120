"""Process groups of an attention-FFN disaggregated (afd) instance.

Ranks ``[0, A)`` form the attention group (its TP group: heads split over
them) and ranks ``[A, A + F)`` the expert group (its EP group: experts split
over them); see :mod:`pdserve.core.layout`. The plan broadcast and the
hidden states between the groups use the whole instance: point-to-point
``isend``/``irecv`` on the default group (gloo on CPU, NCCL on CUDA), the
control messages on ``cpu_group``. Every rank creates every group in the same
order, as torch requires.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pdserve.core.layout import Layout
from pdserve.distributed.context import ParallelContext
from pdserve.parallel.groups import BuiltGroups, GroupShm


def afd_groups(layout: Layout, rank: int, timeout: timedelta) -> BuiltGroups:
    """The attention and the expert group: what ``init_groups`` builds for an afd instance."""
    attention, experts = list(range(layout.tp)), layout.expert_ranks()
    attention_group = dist.new_group(attention, timeout=timeout)
    expert_group = dist.new_group(experts, timeout=timeout)
    expert = layout.is_expert_rank(rank)
    mine = experts if expert else attention
    wanted = [(mine, expert_group if expert else attention_group)]

    def context(shm: GroupShm) -> ParallelContext:
        return _context(layout, rank, attention_group, expert_group, shm.get(tuple(mine)))

    return wanted, context


def _context(
    layout: Layout, rank: int, attention_group: Any, expert_group: Any, shm: Any
) -> ParallelContext:
    """An attention rank is a TP rank of the attention group; an expert rank an EP rank."""
    if layout.is_expert_rank(rank):
        f = layout.afd_experts
        return ParallelContext(
            ep_rank=rank - layout.tp,
            ep_size=f,
            ep_group=expert_group if f > 1 else None,
            ep_shm=shm if f > 1 else None,
            pp_group=dist.group.WORLD,
        )
    a = layout.tp
    return ParallelContext(
        tp_rank=rank,
        tp_size=a,
        tp_group=attention_group if a > 1 else None,
        tp_shm=shm if a > 1 else None,
        pp_group=dist.group.WORLD,
    )
