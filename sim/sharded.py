"""A fleet simulated in worker processes, one shard each (``pdserve sim --workers N``).

:func:`run_sharded` cuts the fleet into shards (:func:`~pdserve.sim.shards.plan_shards`),
starts a spawned process per shard (a :class:`~pdserve.sim.cluster.SimCluster` over
its cells) and advances them together, a window of virtual time at a time. After
each window every shard sends its regions' load (a
:class:`~pdserve.sim.shards.ShardReport`: pickled once, unpickled by a receiver
only when its router needs it) and the requests its router sent to another shard's region; before the
next, each shard takes the others' loads and the requests sent to it. When no
shard has work left, each sends its requests' rows, its instances' tallies, its
instance counts and planner decisions, merged here into one
:class:`~pdserve.sim.options.SimRun` that reports as a one-process run does.

Each region's planner runs in its shard on what the shard holds: a region split
into groups is planned group by group.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdserve.cluster.config import ClusterConfig
from pdserve.sim.build import ProfileBook
from pdserve.sim.cluster import SimCluster
from pdserve.sim.options import SimOptions, SimRun, long_lived_heap
from pdserve.sim.report import InstanceTally, tally
from pdserve.sim.results import RecordedRows, Recorder
from pdserve.sim.shards import Handoff, ShardReport, ShardSpec, group_of, plan_shards
from pdserve.sim.workload import SimWorkload


@dataclass
class ShardResult:
    """What a shard measured, sent once it is done."""

    rows: RecordedRows
    tallies: list[InstanceTally]
    counts: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    end_s: float
    events: int
    # CPU seconds: starting the process, building its cells, each window, the wind-up
    window_cpu_s: list[float]


def _serve(
    conn: Connection,
    config: ClusterConfig,
    book: ProfileBook,
    work: SimWorkload,
    options: SimOptions,
    spec: ShardSpec,
) -> None:
    """A worker process: one shard, a window at a time, as the coordinator says."""
    cpu = [0.0, time.process_time()]  # the first window: starting the process
    cluster = SimCluster(config, book, work, options, shard=spec)
    cluster.start()
    conn.send(ShardReport.of(spec.index, cluster.region_loads()))
    with long_lived_heap():
        while (msg := conn.recv()) is not None:
            cpu.append(time.process_time())
            until, reports, imports = msg
            for report in reports:
                cluster.receive(report)
            cluster.take_imports(imports)
            cluster.advance(until)
            report = ShardReport.of(spec.index, cluster.region_loads())
            conn.send((report, cluster.take_exports(), cluster.quiet()))
    cpu.append(time.process_time())
    run = cluster.stop()
    tallies = [tally(x) for x in run.instances]
    rows = run.recorder.take()
    cpu.append(time.process_time())
    spent = [b - a for a, b in itertools.pairwise(cpu)]
    conn.send(ShardResult(rows, tallies, run.counts, run.decisions, run.end_s, run.events, spent))


class _Router:
    """Which shard launches a request sent to a region: the region's, or for a region
    split into groups, its group's (drawn as its home arrivals are, by the request's
    index)."""

    def __init__(self, specs: list[ShardSpec]) -> None:
        groups: dict[str, list[tuple[int, int, int]]] = {}  # region: (group, shard, size)
        for spec in specs:
            for c in spec.cells:
                groups.setdefault(c.region, []).append((c.group, spec.index, len(c.instance_ids)))
        self.cells = {r: [(g, k) for g, k, _ in sorted(v)] for r, v in groups.items()}
        self.sizes = {r: np.array([n for _, _, n in sorted(v)]) for r, v in groups.items()}

    def shard(self, region: str, i: int) -> int:
        groups = self.cells[region]
        if len(groups) == 1:
            return groups[0][1]
        g = int(group_of(np.array([i]), len(groups), self.sizes[region].astype(float))[0])
        return groups[g][1]


def _windows(conns: list[Connection], specs: list[ShardSpec]) -> None:
    """Advance every shard a window at a time until none has work left."""
    loads = [conn.recv() for conn in conns]
    router, window = _Router(specs), specs[0].window_s
    imports: list[list[Handoff]] = [[] for _ in conns]
    step = 0
    while True:
        step += 1
        until = step * window if window < math.inf else math.inf
        for k, conn in enumerate(conns):
            conn.send((until, [b for j, b in enumerate(loads) if j != k], imports[k]))
        replies = [conn.recv() for conn in conns]
        loads = [r[0] for r in replies]
        imports = [[] for _ in conns]
        for _, exports, _ in replies:
            for h in exports:
                imports[router.shard(h.region, h.index)].append(h)
        if all(r[2] for r in replies) and not any(imports):
            return


def run_sharded(
    config: ClusterConfig,
    book: ProfileBook,
    work: SimWorkload,
    options: SimOptions,
    workers: int,
) -> SimRun:
    """The fleet simulated in ``workers`` spawned processes, merged into one run."""
    specs = plan_shards(config, work, workers)
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    try:
        for spec in specs:
            parent, child = ctx.Pipe()
            args = (child, config, book, work, options, spec)
            proc = ctx.Process(target=_serve, args=args, daemon=True)
            proc.start()
            conns.append(parent)
            procs.append(proc)
        own = time.process_time()
        _windows(conns, specs)
        own = time.process_time() - own
        for conn in conns:
            conn.send(None)
        results = [conn.recv() for conn in conns]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    run = merge(config, work, options, results)
    run.shards = shard_costs(specs, results, own)
    return run


def shard_costs(specs: list[ShardSpec], results: list[ShardResult], own_s: float) -> dict[str, Any]:
    """What each shard held and cost, and the run's critical path: per window the
    slowest shard's CPU seconds, added up, with the coordinator's own (what the run
    would take with a core per shard)."""
    windows = max(len(r.window_cpu_s) for r in results)
    costs = np.zeros((len(results), windows))
    for k, r in enumerate(results):
        costs[k, : len(r.window_cpu_s)] = r.window_cpu_s
    return {
        "workers": [
            {
                "cells": [f"{c.region}/{c.group}" if c.groups > 1 else c.region for c in s.cells],
                "arrivals": len(s.arrivals),
                "cpu_s": round(float(costs[k].sum()), 3),
            }
            for k, s in enumerate(specs)
        ],
        "window_s": specs[0].window_s if specs[0].window_s < math.inf else None,
        "windows": windows - 3,
        "coordinator_cpu_s": round(own_s, 3),
        "critical_path_cpu_s": round(float(costs.max(axis=0).sum()) + own_s, 3),
    }


def merge(
    config: ClusterConfig, work: SimWorkload, options: SimOptions, results: list[ShardResult]
) -> SimRun:
    """The shards' results as one run's."""
    rec = Recorder(work.arrival_s, work.prompt_len, work.output_len, work.home, options.keep_itl)
    for r in results:
        rec.put(r.rows)
    run = SimRun(rec, [g.name for g in config.regions], [])
    run.tallies = [t for r in results for t in r.tallies]
    run.end_s = max((r.end_s for r in results), default=0.0)
    run.events = sum(r.events for r in results)
    run.decisions = sorted((d for r in results for d in r.decisions), key=lambda d: d["t_s"])
    run.counts = merged_counts([r.counts for r in results], run.end_s)
    return run


def merged_counts(shards: list[list[dict[str, Any]]], end_s: float) -> list[dict[str, Any]]:
    """The fleet's instance counts over time: at each shard's change, every shard's
    latest counts added up (the shards' starts as one row, their ends as one at
    ``end_s``)."""
    latest: list[dict[str, Any]] = [rows[0] for rows in shards]
    changes = sorted(
        ((row["t_s"], k, n, row) for k, rows in enumerate(shards) for n, row in enumerate(rows)),
        key=lambda x: x[:3],
    )

    def total(t_s: float, why: str) -> dict[str, Any]:
        keys = [k for k in latest[0] if k not in ("t_s", "event")]
        return {"t_s": round(t_s, 3), "event": why} | {
            k: sum(row.get(k, 0) for row in latest) for k in keys
        }

    out = [total(0.0, "start")]
    for t_s, k, _, row in changes:
        if row["event"] in ("start", "end"):
            continue
        latest[k] = row
        out.append(total(t_s, row["event"]))
    out.append(total(end_s, "end"))
    return out
