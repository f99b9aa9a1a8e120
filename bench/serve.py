"""``pdserve bench serve``: drive a running pdserve cluster and measure goodput under SLOs.

    pdserve bench serve --target grpc://127.0.0.1:50051 --rate 1 2 4 \\
        --prompt-len 512 --prompt-len-std 128 --output-len 32 --num-requests 100 \\
        --ttft-slo-ms 2000 --tpot-slo-ms 200
    pdserve bench serve --target http://127.0.0.1:8000 --trace azure-conv \\
        --length-scale 0.25 --max-prompt-len 1024 --time-scale 0.5 --duration 60

Each rate in ``--rate`` is one run of the same workload (same arrival pattern
and lengths, fresh prompts) at that mean rate; with ``--trace`` the trace's own arrivals are
replayed (stretched by ``--time-scale``, or to a ``--rate`` when one is given).
Writes ``<out>/<name>.json`` (per-request records, summaries, the command line,
the date, the machine), a TTFT/TPOT CDF plot and, for several rates, goodput
against rate. The arithmetic is in :mod:`pdserve.bench.report`; the schedule and
lengths in :mod:`pdserve.bench.workload`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import shlex
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.flags import file_stem
from pdserve.bench.loadgen import Client, LoadOptions, open_client, run_load
from pdserve.bench.report import (
    RequestRecord,
    Slo,
    header,
    plot_goodput_vs_rate,
    plot_latency_cdfs,
    records_json,
    summarize,
    write_json,
)
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import flat_options, options_from


@dataclass(frozen=True)
class LoadFlags:
    """The load and SLO flags (:func:`add_load_flags`)."""

    max_concurrency: int | None = None  # most requests in flight (None: no limit)
    request_timeout: float = 600.0  # seconds from sending a request to giving up on it
    ttft_slo_ms: float | None = 2000.0  # time-to-first-token SLO
    tpot_slo_ms: float | None = 200.0  # time-per-output-token SLO
    no_progress: bool = False  # no progress bar


@dataclass(frozen=True)
class RunFlags(LoadFlags, wl.WorkloadFlags):
    """What a run of a workload needs besides its target and rate: the workload flags,
    then the load flags, in one flat set (it is either one where one is asked for)."""


@dataclass(frozen=True)
class ServeOptions:
    """``pdserve bench serve``'s options, in the order of its flags."""

    target: str  # grpc://HOST:PORT or http://HOST:PORT
    api_key: str | None = None  # sent as 'authorization: Bearer <key>'
    model: str | None = None  # model name (None: ask the server)
    rate: list[float] | None = None  # mean request rate(s); several: a sweep
    run: RunFlags = field(default_factory=RunFlags)  # the workload and load flags
    out: str = "bench/out/serve"  # output folder
    name: str = "serve"  # output file stem
    prog: str = "pdserve bench serve"  # the command, for the command line recorded


@dataclass
class RunResult:
    """One run of the workload at one rate."""

    rate: float | None
    records: list[RequestRecord]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"rate": self.rate, "summary": self.summary, "requests": records_json(self.records)}


# -- workload ---------------------------------------------------------------------------


def with_prompt_seed(flags: RunFlags) -> RunFlags:
    """``flags`` with ``--prompt-seed`` drawn when none was given (recorded with the
    options, and the same for every run of these flags)."""
    return replace(flags, prompt_seed=prompt_seed(flags))


def prompt_seed(flags: RunFlags) -> int:
    """``--prompt-seed``, or a new one when none was given."""
    return flags.prompt_seed if flags.prompt_seed is not None else secrets.randbelow(2**31)


def build_workload(
    args: RunFlags, rate: float | None, run: int = 0
) -> tuple[list[wl.RequestSpec], list[wl.RequestSpec]]:
    """(measured requests, warm-up requests) from the workload flags, at ``rate``.

    Arrivals and lengths follow ``--seed`` and are the same for every run; the
    token ids follow ``--prompt-seed`` and the run's index, so no run finds the
    prompts of another in the server's prefix cache.
    """
    prompts = wl.read_jsonl(args.prompts, args.output_len) if args.prompts else None
    sched = wl.flag_schedule(args, rate)
    arrivals, prompt_lens, output_lens = sched.arrival_s, sched.prompt_len, sched.output_len
    if args.trace:
        warm_prompt, warm_output = prompt_lens[: args.warmup], output_lens[: args.warmup]
    else:
        warm_prompt, warm_output = wl.flag_lengths(args, args.warmup, args.seed + 1)
    seed = prompt_seed(args)  # serve_rates draws it once for all its runs
    specs = wl.build_requests(
        arrivals, prompt_lens, output_lens, args.vocab_size, (seed, run, 0), prompts
    )
    warmup = wl.build_requests(
        np.zeros(len(warm_output)),
        warm_prompt,
        warm_output,
        args.vocab_size,
        (seed, run, 1),
        prompts,
    )
    return specs, warmup


# -- runs ---------------------------------------------------------------------------------


def serve_rates(
    args: RunFlags,
    target: str | Callable[[], Awaitable[Client]],
    rates: list[float | None],
    label: str = "",
    first_run: int = 0,
    client_as: tuple[str | None, str | None] = (None, None),
) -> list[RunResult]:
    """Run the workload at each rate in turn against ``target`` (an address, or a
    coroutine function that makes a client); one result per rate. Runs are
    numbered from ``first_run`` (the number picks the prompts' token ids).

    The first run's workload is built before the client connects, so a workload
    flag or trace file it cannot use is named at once, not after reaching the target
    (the runs differ only in rate and token ids; each is built when its turn comes).
    ``client_as``: the API key and model name a client of an address sends.
    """
    args = with_prompt_seed(args)
    slo = slo_from(args)
    options = LoadOptions(args.max_concurrency, args.request_timeout, not args.no_progress)
    first = build_workload(args, rates[0], first_run) if rates else None

    async def sweep() -> list[RunResult]:
        if isinstance(target, str):
            api_key, model = client_as
            client: Client = await open_client(
                target, api_key, model, args.temperature, args.request_timeout
            )
        else:
            client = await target()
        try:
            out = []
            for i, rate in enumerate(rates, start=first_run):
                specs, warmup = first if first and i == first_run else build_workload(args, rate, i)
                name = f"{label} rate {rate:g}" if rate is not None else label or "trace"
                records = await run_load(client, specs, warmup, options, name.strip())
                out.append(RunResult(rate, records, summarize(records, slo)))
            return out
        finally:
            await client.close()

    return asyncio.run(sweep())


def slo_from(args: LoadFlags) -> Slo:
    return Slo(
        None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1e3,
        None if args.tpot_slo_ms is None else args.tpot_slo_ms / 1e3,
    )


def summary_table(rows: list[tuple[str, RunResult]]) -> str:
    """A plain-text table of the runs' main figures."""
    head = (
        f"{'run':<24} {'ok/n':>9} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'attain':>7} {'goodput':>8}"
    )
    lines = [head]
    for label, run in rows:
        s = run.summary
        lines.append(
            f"{label:<24} {s['num_ok']:>4}/{s['num_requests']:<4} {s['throughput_rps']:>7.2f} "
            f"{s['output_tok_s']:>8.1f} {_ms(s['ttft_ms'], 'p50')} {_ms(s['ttft_ms'], 'p99')} "
            f"{_ms(s['tpot_ms'], 'p50')} {_ms(s['tpot_ms'], 'p99')} "
            f"{s['attainment']:>7.1%} {s['goodput_rps']:>8.2f}"
        )
        if s.get("errors"):  # why requests failed, beside the count
            reasons = "; ".join(f"{n} x {why}" for why, n in s["errors"].items())
            lines.append(f"{'':<24} failed: {reasons}")
    return "\n".join(lines)


def _ms(stats: dict[str, float], key: str) -> str:
    return f"{stats[key]:>9.1f}" if key in stats else f"{'-':>9}"


def write_outputs(
    out: Path, name: str, payload: dict[str, Any], series: dict[str, list[RunResult]], slo: Slo
) -> list[Path]:
    """The JSON file, the latency CDFs of every run, and goodput vs rate when swept."""
    paths = [write_json(out / f"{name}.json", payload)]
    cdfs: dict[str, Sequence[RequestRecord]] = {
        f"{label} {run.rate:g}/s" if run.rate is not None else label: run.records
        for label, runs in series.items()
        for run in runs
    }
    paths.append(plot_latency_cdfs(cdfs, slo, out / f"{name}-latency-cdf.png"))
    swept: dict[str, Sequence[tuple[float, dict[str, Any]]]] = {
        label: [(run.rate, run.summary) for run in runs if run.rate is not None]
        for label, runs in series.items()
    }
    if any(len(points) > 1 for points in swept.values()):
        paths.append(plot_goodput_vs_rate(swept, out / f"{name}-goodput.png"))
    return paths


_NOT_FLAGS = {"prog"}  # the command itself, which the command line records
REDACTED = "<redacted>"


def options_json(options: object) -> dict[str, Any]:
    """The options of a run (a dataclass of a command's options, its groups' fields in
    their place), for its result file (an API key is not written out)."""
    out = {k: v for k, v in flat_options(options).items() if k not in _NOT_FLAGS}
    if out.get("api_key"):
        out["api_key"] = REDACTED
    return out


def command_line(prog: str, options: object) -> str:
    """The command as typed when run from the shell; otherwise (called in-process) an
    equivalent one that spells out every option (``prog``: the command, ``options``:
    a dataclass of its options)."""
    if Path(sys.argv[0]).name == "pdserve":
        words = ["pdserve", *sys.argv[1:]]
        for i, word in enumerate(words):
            if word.startswith("--api-key="):
                words[i] = f"--api-key={REDACTED}"
            elif word == "--api-key" and i + 1 < len(words):
                words[i + 1] = REDACTED
        return shlex.join(words)
    words = prog.split()
    for key, value in options_json(options).items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def check_load_flags(args: RunFlags) -> None:
    """The load and workload flags a run cannot start with, named before anything starts."""
    slo_from(args)
    if args.warmup < 0:
        raise InvalidArgumentError("warmup", f"must be >= 0, got {args.warmup}")
    for name in ("seed", "prompt_seed"):  # numpy's generators take no negative seed
        if (getattr(args, name) or 0) < 0:
            raise InvalidArgumentError(name, f"must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.temperature < math.inf:
        raise InvalidArgumentError("temperature", f"must be >= 0, got {args.temperature}")
    if args.vocab_size <= wl.FIRST_TOKEN_ID:
        raise InvalidArgumentError(
            "vocab_size", f"must be > {wl.FIRST_TOKEN_ID}, got {args.vocab_size}"
        )
    LoadOptions(args.max_concurrency, args.request_timeout)


def run(args: argparse.Namespace) -> int:
    return serve(options_from(ServeOptions, args))


def serve(options: ServeOptions) -> int:
    """``pdserve bench serve``: the runs, their result file and plots, and a table."""
    check_load_flags(options.run)
    options = replace(options, run=with_prompt_seed(options.run))
    rates: list[float | None] = list(options.rate) if options.rate else [None]
    runs = serve_rates(
        options.run, options.target, rates, client_as=(options.api_key, options.model)
    )
    payload = {
        **header(command_line(options.prog, options)),
        "target": options.target,
        "options": options_json(options),
        "runs": [r.to_json() for r in runs],
    }
    slo = slo_from(options.run)
    paths = write_outputs(Path(options.out), options.name, payload, {"": runs}, slo)
    print(summary_table([(f"rate {r.rate:g}" if r.rate else "trace", r) for r in runs]))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


# -- flags ----------------------------------------------------------------------------------


def add_workload_flags(
    p: argparse.ArgumentParser, prompt_len: int = 512, output_len: int = 32
) -> None:
    """The workload: when requests arrive (or a trace or prompts file), their lengths, how
    many are sent and the seeds."""
    g = p.add_argument_group("workload")
    _add_arrival_flags(g)
    _add_length_flags(g, prompt_len, output_len)
    _add_count_flags(g)


def _add_arrival_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--arrival", choices=wl.ARRIVALS, default="poisson")
    g.add_argument("--burst-size", type=int, default=8, help="requests per burst (--arrival burst)")
    g.add_argument(
        "--trace",
        default=None,
        help="replay a CSV trace (TIMESTAMP, ContextTokens, GeneratedTokens) or a shipped one: "
        + ", ".join(wl.SHIPPED_TRACES),
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="trace arrival offsets are multiplied by this (0.5: twice as fast)",
    )
    g.add_argument(
        "--length-scale", type=float, default=1.0, help="trace lengths are multiplied by this"
    )
    g.add_argument(
        "--prompts", default=None, help='JSONL file of {"prompt": text or ids, "max_tokens": n}'
    )


def _add_length_flags(g: argparse._ArgumentGroup, prompt_len: int, output_len: int) -> None:
    g.add_argument("--prompt-len", type=int, default=prompt_len)
    g.add_argument(
        "--prompt-len-std", type=float, default=0.0, help="normal spread of prompt lengths"
    )
    g.add_argument(
        "--prompt-len-range",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="uniform prompt lengths in [LO, HI] (instead of --prompt-len)",
    )
    g.add_argument("--output-len", type=int, default=output_len)
    g.add_argument("--output-len-std", type=float, default=0.0)
    g.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    g.add_argument("--max-prompt-len", type=int, default=None, help="clamp prompt lengths")
    g.add_argument("--max-output-len", type=int, default=None, help="clamp output lengths")
    g.add_argument(
        "--vocab-size", type=int, default=256, help="synthetic prompt ids are in [3, this)"
    )


def _add_count_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"measured requests per rate (default {wl.DEFAULT_NUM_REQUESTS} unless --duration)",
    )
    g.add_argument(
        "--duration", type=float, default=None, help="send for this many seconds per rate"
    )
    g.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured")
    g.add_argument("--seed", type=int, default=0, help="seeds arrivals and lengths")
    g.add_argument(
        "--prompt-seed",
        type=int,
        default=None,
        help="seeds synthetic token ids (default: new each invocation, recorded)",
    )
    g.add_argument("--temperature", type=float, default=0.0)


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """SLOs, the most requests in flight and how long one may take (the simulator
    honours both: ``sim/gate.py``, ``sim/timeouts.py``)."""
    g = p.add_argument_group("load and SLOs")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds from sending a request to giving up on it (it fails and is "
        "aborted); inf: never",
    )
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    g.add_argument("--tpot-slo-ms", type=float, default=200.0)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="grpc://HOST:PORT or http://HOST:PORT")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer <key>'")
    p.add_argument("--model", default=None, help="model name (default: ask the server)")
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=None,
        help="mean request rate(s) in req/s; several: a sweep (inf: all at once)",
    )
    add_workload_flags(p)
    add_load_flags(p)
    p.add_argument("--out", default="bench/out/serve", help="output folder")
    p.add_argument("--name", type=file_stem, default="serve", help="output file stem")
    p.set_defaults(func=run, prog="pdserve bench serve")
