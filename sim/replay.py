"""A traffic shift replayed under each planner policy, simulated (``pdserve
sim-planners``, its command line in :mod:`pdserve.sim.replay_cli`).

The workload is one trace after another (by default the Azure conversation
trace, then the code trace: prompts twice as long, outputs an eighth), each
scaled to the same mean rate and cut to ``phase_s`` seconds. The same
cluster config runs it once per planner policy with the planner applying its
decisions, and the comparison says, per policy: requests meeting both SLOs
(all, and after the switch), when the first prefill instance was asked for
and when one was serving after the switch, and device-seconds used. The plot
is P:D over time for every policy. ``--write-trace`` saves the workload as a
trace CSV that ``pdserve bench serve --trace`` replays on a live cluster;
``--live`` replays it on a local cluster of the config itself, once per policy
(:mod:`pdserve.sim.replay_live`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.report import Slo
from pdserve.cluster.config import ClusterConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.build import ProfileBook
from pdserve.sim.cluster import SimCluster, SimOptions, SimRun
from pdserve.sim.replay_report import figures
from pdserve.sim.workload import SimWorkload

POLICIES = ("reactive", "proactive")
MAX_PHASE_REQUESTS = 10_000_000


def phased_workload(
    traces: list[str], rate: float, phase_s: float, max_prompt_len: int, max_output_len: int
) -> tuple[SimWorkload, list[float]]:
    """The traces one after another, each at ``rate`` req/s for ``phase_s`` seconds;
    also the times the phases start."""
    for name, value in (("rate", rate), ("phase_s", phase_s)):
        if not 0 < value < math.inf:
            raise InvalidArgumentError(name, f"must be > 0 and finite, got {value}")
    if rate * phase_s > MAX_PHASE_REQUESTS:
        raise InvalidArgumentError(
            "phase_s",
            f"{rate:g} req/s for {phase_s:g} s is over {MAX_PHASE_REQUESTS} "
            "requests a phase: shorten the phase or lower the rate",
        )
    arrival, prompt, output, starts = [], [], [], []
    for k, name in enumerate(traces):
        # the phase's own requests scaled to the rate: a trace is burstier than its mean
        raw = wl.limit_trace(wl.read_trace(wl.trace_path(name)), round(rate * phase_s) + 1, None)
        trace = wl.scale_trace(
            raw, rate=rate, max_prompt_len=max_prompt_len, max_output_len=max_output_len
        )
        trace = wl.limit_trace(trace, None, phase_s)
        starts.append(k * phase_s)
        arrival.append(trace.arrival_s + k * phase_s)
        prompt.append(trace.prompt_len)
        output.append(trace.output_len)
    a = np.concatenate(arrival)
    return SimWorkload(
        a, np.concatenate(prompt), np.concatenate(output), np.zeros(len(a), dtype=np.int16)
    ), starts


def with_policy(config: ClusterConfig, policy: str) -> ClusterConfig:
    """The config with its planner applying decisions under ``policy``."""
    return dataclasses.replace(
        config, planner=dataclasses.replace(config.planner, mode="on", policy=policy)
    )


def outcome(run: SimRun, slo: Slo, switch_s: float) -> dict[str, Any]:
    """One simulated policy's figures (:func:`figures`)."""
    rec = run.recorder
    return figures(rec.slo_met(slo), rec.arrival, run.counts, run.decisions, switch_s)


def compare(
    config: ClusterConfig,
    book: ProfileBook,
    work: SimWorkload,
    policies: list[str],
    startup_s: float,
    host_cores: float = 0.0,
) -> dict[str, tuple[SimRun, float]]:
    """Each policy's run of the same workload, with its wall time."""
    runs = {}
    for policy in policies:
        start = time.perf_counter()
        options = SimOptions(fast=True, keep_itl=False, startup_s=startup_s, host_cores=host_cores)
        run = SimCluster(with_policy(config, policy), book, work, options).run()
        runs[policy] = (run, time.perf_counter() - start)
    return runs
