"""``pdserve profile --config CONFIG``: one profile of a cluster as it serves, for
``pdserve sim --profile`` to use as it is.

A profile of the steps alone (``pdserve profile --model``) times each step in
isolation; a served request also pays the front door, the router, the RPCs, the
hand-off between prefill and decode and the host's contention, and a simulation
from the steps alone came out 48-64% below the measured percentiles
(docs/results/simulator.md). This calibration measures those costs on the cluster
itself, the same way ``pdserve sim-validate`` does on its own setups
(:mod:`pdserve.sim.calibrate`):

1. the steps are timed here, in this process, with the decode ranks' thread count;
2. the config's cluster (started here for the calibration, or one already running
   on a Ray cluster, served from the same config) is loaded by ``pdserve bench
   serve``'s load generator with the calibration runs (one request at a time,
   bursts, short outputs, a steady stream, long prompts), every instance's engine
   steps traced;
3. the step model is fitted to the traced steps (per role, with their noise), then
   the per-step, per-sequence, per-hand-off and per-request overheads to the runs'
   TPOT and TTFT p50 (:func:`~pdserve.sim.calibrate.calibrate`).

The profile written holds all of it. Calibrate a cluster that serves nothing
else meanwhile: other traffic would be fitted as the cluster's own cost.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.core.errors import InvalidArgumentError, PdserveError
from pdserve.sim.calibrate import Overhead, Runs, calibrate, calibrated_profile, calibration_args
from pdserve.sim.live import Measured
from pdserve.sim.profile import Profile
from pdserve.sim.validate_measure import traced_runs
from pdserve.sim.validate_options import ValidateOptions


@dataclass(frozen=True)
class ClusterCalibration:
    """What ``pdserve profile --config`` calibrates, and how.

    Attributes:
    config: the cluster config file (its model, layouts and engine options).
    ray_address: a running Ray cluster whose pdserve cluster serves ``config``
        (None: the config's cluster is started here for the calibration, then stopped).
    api_key: the key the load generator sends (None: the config's first, if auth is on).
    calibration_requests: requests of each calibration run (bursts: two of 8).
    seed: of the calibration runs' prompts.
    per_role: fit each role's steps on their own, beside the other role's.
    """

    config: str
    ray_address: str | None = None
    api_key: str | None = None
    calibration_requests: int = 8
    seed: int = 0
    per_role: bool = True

    def __post_init__(self) -> None:
        if self.calibration_requests < 1:
            raise InvalidArgumentError(
                "calibration_requests", f"must be at least 1, got {self.calibration_requests}"
            )


@dataclass(frozen=True)
class Calibrated:
    """A calibration's profile, the overheads it found and the runs it was fitted on."""

    profile: Profile
    overhead: Overhead
    setup: str
    runs: list[dict[str, Any]]  # each calibration run's summary, as bench serve writes it
    wall_s: float


def setup_of(config: Any) -> str:
    """``colocated`` when no region starts a prefill instance, else ``disaggregated``:
    which calibration runs the cluster gets (:func:`~pdserve.sim.calibrate.calibration_args`)."""
    return "disaggregated" if any(r.prefill.count for r in config.regions) else "colocated"


def step_profile(config: Any, command: str) -> Profile:
    """The steps of the config's decode engine timed in this process, with as many torch
    threads as its ranks use."""
    import torch

    from pdserve.bench.report import machine_info
    from pdserve.sim.measure import MeasureGrid, measured_profile

    region = config.regions[0]
    engine = config.engine_config("decode", region)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(region.decode.num_cpus_per_rank)))
    try:
        return measured_profile(engine, MeasureGrid(), command, machine_info())
    finally:
        torch.set_num_threads(threads)


def context_of(config: Any) -> int:
    """The longest prompt and output together the config's decode engine takes."""
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model

    engine = config.engine_config("decode", config.regions[0])
    model = ModelConfig.from_dir(resolve_model(config.model))
    context = min(engine.max_model_len or model.max_position_embeddings, 1 << 20)
    if context < 2 * 128:
        raise InvalidArgumentError(
            "config", f"a context of {context} tokens is too short for the calibration runs"
        )
    return context


@contextlib.contextmanager
def serving(text: str, config: Any, address: str | None) -> Iterator[tuple[str, list[Any]]]:
    """(gRPC target, [(name, leader)] of every instance) of the config's cluster: the one
    running on the Ray cluster at ``address``, else one started here until the block ends."""
    import ray

    from pdserve.cluster.connect import connect, find_controller
    from pdserve.sim.validate_measure import instance_leaders

    if address is not None:
        connect(address, start_local=False)
        controller = find_controller()
        endpoints = ray.get(controller.status.remote()).endpoints
        if endpoints is None:
            raise InvalidArgumentError("ray_address", "the cluster there has no front door yet")
        yield f"grpc://{endpoints.grpc_address}", instance_leaders(controller)
        return
    from pdserve.bench.local import local_cluster, local_cpus
    from pdserve.cluster.connect import CONTROLLER, NAMESPACE

    with local_cluster(text, local_cpus(config)) as (endpoints, _):
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        yield f"grpc://{endpoints.grpc_address}", instance_leaders(controller)


def calibrate_cluster(opts: ClusterCalibration, command: str) -> Calibrated:
    """Time the steps, load the cluster with the calibration runs and fit (module doc)."""
    from pdserve.bench.soak import api_key_for
    from pdserve.cluster.config import parse_config

    start = time.perf_counter()
    path = Path(opts.config)
    text = path.read_text()
    config = parse_config(text, str(path))
    setup = setup_of(config)
    key = opts.api_key or api_key_for(config)
    flags = ValidateOptions(
        num_requests=opts.calibration_requests,
        seed=opts.seed,
        calibration_requests=opts.calibration_requests,
    )
    context = context_of(config)
    runs = [  # a model of a shorter context gets the longest prompts it takes
        (replace(run, prompt_len=min(run.prompt_len, context - run.output_len)), rate)
        for run, rate in calibration_args(flags, setup)
    ]
    from pdserve.sim.build import book_for

    book = book_for(config, [step_profile(config, command)], None)
    measured = []
    with serving(text, config, opts.ray_address) as (target, leaders):
        for run in traced_runs(target, leaders, runs, "calibration", (key, None)):
            measured.append(run)
            if run.summary["num_failed"]:  # a fit to failures would fit the errors' timing
                raise PdserveError(failed_run(runs, len(measured) - 1, run.summary))
    summaries = [m.summary for m in measured]
    overhead = calibrate(
        text, book, summaries, runs, Measured.role_traces(measured), per_role=opts.per_role
    )
    profile = calibrated_profile(book, overhead, command)
    return Calibrated(profile, overhead, setup, summaries, time.perf_counter() - start)


def failed_run(runs: Runs, i: int, summary: dict[str, Any]) -> str:
    """Why a calibration stopped at run ``i``: what it ran and how its requests failed."""
    flags, rate = runs[i]
    return (
        f"calibration run {i + 1} of {len(runs)} ({flags.prompt_len}-token prompts, "
        f"{flags.output_len} tokens out, {rate:g} req/s): {summary['num_failed']} of "
        f"{summary['num_requests']} requests failed: {summary['errors']}"
    )


def describe_calibration(c: Calibrated) -> str:
    """What the calibration found, in a few lines."""
    o = c.overhead
    roles = ", ".join(
        f"{role} x{fit.compute_scale:.2f} compute, x{fit.memory_scale:.2f} memory"
        for role, fit in sorted(o.role_live.items())
    )
    lines = [
        f"calibrated on a {c.setup} cluster: {len(c.runs)} runs, "
        f"{sum(int(r['num_requests']) for r in c.runs)} requests, {c.wall_s:.0f} s",
        f"  live steps: x{o.live.compute_scale:.2f} compute, x{o.live.memory_scale:.2f} "
        f"memory, noise {o.live.jitter:.0%}" + (f" ({roles})" if roles else ""),
        f"  overheads: {o.request_s * 1e3:.2f} ms a request, {o.step_s * 1e3:.2f} ms a step, "
        f"{o.seq_s * 1e3:.3f} ms a sequence a step, {o.handoff_s * 1e3:.2f} ms a hand-off",
    ]
    return "\n".join(lines)
