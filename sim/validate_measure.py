"""What ``pdserve sim-validate`` measures: each setup's cluster YAML and cores, its
profile (the steps timed here on the cores and with the threads the setup's ranks
get), and the runs on a local cluster of the setup, every engine's steps traced.
``pdserve profile --config`` measures its runs the same way
(:func:`traced_runs`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pdserve.sim.calibrate import Runs
from pdserve.sim.live import Measured, traced
from pdserve.sim.validate_options import ValidateOptions

if TYPE_CHECKING:
    from pdserve.bench.headline import ClusterSetup


@contextlib.contextmanager
def pinned_here(cores: tuple[int, ...]) -> Iterator[None]:
    """This process on ``cores`` with as many torch threads, as a rank would be."""
    import torch

    from pdserve.bench.local import claim_cores

    before, threads = claim_cores(set(cores)), torch.get_num_threads()
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def _setup_options(args: ValidateOptions) -> ClusterSetup:
    """The setups' clusters: the model on the cores, SLOs no run misses."""
    from pdserve.bench.headline import ClusterSetup

    return ClusterSetup(
        model=args.model,
        cores=args.cores,
        connector="shm",
        max_num_batched_tokens=256,
        prefill_max_num_batched_tokens=2048,
        ttft_slo_ms=100000.0,
        tpot_slo_ms=100000.0,
    )


def setup_config(setup: str, args: ValidateOptions) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(cluster YAML, each role's cores) of a setup."""
    from pdserve.bench.headline import cluster_setup

    return cluster_setup(setup, _setup_options(args))


def setup_profiles(setup: str, args: ValidateOptions) -> tuple[str, Any]:
    """(cluster YAML, profile book) of a setup: the profile measured on the cores and
    with the threads its ranks get."""
    from pdserve.bench.report import machine_info
    from pdserve.cluster.config import parse_config
    from pdserve.sim.build import book_for
    from pdserve.sim.measure import MeasureGrid, measured_profile

    text, pins = setup_config(setup, args)
    config = parse_config(text, f"<{setup}>")
    engine = config.engine_config("decode", config.regions[0])
    with pinned_here(pins["decode"]):
        profile = measured_profile(engine, MeasureGrid(), f"sim-validate {setup}", machine_info())
    return text, book_for(config, [profile], None)


def measure(text: str, setup: str, runs: Runs, args: ValidateOptions) -> list[Measured]:
    """Each (workload flags, rate) measured in turn on one local cluster of the setup,
    with every instance's engine steps traced."""
    import ray

    from pdserve.bench.headline import cluster_setup
    from pdserve.bench.local import local_cluster
    from pdserve.cluster.connect import CONTROLLER, NAMESPACE

    _, pins = cluster_setup(setup, _setup_options(args))
    with local_cluster(text, len(args.cores), pins) as (endpoints, _):
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        target = f"grpc://{endpoints.grpc_address}"
        return list(traced_runs(target, instance_leaders(controller), runs, setup))


def instance_leaders(controller: Any) -> list[tuple[str, Any]]:
    """(name, leader actor) of every instance of a cluster's controller, named
    ``{role}{index}`` (:meth:`~pdserve.sim.live.Measured.role_of`)."""
    import ray

    handles = ray.get(controller.instance_handles.remote())
    return [(f"{role}{i}", leader) for i, (role, leader) in enumerate(handles)]


def traced_runs(
    target: str,
    leaders: list[tuple[str, Any]],
    runs: Runs,
    label: str,
    client_as: tuple[str | None, str | None] = (None, None),
) -> Iterator[Measured]:
    """Each (workload flags, rate) of ``runs`` in turn against ``target``, every
    instance's engine steps traced (``leaders``: :func:`instance_leaders`); one
    :class:`~pdserve.sim.live.Measured` a run, as it ends."""
    from pdserve.bench.serve import serve_rates

    for i, (flags, rate) in enumerate(runs):
        with traced(leaders) as steps:
            result = serve_rates(flags, target, [rate], label, first_run=i, client_as=client_as)[0]
        yield Measured(result.summary, steps)
