"""A simulated run as ``pdserve bench serve`` reports a measured one, plus what only a
simulator sees: per-region and per-role figures and instance counts over time.

:func:`run_json` is one entry of the result file's ``runs`` list: the keys of
:meth:`pdserve.bench.serve.RunResult.to_json` (``rate``, ``summary``,
``requests``) and ``per_region``, ``per_role``, ``instances_over_time``,
``planner_decisions`` and ``sim`` (wall time, events, virtual seconds, mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.report import RequestRecord, Slo, records_json
from pdserve.sim.cluster import SimRun
from pdserve.sim.instance import SimInstance


@dataclass(frozen=True)
class InstanceTally:
    """What one instance did in a run, as :func:`per_role` adds it up."""

    region: str
    role: str
    steps: int
    busy_s: float
    batch_sum: int
    tokens: int
    preemptions: int
    runs: int


def tally(inst: SimInstance) -> InstanceTally:
    s = inst.stats
    n = inst.scheduler.num_preemptions
    return InstanceTally(
        inst.region, inst.role, s.steps, s.busy_s, s.batch_sum, s.tokens, n, s.runs
    )


def per_role(instances: list[InstanceTally], span_s: float) -> dict[str, Any]:
    """Per region and role: instances, steps, utilisation, mean batch, preemptions."""
    out: dict[str, Any] = {}
    for s in instances:
        key = f"{s.region}.{s.role}"
        row = out.setdefault(
            key,
            {
                "instances": 0,
                "steps": 0,
                "busy_s": 0.0,
                "batch_sum": 0,
                "tokens": 0,
                "preemptions": 0,
                "schedule_calls": 0,
            },
        )
        row["instances"] += 1
        row["steps"] += s.steps
        row["busy_s"] += s.busy_s
        row["batch_sum"] += s.batch_sum
        row["tokens"] += s.tokens
        row["preemptions"] += s.preemptions
        row["schedule_calls"] += s.runs
    for row in out.values():
        row["utilisation"] = (
            round(row["busy_s"] / (span_s * row["instances"]), 4) if span_s else 0.0
        )
        row["mean_batch"] = round(row["batch_sum"] / row["steps"], 2) if row["steps"] else 0.0
        row["busy_s"] = round(row.pop("busy_s"), 3)
        row.pop("batch_sum")
    return out


def run_tallies(run: SimRun) -> list[InstanceTally]:
    """Every instance's tally: a merged run's (sim/sharded.py) as its shards sent them."""
    return run.tallies if run.tallies is not None else [tally(x) for x in run.instances]


def run_json(
    run: SimRun,
    rate: float | None,
    slo: Slo,
    wall_s: float,
    mode: str,
    records: list[RequestRecord],
) -> dict[str, Any]:
    """``records``: the run's request records to write (none past the records limit)."""
    rec = run.recorder
    n = len(rec.arrival)
    per_region = {name: rec.summary(slo, rec.region == i) for i, name in enumerate(run.regions)}
    return {
        "rate": rate,
        "summary": rec.summary(slo),
        "requests": records_json(records),
        "per_region": per_region,
        "per_role": per_role(run_tallies(run), run.end_s),
        "instances_over_time": run.counts,
        "planner_decisions": run.decisions,
        "sim": {
            "wall_s": round(wall_s, 3),
            "events": run.events,
            "virtual_s": round(run.end_s, 3),
            "mode": mode,
            "requests": n,
        }
        | ({} if run.shards is None else {"shards": run.shards}),
    }


def plot_instance_counts(counts: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Instances per region and role against virtual time (a step plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    keys = [k for k in counts[0] if k not in ("t_s", "event")] if counts else []
    times = [row["t_s"] for row in counts]
    for key in keys:
        ax.step(times, [row[key] for row in counts], where="post", label=key)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("instances")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
