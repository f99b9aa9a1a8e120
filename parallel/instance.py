"""An instance as Ray actors: one placement group, one :class:`RankWorker` per rank.

The layout is checked against the model before anything starts, so a layout
the model cannot take is refused with the reason and no actor is created.
Ranks are packed into one placement group (one bundle per rank); on a
multi-node cluster the group lands where Ray finds room.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.core.config import EngineConfig
from pdserve.core.errors import InstanceFailedError, InvalidArgumentError, PdserveError
from pdserve.core.layout import Layout, check_fits, plan_layout
from pdserve.core.model_config import ModelConfig
from pdserve.core.request import RequestOutput
from pdserve.parallel.calls import CONTROL, HEALTH
from pdserve.parallel.rank_spec import EngineInfo, GenerateItem, RankSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankResources:
    """Ray resources of each rank, and its torch thread count (default: its CPUs)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    torch_threads: int | None = None
    start_timeout_s: float = 300.0
    # how long the ranks' placement group may wait for room (None: start_timeout_s)
    place_timeout_s: float | None = None
    collective_timeout_s: float = 60.0
    # Ray node labels the ranks must land on (a region's nodes), e.g. {"region": "east"}.
    labels: dict[str, str] | None = None


class RankGroup:
    """Handles to the ranks of one instance; rank 0 (the leader) serves requests."""

    def __init__(
        self,
        layout: Layout,
        workers: list[Any],
        pg: Any,
        info: EngineInfo,
        start_phases: dict[str, float] | None = None,
    ) -> None:
        self.layout = layout
        self.workers = workers  # the ranks serving (see ``refresh``)
        self.all_workers = list(workers)
        self.leader = workers[0]
        self.placement_group = pg
        self.info = info
        # Seconds each start-up phase took: schedule (the placement group is
        # ready), spawn (rank processes up), load (weights), warmup (KV, engine).
        self.start_phases = start_phases or {}

    @classmethod
    def start(
        cls,
        model: ModelConfig,
        engine: EngineConfig,
        resources: RankResources | None = None,
        worker_cls: type | None = None,
        worker_args: tuple[Any, ...] = (),
        name: str = "pdserve",
    ) -> RankGroup:
        """Start every rank; ``worker_cls(spec, *worker_args)`` is each rank's actor
        (:class:`~pdserve.parallel.worker.RankWorker` by default); the ranks' placement
        group is ``name`` and a unique suffix (as `ray status` shows it)."""
        worker_cls = worker_cls or _rank_worker()
        res = resources or RankResources()
        layout = plan_layout(model, engine.parallel)  # refuse before any actor starts
        clock = PhaseClock()
        pg = _reserve_ranks(layout.world_size, res, name)
        clock.mark("schedule")
        workers: list[Any] = []
        try:
            threads = res.torch_threads or max(1, int(res.num_cpus))
            specs = [
                RankSpec(rank, layout, model, engine, res.collective_timeout_s, threads)
                for rank in range(layout.world_size)
            ]
            workers.extend(_spawn(worker_cls, worker_args, specs, res, pg))
            address = _get(workers[0].rendezvous.remote(), res.start_timeout_s)
            _get([w.ping.remote() for w in workers], res.start_timeout_s)
            clock.mark("spawn")
            capacities = _get([w.join.remote(address) for w in workers], res.start_timeout_s)
            read = _get([w.adapter_fingerprints.remote() for w in workers], res.start_timeout_s)
            _check_same_adapters(read)
            clock.mark("load")
            num_blocks = min(capacities)
            _get([w.allocate_kv.remote(num_blocks) for w in workers], res.start_timeout_s)
            info = _get(workers[0].start_engine.remote(), res.start_timeout_s)
            _get(workers[0].attach_peers.remote(workers), res.start_timeout_s)  # elastic EP
            clock.mark("warmup")
        except BaseException:
            release(workers, pg)
            raise
        logger.info(
            "instance %s up in %.2f s (%s): %d KV blocks per rank",
            layout.describe(),
            sum(clock.phases.values()),
            ", ".join(f"{k} {v:.2f} s" for k, v in clock.phases.items()),
            info.num_kv_blocks,
        )
        return cls(layout, workers, pg, info, clock.phases)

    def generate(
        self, items: list[GenerateItem], timeout_s: float | None = None
    ) -> list[RequestOutput]:
        return _get(self.leader.generate.remote(items), timeout_s)

    def check_idle(self) -> None:
        _get(self.leader.check_idle.remote(), 60)

    def refresh(self) -> int:
        """Drop ranks an elastic instance lost (``parallel/elastic.py``); the ranks serving."""
        status = _get(self.leader.elastic_status.remote(), 60)
        if status is not None:
            self.set_members(status.members)
        return len(self.workers)

    def set_members(self, members: tuple[int, ...]) -> None:
        """The ranks serving, as numbered at start (``ElasticStatus.members``)."""
        self.workers = [self.all_workers[r] for r in members]

    def load_lora_adapter(self, name: str, folder: str) -> tuple[str, str]:
        """Serve a LoRA adapter on every rank between two steps; (name, fingerprint)."""
        served, fingerprint = _get(self.leader.load_lora_adapter.remote(name, folder), 120)
        return str(served), str(fingerprint)

    def unload_lora_adapter(self, name: str) -> None:
        _get(self.leader.unload_lora_adapter.remote(name), 120)

    def shutdown(self) -> None:
        try:
            self.refresh()
            _get(self.leader.shutdown.remote(), 60)
            _get([w.shutdown.remote() for w in self.workers[1:]], 60)
        except (InstanceFailedError, GetTimeoutError):
            pass
        release(self.all_workers, self.placement_group)


def release(workers: list[Any], pg: Any, timeout_s: float = 10.0) -> None:
    """Kill ``workers`` and, once Ray reports each dead, remove their placement group
    (one already removed is no error). Removing a group while a rank in it is still
    being created or torn down can leave that rank's bundle held in Ray; the wait is a
    few milliseconds."""
    for w in workers:
        ray.kill(w)
    deadline = time.monotonic() + timeout_s
    for w in workers:
        with contextlib.suppress(ray.exceptions.RayError):  # dead (or lost): as wanted
            ray.get(w.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
    with contextlib.suppress(Exception):  # already removed
        remove_placement_group(pg)


def _rank_worker() -> type:
    from pdserve.parallel.worker import RankWorker  # the rank's code: torch, the model

    return RankWorker


def _spawn(
    worker_cls: type,
    worker_args: tuple[Any, ...],
    specs: list[RankSpec],
    res: RankResources,
    pg: Any,
) -> list[Any]:
    """One actor per rank, each in its bundle of the instance's placement group."""
    # Control and health calls never queue behind the data path (see
    # pdserve.cluster.worker); RankWorker itself uses neither group.
    # (Ray's typed overloads of ray.remote omit concurrency_groups.)
    actor = ray.remote(concurrency_groups={CONTROL: 16, HEALTH: 4})(  # type: ignore[call-overload]
        worker_cls
    )
    return [
        actor.options(
            num_cpus=res.num_cpus,
            num_gpus=res.num_gpus,
            max_concurrency=64,  # the default group: the data path
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=spec.rank
            ),
        ).remote(spec, *worker_args)
        for spec in specs
    ]


class PhaseClock:
    """Seconds between successive marks, by the name of the phase each mark ends."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = now - self._last
        self._last = now


def _reserve_ranks(world_size: int, res: RankResources, name: str) -> Any:
    """The ranks' placement group, once placed (Ray started by :func:`ensure_ray`)."""
    ensure_ray(rank_needs(world_size, res))
    bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
    pg = _placement_group([bundle] * world_size, res.labels, name)
    wait_s = res.start_timeout_s if res.place_timeout_s is None else res.place_timeout_s
    try:
        ray.get(pg.ready(), timeout=wait_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise InstanceFailedError(
            f"{world_size} ranks of {bundle} each were not placed within {wait_s:g} s "
            f"(the Ray cluster has {ray.cluster_resources()})"
        ) from None
    return pg


_ray_start = threading.Lock()


def rank_needs(world_size: int, res: RankResources) -> dict[str, float]:
    """The Ray resources ``world_size`` ranks of ``res`` hold together."""
    needs = {"CPU": world_size * res.num_cpus}
    if res.num_gpus:
        needs["GPU"] = world_size * res.num_gpus
    return needs


def ensure_ray(needs: dict[str, float], field: str = "tensor_parallel_size") -> None:
    """Start Ray for this process if it has none, then refuse ``needs`` its cluster cannot
    hold (naming ``field``) rather than wait out the placement timeout.

    Ray starts once per process, whichever thread asks first: with this host's cores,
    or as many CPUs as ``needs`` asks (ranks then share the cores: a layout larger than
    the host still runs, slower); a process that finds a running cluster (RAY_ADDRESS,
    ``ray start``) joins it. A caller that starts several instances at once asks first
    for all of them, so one Ray instance is sized for the lot.
    """
    with _ray_start:
        if not ray.is_initialized():
            cores = os.cpu_count() or 1
            need = needs.get("CPU", 0.0)
            if need > cores:
                logger.warning("ranks ask for %g CPUs on %d cores: they share them", need, cores)
            try:
                # no Ray dashboard, as `pdserve serve`'s embedded Ray: it doubled
                # Ray's start-up CPU (3.7 -> 7.0 CPU-s on a 2-core VM)
                ray.init(
                    log_to_driver=False,
                    include_dashboard=False,
                    num_cpus=max(cores, math.ceil(need)),
                )
            except ValueError:  # it joins a running cluster: its CPUs
                ray.init(log_to_driver=False)
    check_fits(needs, ray.cluster_resources(), field)


def _check_same_adapters(read: list[dict[str, str]]) -> None:
    """Every rank read the same bytes for each start-up LoRA adapter (a folder that changed
    while the ranks read it would leave them serving different contents under one name)."""
    for rank, fingerprints in enumerate(read):
        for name, fingerprint in fingerprints.items():
            if fingerprint != read[0].get(name):
                raise InvalidArgumentError(
                    "lora_adapters",
                    f"adapter {name!r}: rank {rank} read other bytes than rank 0 "
                    f"({fingerprint} against {read[0].get(name)}): the folder changed "
                    "while the instance started; start it again",
                )


def _placement_group(
    bundles: list[dict[str, float]], labels: dict[str, str] | None, stem: str
) -> Any:
    name = f"{stem}-{uuid.uuid4().hex[:8]}"
    if not labels:
        return placement_group(bundles, strategy="PACK", name=name)
    return placement_group(
        bundles, strategy="PACK", name=name, bundle_label_selector=[dict(labels)] * len(bundles)
    )


def _get(refs: Any, timeout_s: float | None) -> Any:
    """``ray.get`` that turns a dead or failing rank into a pdserve error."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except RayTaskError as e:
        cause = e.cause
        if isinstance(cause, PdserveError):
            raise cause from None
        raise InstanceFailedError(f"a rank failed: {cause or e}") from e
    except RayActorError as e:
        raise InstanceFailedError(f"a rank died: {e}") from e
