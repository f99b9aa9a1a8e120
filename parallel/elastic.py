"""Elastic expert parallelism: an instance keeps serving when an EP follower rank dies.

Covered: layouts whose ranks differ only by the experts they hold,
``expert_parallel_size > 1`` with tensor and pipeline sizes 1, on CPU (gloo and
shared-memory groups). There the attention is replicated, so every survivor
holds the whole KV cache. Recovery runs on the leader, inside the step that
failed (:class:`ElasticLeader`, called by the leader's ``GroupExecutor``)::

    detect    a collective with the dead rank raises: gloo on the reset
              connection, shared memory when the peer's pid is gone (<= 50 ms)
    identify  the leader pings every follower through Ray; a rank whose actor
              is gone, or that does not answer within the collective timeout,
              is dead (and killed, to be sure)
    regroup   the leader aborts the old groups (a follower waiting for a plan
              raises), opens a fresh TCP store; every survivor (followers in
              ``RankWorker.regroup``) builds new groups over the survivors,
              renumbered in order, and swaps its layers' ``ParallelContext``
    re-place  every MoE layer over the survivors (:func:`pdserve.models.eplb.shrink`):
              a slot keeps its expert, copies it from a local slot, or reads it
              from the checkpoint
    re-pair   every survivor's KV transfer layer takes its new number and
              layout (``ElasticRank.on_regrouped``); the leader's
              ``on_recovered`` hook gets the survivors' actors (a decode
              instance re-publishes its layout and endpoints to its paired
              prefill instances, whose ranks re-plan their routes)
    re-run    the leader runs the failed step's plan again on the survivors

The failed step's tokens were never emitted and re-running its plan writes the
same KV slots, so requests in flight go on with no token repeated or missing.
Not covered (the instance fails with ``InstanceFailedError`` as before, and a
cluster replaces it and migrates its requests): the leader's death, layouts
where a rank holds a KV shard (TP or PP > 1), NCCL groups (CUDA), and a
failure during recovery itself. Survivors must have room for their share of
the experts (``ceil(E / survivors)`` slots each; with one survivor, all ``E``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from torch import nn

from pdserve.core.config import EngineConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.layout import Layout
from pdserve.distributed.context import ParallelContext
from pdserve.models.eplb import shrink
from pdserve.models.moe import SparseMoE
from pdserve.parallel.elastic_status import ElasticStatus, Recovery
from pdserve.parallel.expert_slots import moe_layers, reload_slots
from pdserve.parallel.groups import (
    InstanceGroups,
    abort_groups,
    init_groups,
    leader_store,
    store_address,
)

logger = logging.getLogger(__name__)


def elastic_enabled(engine: EngineConfig, device: torch.device) -> bool:
    """Whether a lost follower rank is recovered from (see ``ParallelConfig.elastic_ep``).

    Raises naming ``elastic_ep`` when it is required where it cannot run."""
    p = engine.parallel
    if p.elastic_ep is False or p.expert_parallel_size == 1 or p.world_size > 1 or p.afd:
        return False
    if device.type == "cuda":
        if p.elastic_ep:
            raise InvalidArgumentError(
                "elastic_ep", "needs CPU ranks (gloo groups); NCCL groups cannot drop a rank"
            )
        return False
    return True


@dataclass(frozen=True)
class Regrouped:
    """What one survivor did to rejoin: seconds to build the groups and to place experts."""

    group_s: float
    reload_s: float
    copied_slots: int  # slots filled from another local slot
    loaded_slots: int  # slots read from the checkpoint
    redundant_experts: int  # slots over the experts in the new placement


def shrunk_layout(layout: Layout, survivors: int) -> Layout:
    """The layout of ``survivors`` ranks that each run every layer (TP = PP = 1)."""
    return Layout(1, 1, survivors, layout.stage_layers)


def swap_context(
    holders: list[Any], model: nn.Module, old: ParallelContext, new: ParallelContext
) -> None:
    """Point every holder and every module of ``model`` that held ``old`` at ``new``."""
    for obj in [*holders, *model.modules()]:
        if getattr(obj, "ctx", None) is old:
            obj.ctx = new


def regroup_rank(
    model: nn.Module,
    layer_start: int,
    holders: list[Any],
    old: InstanceGroups,
    survivors: list[int],
    address: str,
    store: Any,
    device: torch.device,
    timeout_s: float,
    shm: bool,
    folder: str,
) -> tuple[InstanceGroups, Regrouped]:
    """This survivor's new groups over ``survivors`` (current ranks), experts re-placed.

    Collective: every survivor calls it with the same survivors and address.
    ``holders``: objects besides the model's modules whose ``ctx`` is swapped.
    """
    start = time.monotonic()
    layout = shrunk_layout(old.layout, len(survivors))
    groups = init_groups(layout, survivors.index(old.rank), address, device, timeout_s, store, shm)
    groups.ctx = dataclasses.replace(groups.ctx, comm=old.ctx.comm)
    swap_context(holders, model, old.ctx, groups.ctx)
    placed = time.monotonic()
    copied, loaded, redundant = shrink_experts(model, layer_start, survivors, folder)
    done = time.monotonic()
    return groups, Regrouped(placed - start, done - placed, copied, loaded, redundant)


@torch.no_grad()
def shrink_experts(
    model: nn.Module, layer_start: int, survivors: list[int], folder: str
) -> tuple[int, int, int]:
    """Re-place every MoE layer over the survivors (its ``ctx`` already the new one).

    Returns the slots copied from a local slot, the slots read from the
    checkpoint, and the redundant slots of the new placement.
    """
    stale: dict[SparseMoE, set[int]] = {}
    copied = redundant = 0
    for moe in moe_layers(model, layer_start).values():
        new = shrink(moe.placement, survivors, moe.num_experts)
        redundant = len(new.slots) - moe.num_experts
        mine = new.rank_slots(moe.ctx.ep_rank)
        old = moe.local_slots
        held = {e: i for i, e in reversed(list(enumerate(old)))}
        moved = {e for i, e in enumerate(mine) if len(mine) != len(old) or old[i] != e}
        # w13 [2I, H], w2 [H, I] of each expert a changed slot needs and this rank holds
        keep = {e: (moe.w13[held[e]].clone(), moe.w2[held[e]].clone()) for e in moved & held.keys()}
        changed = moe.set_placement(new)
        stale[moe] = set()
        for i in changed:
            e = moe.local_slots[i]
            if e in keep:
                moe.w13.data[i].copy_(keep[e][0])
                moe.w2.data[i].copy_(keep[e][1])
                copied += 1
            else:
                stale[moe].add(i)
    reload_slots(model, folder, stale)  # type: ignore[arg-type]
    return copied, sum(len(s) for s in stale.values()), redundant


class ElasticLeader:
    """The leader's side of elastic EP: finds the dead ranks and regroups the survivors.

    ``peers``: every rank's actor, by rank as numbered at start. ``rejoin``
    regroups the leader itself (``ElasticRank._rejoin``): it takes the new
    store's address, the survivors (current ranks) and the store.
    """

    def __init__(
        self,
        peers: list[Any],
        rejoin: Callable[[str, list[int], Any], Regrouped],
        timeout_s: float,
    ) -> None:
        self.peers = peers
        self.rejoin = rejoin
        self.timeout_s = timeout_s
        self.members = list(range(len(peers)))
        self.recoveries: list[Recovery] = []
        self.steps = 0
        self.store: Any = None  # the survivors' rendezvous store, held while they serve
        # Called after a recovery with the serving ranks' actors (in rank order).
        self.on_recovered: Callable[[list[Any]], None] | None = None

    def status(self) -> ElasticStatus:
        return ElasticStatus(tuple(self.members), self.steps, tuple(self.recoveries))

    def ran(self) -> None:
        """A step ran; the first after a recovery stamps it with the time."""
        self.steps += 1
        if self.recoveries and not self.recoveries[-1].resumed_at:
            self.recoveries[-1] = dataclasses.replace(self.recoveries[-1], resumed_at=time.time())

    def recover(self, groups: InstanceGroups, error: BaseException) -> bool:
        """After a collective of ``groups`` raised: regroup without the dead; False: none died."""
        failed_at, start = time.time(), time.monotonic()
        dead = self._dead(groups.layout.world_size)
        if not dead:
            return False
        lost = tuple(self.members[r] for r in dead)
        logger.warning("instance lost rank(s) %s (%s); regrouping on the survivors", lost, error)
        identified = time.monotonic()
        survivors = [r for r in range(groups.layout.world_size) if r not in dead]
        try:
            abort_groups(groups, f"rank(s) {lost} died")
            self.store = store = leader_store(len(survivors), self.timeout_s)
            address = store_address(store)
            refs = [
                self.peers[self.members[r]].regroup.remote(address, survivors)
                for r in survivors[1:]
            ]
            done: list[Regrouped] = [self.rejoin(address, survivors, store)]
            done += ray.get(refs, timeout=self.timeout_s)
        except Exception:
            logger.exception("regrouping on ranks %s failed", survivors)
            return False
        self.members = [self.members[r] for r in survivors]
        self._record(lost, failed_at, identified - start, done)
        if self.on_recovered is not None:
            try:
                self.on_recovered([self.peers[m] for m in self.members])
            except Exception:  # the instance serves; only its peers' routes are stale
                logger.exception("re-pairing after the loss of rank(s) %s failed", lost)
        return True

    def _record(
        self, lost: tuple[int, ...], failed_at: float, identify_s: float, done: list[Regrouped]
    ) -> None:
        recovery = Recovery(
            lost,
            tuple(self.members),
            failed_at,
            identify_s,
            max(d.group_s for d in done),
            max(d.reload_s for d in done),
            copied_slots=sum(d.copied_slots for d in done),
            loaded_slots=sum(d.loaded_slots for d in done),
        )
        self.recoveries.append(recovery)
        logger.warning(
            "elastic EP: serving on ranks %s after losing %s (identify %.3f s, regroup %.3f s, "
            "experts %.3f s: %d slots copied, %d read)",
            recovery.members,
            lost,
            identify_s,
            recovery.regroup_s,
            recovery.reload_s,
            recovery.copied_slots,
            recovery.loaded_slots,
        )

    def _dead(self, world: int) -> list[int]:
        """Current ranks whose actor is gone or does not answer a ping in time."""
        refs = {r: self.peers[self.members[r]].ping.remote() for r in range(1, world)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        dead = []
        for r, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError
                ray.get(ref)
            except (RayActorError, TimeoutError):
                dead.append(r)
                ray.kill(self.peers[self.members[r]])
        return dead


class ElasticRank:
    """The elastic-EP methods of a rank's Ray actor (a base of ``RankWorker``)."""

    # Set by RankWorker (typed there; parallel/worker.py imports this module).
    spec: Any
    device: torch.device
    groups: InstanceGroups | None
    runner: Any
    stage: Any
    engine: Any
    _loop: threading.Thread | None
    follower_error: str | None
    _follow: Callable[[], None]
    # Slots over the experts in the current placement (grows when ranks are lost).
    redundant_experts: int = 0
    peers: list[Any]  # leader: every rank's actor, by rank as numbered at start

    def attach_peers(self, peers: list[Any]) -> bool:
        """Leader: every rank's actor, by rank; arms elastic EP where the layout allows it."""
        assert self.engine is not None, "attach_peers is served by the leader (rank 0)"
        self.peers = list(peers)
        if not elastic_enabled(self.spec.engine, self.device):
            return False
        timeout = self.spec.collective_timeout_s
        leader = ElasticLeader(peers, self._rejoin, timeout)
        leader.on_recovered = self.on_recovered
        self.engine.executor.elastic = leader
        return True

    def serving_peers(self) -> list[Any]:
        """Leader: the actors of the ranks serving, in rank order (all of them if not elastic)."""
        elastic: ElasticLeader | None = getattr(self.engine.executor, "elastic", None)
        return self.peers if elastic is None else [self.peers[m] for m in elastic.members]

    def on_regrouped(self) -> None:
        """Every survivor, once in its new groups: a subclass renumbers what it keys by rank."""

    def on_recovered(self, ranks: list[Any]) -> None:
        """Leader, after a recovery: ``ranks`` are the serving ranks' actors, in rank order."""

    def elastic_status(self) -> ElasticStatus | None:
        """Leader: the ranks serving and the recoveries so far (None: not elastic)."""
        assert self.engine is not None, "elastic_status is served by the leader (rank 0)"
        elastic: ElasticLeader | None = getattr(self.engine.executor, "elastic", None)
        return None if elastic is None else elastic.status()

    def regroup(self, address: str, survivors: list[int]) -> Regrouped:
        """Follower: join the survivors' groups through ``address``; the follower loop resumes."""
        if self._loop is not None:  # it stops on its failed collective or the leader's abort
            self._loop.join(timeout=self.spec.collective_timeout_s)
            if self._loop.is_alive():
                raise RuntimeError("the follower loop did not stop after the group was aborted")
        assert self.groups is not None
        abort_groups(self.groups, "the survivors regroup")
        done = self._rejoin(address, survivors, None)
        self.follower_error = None
        self._loop = threading.Thread(target=self._follow, name="pdserve-follower", daemon=True)
        self._loop.start()
        return done

    def _rejoin(self, address: str, survivors: list[int], store: Any) -> Regrouped:
        assert self.runner is not None and self.groups is not None
        spec, runner = self.spec, self.runner
        groups, done = regroup_rank(
            runner.model,
            runner.layer_range[0],
            [runner, self.stage],
            self.groups,
            survivors,
            address,
            store,
            self.device,
            spec.collective_timeout_s,
            spec.shm_collectives,
            spec.model.path,
        )
        self.groups = self.stage.groups = groups
        self.redundant_experts = done.redundant_experts
        self.on_regrouped()
        return done
