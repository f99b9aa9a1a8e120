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

from typing import Any

import torch
import torch.distributed as dist

from pdserve.core.layout import Layout
from pdserve.parallel.context import ParallelContext
from pdserve.parallel.groups import InstanceGroups, _shared_memory, join_world


def init_afd_groups(
    layout: Layout,
    rank: int,
    address: str,
    device: torch.device,
    timeout_s: float,
    store: dist.TCPStore | None = None,
    shm_collectives: bool = True,
) -> InstanceGroups:
    """Join the afd instance through the leader's store at ``address``; build its groups."""
    backend, timeout, cpu_group = join_world(layout, rank, address, device, timeout_s, store)
    attention, experts = list(range(layout.tp)), layout.expert_ranks()
    attention_group = dist.new_group(attention, timeout=timeout)
    expert_group = dist.new_group(experts, timeout=timeout)
    world = list(range(layout.world_size))
    expert = layout.is_expert_rank(rank)
    mine = experts if expert else attention
    wanted = [(world, cpu_group), (mine, expert_group if expert else attention_group)]
    use_shm = shm_collectives and backend == "gloo"
    shm = _shared_memory(wanted, rank, timeout_s) if use_shm else {}
    ctx = _context(layout, rank, attention_group, expert_group, shm.get(tuple(mine)))
    comms = list({id(c): c for c in shm.values() if c is not None}.values())
    return InstanceGroups(layout, rank, ctx, cpu_group, shm.get(tuple(world)), comms)


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
