"""``pdserve profile``: time the real engine and fit its step model.

One rank runs in this process behind the engine's own executor
(:class:`~pdserve.parallel.executor.LocalExecutor`); a multi-rank layout runs
as a served instance's ranks do (Ray actors, timed at the leader). Each sample is one
:class:`~pdserve.core.step.StepPlan` executed ``repeats`` times (fastest kept):

- prefill: one sequence of ``n`` new tokens over ``c`` cached ones (a chunk
  after a prefix-cache hit or an earlier chunk), for a grid of (n, c);
- decode: ``b`` sequences of one new token over ``c`` cached tokens each.

Pages hold whatever the cache holds (timing does not depend on values), and a
step's pages are scattered over the pool, as a serving instance's are once
requests have come and gone (its pool hands freed pages out again in reverse).
Where a step reads them matters: on the 2-core VM a one-thread decode step of
builtin:small over 1,040 cached tokens took 1.27-1.31x as long on scattered
pages as on one ascending run (a timing script, ``docs/results/simulator.md``), and
1.09-1.17x once the decode kernel prefetched its rows. The KV hand-off is
timed on the shared-memory connector's data path: a copy of a request's pages
into a tensor mapped from a file under ``/dev/shm``.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.core.config import EngineConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan
from pdserve.sim.fit import fit_error, fit_robust
from pdserve.sim.profile import (
    ModelShape,
    Profile,
    Sample,
    StepFeatures,
    StepModel,
    TransferModel,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeasureGrid:
    """What ``pdserve profile`` times (the default runs in well under two minutes
    on builtin:tiny and builtin:small on two CPU cores).

    Attributes:
        prefill_tokens: new tokens of the one prefill sequence.
        prefill_cached: cached tokens before them.
        decode_batch: sequences of a decode step.
        decode_context: cached tokens of each decode sequence.
        repeats: timed runs per sample (after one warm-up); the fastest is kept (another
            process can only make a step slower).
    """

    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)
    prefill_cached: tuple[int, ...] = (0, 256, 768)
    decode_batch: tuple[int, ...] = (1, 4, 16, 32)
    decode_context: tuple[int, ...] = (64, 256, 768)
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise InvalidArgumentError("repeats", f"must be at least 1, got {self.repeats}")


# ``pdserve profile --grid gpu``: the shapes a GPU instance serves (long prompts, big batches).
GPU_GRID = MeasureGrid(
    prefill_tokens=(128, 512, 1024, 2048, 4096),
    prefill_cached=(0, 2048, 8192),
    decode_batch=(1, 16, 64, 128, 256),
    decode_context=(256, 1024, 4096),
)
GRIDS = {"cpu": MeasureGrid(), "gpu": GPU_GRID}


def scattered_pages(num_blocks: int, seed: int = 0) -> list[int]:
    """Every page of a pool of ``num_blocks``, in a random order."""
    return random.Random(seed).sample(range(num_blocks), num_blocks)


def profile_plan(
    step_id: int, rows: list[tuple[int, int]], block_size: int, pages: list[int]
) -> StepPlan:
    """A plan of sequences (new, cached), each on its own pages, taken in turn from ``pages``."""
    seqs, next_block = [], 0
    for i, (n, c) in enumerate(rows):
        blocks = -(-(n + c) // block_size)
        table = pages[next_block : next_block + blocks]
        next_block += blocks
        seqs.append(ScheduledSeq(f"s{i}", [5] * n, c, table, RowSampling()))
    return StepPlan(step_id, seqs)


Timer = Callable[[list[StepPlan]], list[float]]  # seconds each plan took to execute


def _time_plan(
    timer: Timer, rows: list[tuple[int, int]], block_size: int, repeats: int, pages: list[int]
) -> float:
    """The fastest of ``repeats`` runs of a step of ``rows``, after one warm-up run."""
    times = timer([profile_plan(r, rows, block_size, pages) for r in range(repeats + 1)])
    return min(times[1:])


def measure_steps(config: EngineConfig, grid: MeasureGrid) -> tuple[list[Sample], int, ModelConfig]:
    """Time the grid on a fresh instance of ``config``'s layout: (samples, KV blocks per
    rank, model config). One rank runs in this process behind the engine's own
    executor; a tensor, pipeline or expert parallel layout starts its ranks as Ray
    actors and times each step at the leader, the plan sent through every rank as a
    served step's is."""
    from pdserve.models.builtin import resolve_model

    model = ModelConfig.from_dir(resolve_model(config.model))
    bs = config.cache.block_size
    if config.parallel.world_size == 1 and config.parallel.expert_parallel_size == 1:
        from pdserve.parallel.executor import LocalExecutor, time_plans

        executor = LocalExecutor(model, config)
        timer = functools.partial(time_plans, executor)
        return _measure_twice(timer, executor.num_kv_blocks, model, grid, bs)
    import ray

    from pdserve.parallel.instance import RankGroup

    group = RankGroup.start(model, config)

    def at_leader(plans: list[StepPlan]) -> list[float]:
        return list(ray.get(group.leader.time_plans.remote(plans)))

    try:
        return _measure_twice(at_leader, group.info.num_kv_blocks, model, grid, bs)
    finally:
        group.shutdown()


def _measure_twice(
    timer: Timer, num_blocks: int, model: ModelConfig, grid: MeasureGrid, bs: int
) -> tuple[list[Sample], int, ModelConfig]:
    for _ in range(2):  # the first pass warms every shape up; the second is kept
        samples = measure_grid(timer, num_blocks, model, grid, bs)
    logger.info("profiled %d steps", len(samples))
    return samples, num_blocks, model


def measure_grid(
    timer: Timer, num_blocks: int, model: ModelConfig, grid: MeasureGrid, bs: int
) -> list[Sample]:
    """Every shape of ``grid`` timed by ``timer`` on pages scattered over a pool of
    ``num_blocks``."""
    pages = scattered_pages(num_blocks)
    samples, capacity = [], len(pages) * bs
    for n in grid.prefill_tokens:
        for c in grid.prefill_cached:
            if n + c <= min(capacity, model.max_position_embeddings):
                rows = [(n, c)]
                secs = _time_plan(timer, rows, bs, grid.repeats, pages)
                samples.append(Sample("prefill", StepFeatures.of(rows), secs))
    for b in grid.decode_batch:
        for c in grid.decode_context:
            if b * (c + bs) <= capacity and c < model.max_position_embeddings:
                rows = [(1, c)] * b
                secs = _time_plan(timer, rows, bs, grid.repeats, pages)
                samples.append(Sample("decode", StepFeatures.of(rows), secs))
    return samples


def measure_shm_transfer(num_bytes: tuple[int, ...] = (1 << 20, 32 << 20)) -> TransferModel:
    """Bandwidth from the largest copy into a ``/dev/shm``-mapped tensor, latency from
    what the smallest copy takes beyond it (fastest of 5 runs each)."""
    import torch

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    best: dict[int, float] = {}
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        dst_all = torch.from_file(f.name, shared=True, size=max(num_bytes), dtype=torch.uint8)
        for n in num_bytes:
            src = torch.ones(n, dtype=torch.uint8)
            dst = dst_all[:n]
            dst.copy_(src)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - start)
            best[n] = min(times)
    big, small = max(num_bytes), min(num_bytes)
    bandwidth = big / best[big]
    return TransferModel(max(0.0, best[small] - small / bandwidth), bandwidth)


def measured_profile(
    config: EngineConfig, grid: MeasureGrid, command: str, machine: dict[str, object]
) -> Profile:
    samples, num_blocks, m = measure_steps(config, grid)
    step, dropped = fit_robust(samples)
    if dropped:
        logger.warning("%d of %d steps left out of the fit as outliers", len(dropped), len(samples))
    shm = measure_shm_transfer()
    shape = ModelShape(
        config.model,
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.intermediate_size,
        m.vocab_size,
        m.max_position_embeddings,
        m.num_experts,
        m.num_experts_per_tok,
    )
    dtype = config.dtype if config.dtype != "auto" else m.dtype
    elem = 4 if dtype == "float32" else 2
    gpu = machine.get("gpu")
    parallel = config.parallel
    return Profile(
        model=shape,
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        device=_device_name(gpu if isinstance(gpu, str) else None),
        source="measured",
        step=step,
        kv_bytes_per_token=shape.kv_bytes_per_token(elem),
        kv_capacity_tokens=num_blocks * config.cache.block_size,
        dtype=dtype,
        connectors={"shm": shm, "default": shm},
        samples=tuple(samples),
        fit_error={**fit_error(step, samples), **_inliers(step, samples, dropped)},
        command=command,
        machine=machine,
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _inliers(step: StepModel, samples: list[Sample], dropped: list[Sample]) -> dict[str, float]:
    """The fit's error over the steps it kept, and how many it left out."""
    kept = [s for s in samples if s not in dropped]
    err = fit_error(step, kept)
    return {
        "inliers_mean_rel": err["all_mean_rel"],
        "inliers_max_rel": err["all_max_rel"],
        "outliers": float(len(dropped)),
    }


def _device_name(gpu: str | None) -> str:
    if gpu is None:
        return "cpu"
    for name in ("h200", "h100", "a100"):
        if name in gpu.lower():
            return name
    return gpu
