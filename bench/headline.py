"""``pdserve bench disagg-vs-colocated``: goodput of disaggregated against colocated
serving on the same cores, swept over request rates.

    pdserve bench disagg-vs-colocated            # full sweep
    pdserve bench disagg-vs-colocated --quick    # smoke check, under 2 minutes

Two clusters on one machine, one after the other, loaded with the same
workload (long prompts, short outputs, Poisson arrivals, same seed) at each rate:

- colocated: one decode-role instance that prefills every prompt itself with
  chunked prefill (``local_prefill_max_tokens`` above any prompt, no prefill
  instance); its rank gets every core (``--cores``) and as many torch threads;
- disaggregated: one prefill and one decode instance (``local_prefill_max_tokens: 0``),
  KV handed over by the connector; the prefill rank is pinned to the first
  core, the decode rank to the second, one torch thread each.

The router and this load generator are not pinned (they are the same in both
setups). Reported per setup and rate: goodput within the SLOs, SLO attainment,
p99 TTFT and TPOT; per setup, the highest rate whose attainment (and every
lower rate's) reached 90%; and the ratio of the two setups' goodputs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.bench.flags import file_stem
from pdserve.bench.local import local_cluster
from pdserve.bench.report import Slo, goodput, header, max_rate_meeting
from pdserve.bench.serve import (
    RunFlags,
    RunResult,
    add_load_flags,
    add_workload_flags,
    check_load_flags,
    command_line,
    options_json,
    serve_rates,
    slo_from,
    summary_table,
    with_prompt_seed,
    write_outputs,
)
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from

MODES = ("colocated", "disaggregated")
FULL_RATES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
QUICK_RATES = (0.5, 1.5)
TPOT_SWEEP_MS = (25.0, 40.0, 60.0, 100.0)

CONFIG = """\
model: {model}
connector: {connector}
engine: {{dtype: float32, max_num_batched_tokens: {budget}}}
ray: {{num_cpus: {cpus}}}
regions:
  - name: local
    prefill: {{count: {p}, min: {p}, max: {p}, num_cpus_per_rank: {p_cpus},
              engine: {{max_num_batched_tokens: {prefill_budget}}}}}
    decode: {{count: 1, min: 1, max: 1, num_cpus_per_rank: {d_cpus}}}
slo: {{ttft_ms: {ttft}, tpot_ms: {tpot}}}
server: {{host: 127.0.0.1, grpc_port: 0, http_port: 0}}
auth: {{disabled: true}}
planner: {{mode: "off"}}
disaggregation: {{local_prefill_max_tokens: {local_max}}}
"""


@dataclass(frozen=True)
class ClusterSetup:
    """What the cluster of a setup (:func:`cluster_setup`) is made from."""

    model: str  # the model every instance serves
    cores: list[int]  # the cores its ranks are pinned to
    connector: str = "shm"  # the KV connector between prefill and decode
    max_num_batched_tokens: int = 256  # the decode-role instance's per-step token budget
    prefill_max_num_batched_tokens: int = 2048  # the prefill instance's per-step budget
    ttft_slo_ms: float | None = 2000.0  # the cluster's TTFT SLO
    tpot_slo_ms: float | None = 200.0  # the cluster's TPOT SLO

    @staticmethod
    def of(options: Any) -> ClusterSetup:
        """The setup of a command's options that name the model, the cores, the connector,
        both token budgets and the load flags' SLOs (``run``)."""
        return ClusterSetup(
            options.model,
            options.cores,
            options.connector,
            options.max_num_batched_tokens,
            options.prefill_max_num_batched_tokens,
            options.run.ttft_slo_ms,
            options.run.tpot_slo_ms,
        )


@dataclass(frozen=True)
class HeadlineOptions:
    """``pdserve bench disagg-vs-colocated``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model served
    rate: list[float] | None = None  # request rates (None: FULL_RATES, or QUICK_RATES)
    modes: list[str] = field(default_factory=lambda: list(MODES))  # the setups run
    cores: list[int] = field(default_factory=list)  # the cores both setups share
    connector: str = "shm"  # the KV connector of the disaggregated setup
    max_num_batched_tokens: int = 256  # the decode-role instance's per-step token budget
    prefill_max_num_batched_tokens: int = 2048  # the prefill instance's per-step budget
    tpot_slo_sweep_ms: list[float] = field(default_factory=lambda: list(TPOT_SWEEP_MS))
    quick: bool = False  # QUICK_RATES, 5 requests each
    run: RunFlags = field(default_factory=RunFlags)  # the workload and load flags
    out: str = "bench/out/headline"  # output folder
    name: str = "disagg-vs-colocated"  # output file stem
    target: None = None  # (recorded as bench serve's: the clusters are local)
    api_key: None = None  # (recorded as bench serve's: no key)
    prog: str = "pdserve bench disagg-vs-colocated"  # the command, for the record

    @property
    def setup(self) -> ClusterSetup:
        return ClusterSetup.of(self)


def add_cores_flag(p: argparse.ArgumentParser, what: str) -> None:
    """``--cores``: ``what`` they are for; the first two this process may use by default."""
    usable = sorted(os.sched_getaffinity(0))
    p.add_argument(
        "--cores",
        type=int,
        nargs="+",
        default=usable[:2],
        help=f"{what} (default: the first two usable)",
    )


def check_cores(cores: list[int], modes: list[str]) -> None:
    """``--cores`` names distinct cores this process may run on, two or more for a
    disaggregated setup (a core each for prefill and decode)."""
    usable = os.sched_getaffinity(0)
    if not cores or len(set(cores)) != len(cores):
        raise InvalidArgumentError("cores", f"must name distinct cores, got {cores}")
    if not set(cores) <= usable:
        others = sorted(set(cores) - usable)
        raise InvalidArgumentError("cores", f"{others} not usable here (usable: {sorted(usable)})")
    if "disaggregated" in modes and len(cores) < 2:
        raise InvalidArgumentError("cores", "disaggregated serving needs two cores (--cores A B)")


def cluster_setup(mode: str, args: ClusterSetup) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(cluster config YAML, cores per role) of one setup on ``args.cores``."""
    cores = tuple(args.cores)
    check_cores(list(cores), [mode])
    if mode == "colocated":
        values = {"p": 0, "p_cpus": 1, "d_cpus": len(cores), "local_max": 1_000_000}
        pins = {"decode": cores}
    elif mode == "disaggregated":
        half = len(cores) // 2
        values = {"p": 1, "p_cpus": half, "d_cpus": len(cores) - half, "local_max": 0}
        pins = {"prefill": cores[:half], "decode": cores[half:]}
    else:
        raise SystemExit(f"unknown mode {mode!r}: {MODES}")
    text = CONFIG.format(
        model=args.model,
        connector=args.connector,
        budget=args.max_num_batched_tokens,
        prefill_budget=args.prefill_max_num_batched_tokens,
        cpus=len(cores),
        ttft=args.ttft_slo_ms,
        tpot=args.tpot_slo_ms,
        **values,
    )
    return text, pins


def run_mode(mode: str, args: HeadlineOptions) -> tuple[list[RunResult], list[dict[str, Any]]]:
    config, pins = cluster_setup(mode, args.setup)
    with local_cluster(config, len(args.cores), pins) as (endpoints, pinned):
        target = f"grpc://{endpoints.grpc_address}"
        runs = serve_rates(args.run, target, list(args.rate or ()), label=mode)
    return runs, [vars(p) for p in pinned]


def compare(series: dict[str, list[RunResult]]) -> dict[str, Any]:
    """Per-rate figures of both setups, the best rate at 90% attainment, and ratios."""
    table: list[dict[str, Any]] = []
    rates = sorted({r.rate for runs in series.values() for r in runs if r.rate is not None})
    for rate in rates:
        row: dict[str, Any] = {"rate": rate}
        for mode, runs in series.items():
            s = next(r.summary for r in runs if r.rate == rate)
            row[mode] = {
                "goodput_rps": round(s["goodput_rps"], 4),
                "attainment": round(s["attainment"], 4),
                "ttft_p99_ms": s["ttft_ms"].get("p99"),
                "tpot_p99_ms": s["tpot_ms"].get("p99"),
                "output_tok_s": round(s["output_tok_s"], 2),
                "num_failed": s["num_failed"],
            }
        if all(m in row for m in MODES):
            col = row["colocated"]["goodput_rps"]
            row["goodput_ratio"] = (
                round(row["disaggregated"]["goodput_rps"] / col, 3) if col else None
            )
        table.append(row)
    best = {
        mode: max_rate_meeting(
            [r.rate for r in runs if r.rate is not None],
            [r.summary["attainment"] for r in runs if r.rate is not None],
            0.9,
        )
        for mode, runs in series.items()
    }
    out: dict[str, Any] = {"per_rate": table, "max_rate_at_90pct_attainment": best}
    disaggregated, colocated = best.get("disaggregated"), best.get("colocated")
    if disaggregated and colocated:
        out["max_rate_ratio"] = round(disaggregated / colocated, 3)
    return out


def tpot_sweep(
    series: dict[str, list[RunResult]], ttft_s: float, tpots_ms: list[float]
) -> list[dict[str, Any]]:
    """Each setup's best goodput over the rates, recomputed at several TPOT SLOs.

    Whether disaggregation pays depends on how tight the TPOT objective is
    (prefill interferes with decode steps only in colocated serving), so the
    same runs are scored at each objective rather than at one chosen value.
    """
    rows = []
    for tpot_ms in tpots_ms:
        slo = Slo(ttft_s, tpot_ms / 1e3)
        row: dict[str, Any] = {"tpot_slo_ms": tpot_ms}
        for mode, runs in series.items():
            row[mode] = round(max((goodput(r.records, slo) for r in runs), default=0.0), 4)
        if all(m in row for m in MODES) and row["colocated"]:
            row["ratio"] = round(row["disaggregated"] / row["colocated"], 3)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    return headline(with_quick(options_from(HeadlineOptions, args)))


def with_quick(args: HeadlineOptions) -> HeadlineOptions:
    """The rates and request counts ``--quick`` and the defaults give."""
    flags = args.run
    if args.quick:
        args = replace(args, rate=args.rate or list(QUICK_RATES))
        flags = replace(flags, num_requests=flags.num_requests or 5, warmup=min(flags.warmup, 1))
    if flags.num_requests is None and flags.duration is None:
        flags = replace(flags, num_requests=40)
    return replace(args, rate=args.rate or list(FULL_RATES), run=with_prompt_seed(flags))


def headline(args: HeadlineOptions) -> int:
    """Both setups at each rate, their comparison written and printed."""
    from pdserve.models.builtin import resolve_model

    check_cores(args.cores, args.modes)
    check_load_flags(args.run)
    resolve_model(args.model)  # a built-in model is generated once, before the clusters start
    series: dict[str, list[RunResult]] = {}
    pinned: dict[str, list[dict[str, Any]]] = {}
    for mode in args.modes:
        series[mode], pinned[mode] = run_mode(mode, args)
    result = compare(series)
    ttft_slo_ms = args.run.ttft_slo_ms
    result["best_goodput_by_tpot_slo"] = tpot_sweep(
        series, (ttft_slo_ms or 0.0) / 1e3, args.tpot_slo_sweep_ms
    )
    payload = {
        **header(command_line(args.prog, args)),
        "quick": args.quick,
        "options": options_json(args),
        "pinning": pinned,
        "comparison": result,
        "runs": {mode: [r.to_json() for r in runs] for mode, runs in series.items()},
    }
    paths = write_outputs(Path(args.out), args.name, payload, series, slo_from(args.run))
    rows = [(f"{mode} {r.rate:g}/s", r) for mode, runs in series.items() for r in runs]
    print(summary_table(rows))
    print(f"highest rate with >= 90% SLO attainment: {result['max_rate_at_90pct_attainment']}")
    if "max_rate_ratio" in result:
        print(f"disaggregated / colocated: {result['max_rate_ratio']}x")
    for row in result["best_goodput_by_tpot_slo"]:
        print(
            f"TPOT SLO {row['tpot_slo_ms']:g} ms: best goodput "
            + ", ".join(f"{m} {row[m]:.3f}/s" for m in series)
            + (f" (ratio {row['ratio']}x)" if "ratio" in row else "")
        )
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=None,
        help=f"request rates (default {' '.join(map(str, FULL_RATES))})",
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    add_cores_flag(p, "cores both setups share")
    p.add_argument("--connector", default="shm")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="per-step token budget of the decode-role instance: the prefill "
        "chunk that colocated serving interleaves with decode steps",
    )
    p.add_argument(
        "--prefill-max-num-batched-tokens",
        type=int,
        default=2048,
        help="per-step token budget of the prefill instance (disaggregated): "
        "with no decodes to protect it takes a whole prompt per step",
    )
    p.add_argument(
        "--tpot-slo-sweep-ms",
        type=float,
        nargs="+",
        default=list(TPOT_SWEEP_MS),
        help="TPOT SLOs to recompute goodput at, from the same runs",
    )
    p.add_argument("--quick", action="store_true", help=f"rates {QUICK_RATES}, 5 requests each")
    add_workload_flags(p, prompt_len=768, output_len=32)
    add_load_flags(p)
    p.set_defaults(prompt_len_range=[512, 1024], ttft_slo_ms=3000.0, tpot_slo_ms=100.0)
    p.add_argument("--out", default="bench/out/headline")
    p.add_argument("--name", type=file_stem, default="disagg-vs-colocated")
    p.set_defaults(func=run, prog="pdserve bench disagg-vs-colocated", target=None, api_key=None)
