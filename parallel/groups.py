"""``torch.distributed`` process groups of one instance, and its control messages.

Every rank of an instance joins one process group through a TCP store that the
leader (rank 0) opens on a port the OS picks and then publishes, so two
instances on one node never race for a fixed port. The backend follows the device: NCCL on
CUDA, gloo on CPU; control messages (the step plan, sampled tokens) always go
over a gloo group. Every collective has the instance's timeout: a dead or stuck
rank surfaces as an error on the others, never a hang.

On CPU, a group whose ranks all share one host (the whole instance, its TP
group, its EP group) runs its all-reduces, all-gathers and plan broadcasts
through a :class:`~pdserve.distributed.shm_comm.ShmCommunicator` instead of gloo,
unless ``PDSERVE_SHM_COLLECTIVES=0``; which one each group uses is logged.
Point-to-point transfers, all-to-all and the flag reductions stay on gloo.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.core.layout import Layout
from pdserve.distributed.context import ParallelContext
from pdserve.distributed.shm_comm import ShmCommunicator, open_group_shm

logger = logging.getLogger(__name__)

STOP = -1  # plan length that tells followers to leave their loop

# (ranks, group) pairs that may run over shared memory, and the communicator (or
# None: gloo) each got, by ranks.
WantedGroups = list[tuple[list[int], Any]]
GroupShm = dict[tuple[int, ...], ShmCommunicator | None]
# An instance's groups past the whole: those that may run over shared memory, and
# how this rank's context follows from their communicators.
BuiltGroups = tuple[WantedGroups, Callable[[GroupShm], ParallelContext]]
# Makes them (every rank, in one order) from the layout, the rank and the timeout.
GroupBuilder = Callable[[Layout, int, timedelta], BuiltGroups]


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return "127.0.0.1"


@dataclass
class InstanceGroups:
    """The groups one rank belongs to."""

    layout: Layout
    rank: int
    ctx: ParallelContext
    cpu_group: Any  # gloo group of all ranks, for control messages
    # Shared-memory stand-in for cpu_group's plan broadcast (None: gloo).
    control_shm: ShmCommunicator | None = None
    shm: list[ShmCommunicator] = field(default_factory=list)  # every one this rank maps

    def close(self) -> None:
        for comm in self.shm:
            comm.close()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def peer(self, stage: int) -> int:
        """Global rank of this rank's counterpart in pipeline stage ``stage``."""
        return stage * self.layout.ranks_per_stage + self.layout.coords(self.rank).r

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: index 0 of the last stage."""
        return (self.layout.pp - 1) * self.layout.ranks_per_stage


def leader_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The leader's rendezvous store, listening on a port the OS picks."""
    return dist.TCPStore(
        _node_ip(),
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def store_address(store: dist.TCPStore) -> str:
    return f"{store.host}:{store.port}"


def join_world(
    layout: Layout,
    rank: int,
    address: str,
    device: torch.device,
    timeout_s: float,
    store: dist.TCPStore | None,
) -> tuple[str, timedelta, Any]:
    """Join the instance's default group through the leader's store at ``address``.

    Returns the backend, the timeout and the gloo group for control messages,
    the first group every rank creates (every rank creates every group, in the
    same order, as torch requires)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), layout.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=layout.world_size, timeout=timeout
    )
    cpu_group = (
        dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    )
    return backend, timeout, cpu_group


def init_groups(
    layout: Layout,
    rank: int,
    address: str,
    device: torch.device,
    timeout_s: float,
    store: dist.TCPStore | None = None,
    shm_collectives: bool = True,
    build: GroupBuilder | None = None,
) -> InstanceGroups:
    """Join the instance through the leader's store at ``address``; build every group.

    ``shm_collectives``: CPU groups on one host may use shared memory. ``build``
    makes the groups past the whole instance's: by default its TP and stage groups
    (an afd instance: :func:`pdserve.parallel.afd_groups.afd_groups`)."""
    backend, timeout, cpu_group = join_world(layout, rank, address, device, timeout_s, store)
    wanted, context = (build or _stage_groups)(layout, rank, timeout)
    world = list(range(layout.world_size))
    wanted = [(world, cpu_group), *wanted]
    shm = _shared_memory(wanted, rank, timeout_s) if shm_collectives and backend == "gloo" else {}
    if build is None and not shm and rank == 0:
        why = "shared memory off" if not shm_collectives else f"{backend} on {device}"
        logger.info("instance %s: collectives over %s (%s)", layout.describe(), backend, why)
    comms = list({id(c): c for c in shm.values() if c is not None}.values())
    return InstanceGroups(layout, rank, context(shm), cpu_group, shm.get(tuple(world)), comms)


def _stage_groups(layout: Layout, rank: int, timeout: timedelta) -> BuiltGroups:
    """The TP groups and the pipeline-stage groups (EP groups when ``ep > 1``)."""
    tp_group = _member_group(layout.tp_groups(), rank, timeout)
    stage_group = _member_group(layout.stage_groups(), rank, timeout)
    tp_ranks, stage_ranks = _mine(layout.tp_groups(), rank), _mine(layout.stage_groups(), rank)
    wanted = [(tp_ranks, tp_group)]
    wanted += [(stage_ranks, stage_group)] if layout.ep > 1 else []

    def context(shm: GroupShm) -> ParallelContext:
        coords = layout.coords(rank)
        return ParallelContext(
            tp_rank=coords.tp_rank,
            tp_size=layout.tp,
            pp_rank=coords.stage,
            pp_size=layout.pp,
            ep_rank=coords.ep_rank,
            ep_size=layout.ep,
            tp_group=tp_group,
            ep_group=stage_group if layout.ep > 1 else None,
            pp_group=dist.group.WORLD,
            tp_shm=shm.get(tuple(tp_ranks)),
            ep_shm=shm.get(tuple(stage_ranks)) if layout.ep > 1 else None,
        )

    return wanted, context


def _mine(all_groups: list[list[int]], rank: int) -> list[int]:
    return next(ranks for ranks in all_groups if rank in ranks)


def _shared_memory(wanted: WantedGroups, rank: int, timeout_s: float) -> GroupShm:
    """A communicator (or None: gloo) for each group of two or more ranks in ``wanted``.

    Groups with the same ranks share one. Collective: every rank asks for its
    groups in the same order.
    """
    found: GroupShm = {}
    for ranks, group in wanted:
        key = tuple(ranks)
        if len(ranks) < 2 or key in found:
            continue
        found[key], why = open_group_shm(group, ranks, rank, timeout_s)
        if rank == ranks[0]:
            how = "shared memory" if found[key] is not None else f"gloo ({why})"
            logger.info("group of ranks %s: collectives over %s", ranks, how)
    return found


def _member_group(all_groups: list[list[int]], rank: int, timeout: timedelta) -> Any:
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def send_plan(groups: InstanceGroups, payload: bytes | None) -> None:
    """Leader: broadcast one plan message to every rank (None tells them to stop)."""
    if groups.control_shm is not None:
        groups.control_shm.broadcast_bytes(payload)
        return
    length = torch.tensor([STOP if payload is None else len(payload)], dtype=torch.int64)
    dist.broadcast(length, src=0, group=groups.cpu_group)
    if payload is not None:
        dist.broadcast(
            torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=groups.cpu_group
        )


def receive_plan(groups: InstanceGroups) -> bytes | None:
    """Follower: the next plan message from the leader, or None to stop."""
    if groups.control_shm is not None:
        return groups.control_shm.broadcast_bytes(None, patient=True)
    length = torch.empty(1, dtype=torch.int64)
    dist.broadcast(length, src=0, group=groups.cpu_group)
    n = int(length.item())
    if n == STOP:
        return None
    buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=groups.cpu_group)
    return buf.numpy().tobytes()


def abort_groups(groups: InstanceGroups, why: str) -> None:
    """Give the groups up after a rank died: peers still waiting in them raise; leave them."""
    for comm in groups.shm:
        comm.abort(why)
    destroy_groups(groups)


def destroy_groups(groups: InstanceGroups | None = None) -> None:
    if groups is not None:
        groups.close()
    if dist.is_initialized():
        dist.destroy_process_group()
