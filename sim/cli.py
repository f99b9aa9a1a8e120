"""``pdserve profile``, ``pdserve sim`` and ``pdserve plan``: flags and handlers.

    pdserve profile --config cluster.yaml --out profile.json         # a cluster as it serves
    pdserve profile --model builtin:tiny --out profile.json          # its steps alone
    pdserve profile --model llama-7b --device h100 --tp 1 --out h100.json   # analytic
    pdserve sim --config cluster.yaml --profile profile.json --rate 2 4 --num-requests 200
    pdserve sim --config fleet.yaml --device h100 --trace azure-conv --rate 50
    pdserve plan --model llama-7b --device h100 --rate east=20 --ttft-slo-ms 1000 --tpot-slo-ms 50

``pdserve sim`` takes the workload and SLO flags of ``pdserve bench serve`` and
writes the same JSON (per-rate ``summary`` and ``requests``) and plots, so a
simulated and a measured run of one command line compare key by key.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.flags import file_stem
from pdserve.bench.serve import RunFlags
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from
from pdserve.sim.flags import DeviceFlags, add_device_flags, add_host_flag, assumptions_from
from pdserve.sim.options import calibrated_options

if TYPE_CHECKING:
    from pdserve.bench.report import Slo
    from pdserve.bench.serve import RunResult

RECORDS_LIMIT = 100_000  # runs up to this many requests keep per-request records and ITL


@dataclass(frozen=True)
class ProfileFlags:
    """``pdserve profile``'s options, in the order of its flags."""

    model: str = "builtin:tiny"  # builtin:<name>, a folder, or a preset
    tensor_parallel_size: int = 1  # ranks of a tensor-parallel instance
    pipeline_parallel_size: int = 1  # pipeline stages of an instance
    dtype: str | None = None  # of a measured profile (None: float32)
    block_size: int = 16  # KV block size, tokens
    repeats: int = 3  # timed runs per measured step
    grid: str = "cpu"  # the shapes a measured profile times: cpu or gpu
    load_format: str = "safetensors"  # dummy: random weights from config.json alone
    out: str = "profile.json"  # the profile file written
    analytic: DeviceFlags = field(default_factory=DeviceFlags)  # an analytic profile's flags
    config: str | None = None  # calibrate on this config's cluster (pdserve.sim.calibrate_cluster)
    ray_address: str | None = None  # where that cluster runs (None: started here for it)
    api_key: str | None = None  # the calibration's key (None: the config's)
    calibration_requests: int = 8  # requests of each calibration run
    seed: int = 0  # of the calibration runs' prompts
    role_fit: bool = True  # fit each role's steps on their own
    prog: str = "pdserve profile"  # the command, for the record


@dataclass(frozen=True)
class SimFlags:
    """``pdserve sim``'s options, in the order of its flags."""

    config: str  # the cluster YAML
    profile: list[str] = field(default_factory=list)  # profile files, one per layout
    rate: list[float] | None = None  # mean request rate(s); several: a sweep
    region_share: list[str] | None = None  # REGION=SHARE of requests' homes (None: even)
    full: bool = False  # step every instance step by step (no fast mode)
    startup_s: float = 30.0  # seconds for an added instance to start
    out: str = "bench/out/sim"  # output folder
    name: str = "sim"  # output file stem
    no_plots: bool = False  # the JSON file alone
    noise_draws: int = 1  # draws of a calibrated profile's noise (0: none)
    analytic: DeviceFlags = field(default_factory=DeviceFlags)  # an analytic profile's flags
    host_cores: float = 0.0  # the instances share a host of this many cores (0: no)
    workers: int = 1  # worker processes the fleet is sharded over (1: this process)
    run: RunFlags = field(default_factory=RunFlags)  # bench serve's workload and load flags
    prog: str = "pdserve sim"  # the command, for the record


def add_parsers(sub: argparse._SubParsersAction) -> None:
    _add_profile(sub)
    _add_sim(sub)
    from pdserve.sim.afd import add_parser as add_afd_parser
    from pdserve.sim.plan_cli import add_plan_parser
    from pdserve.sim.replay_cli import add_parser as add_replay_parser
    from pdserve.sim.reproduce import add_parser as add_reproduce_parser
    from pdserve.sim.validate import add_parser as add_validate_parser

    add_plan_parser(sub)
    add_replay_parser(sub)
    add_validate_parser(sub)
    add_afd_parser(sub)
    add_reproduce_parser(sub)


# -- pdserve profile --------------------------------------------------------------------


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure (or derive) an instance's latency model")
    p.add_argument("--model", default="builtin:tiny", help="builtin:<name>, a folder, or a preset")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="of a measured profile (default float32); an analytic one is its "
        "device's (bfloat16 on a GPU)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measured step")
    p.add_argument(
        "--grid",
        choices=["cpu", "gpu"],
        default="cpu",
        help="the shapes a measured profile times (gpu: longer prompts, bigger batches)",
    )
    p.add_argument(
        "--load-format",
        choices=["safetensors", "dummy"],
        default="safetensors",
        help="dummy: random weights from the folder's config.json alone",
    )
    p.add_argument("--out", default="profile.json")
    add_device_flags(p)
    _add_calibration_flags(p)
    p.set_defaults(func=cmd_profile, prog="pdserve profile")


def _add_calibration_flags(p: argparse.ArgumentParser) -> None:
    """``pdserve profile --config``: a profile calibrated on a cluster as it serves."""
    c = p.add_argument_group(
        "calibrated on a cluster (pdserve.sim.calibrate_cluster: what a served request pays "
        "beyond its steps; the profile pdserve sim should be given)"
    )
    c.add_argument(
        "--config",
        default=None,
        help="calibrate on the cluster of this config file (its model and layouts; "
        "--model and the layout flags are not used): started here for the calibration, "
        "or the one running at --ray-address",
    )
    c.add_argument(
        "--ray-address",
        default=None,
        help="with --config: the Ray cluster on which pdserve serves CONFIG now "
        "(e.g. auto); it should serve nothing else meanwhile",
    )
    c.add_argument("--api-key", default=None, help="with --config (default: the config's)")
    c.add_argument(
        "--calibration-requests",
        type=int,
        default=8,
        help="requests of each calibration run (about 2 minutes at 8 on a small model)",
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--role-fit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit each role's steps on their own, beside the other role's "
        "(--no-role-fit: one fit of every instance's steps)",
    )


def cmd_profile(args: argparse.Namespace) -> int:
    return profile_command(options_from(ProfileFlags, args))


def profile_command(args: ProfileFlags) -> int:
    """A measured, calibrated (``--config``) or analytic (``--device``) profile written
    and described."""
    from pdserve.bench.serve import command_line
    from pdserve.sim.analytic import DEVICES, analytic_profile, model_shape
    from pdserve.sim.profile import save_profile

    command = command_line(args.prog, args)
    if args.config is not None:
        return calibrate_profile(args, command)
    if args.ray_address is not None:
        raise InvalidArgumentError("ray_address", "is where a --config cluster runs")
    if args.block_size < 1:
        raise InvalidArgumentError("block_size", f"must be at least 1, got {args.block_size}")
    device = args.analytic.device
    if device is not None:
        own = DEVICES[device].dtype  # the datasheet's peak is for this type
        if args.dtype not in (None, "auto", own):
            raise InvalidArgumentError(
                "dtype", f"an analytic {device} profile is {own}, not {args.dtype}"
            )
        shape = model_shape(args.model)
        profile = analytic_profile(
            shape,
            device,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            assumptions_from(args.analytic, args.model),
            command,
        )
    else:
        profile = _measured_profile(args, command)
    path = save_profile(profile, args.out)
    print(describe_profile(profile))
    print(f"wrote {path}")
    return 0


def _measured_profile(args: ProfileFlags, command: str) -> Any:
    """The steps of ``args.model``'s engine timed here over the grid, and fitted."""
    from dataclasses import replace

    from pdserve.bench.report import machine_info
    from pdserve.core.config import build_engine_config
    from pdserve.sim.measure import GRIDS, measured_profile

    config = build_engine_config(
        args.model,
        dtype=args.dtype or "float32",
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        load_format=args.load_format,
        max_num_seqs=max(GRIDS[args.grid].decode_batch),
    )
    grid = replace(GRIDS[args.grid], repeats=args.repeats)
    return measured_profile(config, grid, command, machine_info())


def calibrate_profile(args: ProfileFlags, command: str) -> int:
    """``pdserve profile --config CONFIG``: the profile of the config's cluster as
    it serves (:mod:`pdserve.sim.calibrate_cluster`)."""
    from pdserve.sim.calibrate_cluster import (
        ClusterCalibration,
        calibrate_cluster,
        describe_calibration,
    )
    from pdserve.sim.profile import save_profile

    if args.analytic.device is not None:
        raise InvalidArgumentError("device", "an analytic profile is not calibrated on a cluster")
    assert args.config is not None
    opts = ClusterCalibration(
        args.config,
        args.ray_address,
        args.api_key,
        args.calibration_requests,
        args.seed,
        args.role_fit,
    )
    calibrated = calibrate_cluster(opts, command)
    path = save_profile(calibrated.profile, args.out)
    print(describe_profile(calibrated.profile))
    print(describe_calibration(calibrated))
    print(f"wrote {path} (pdserve sim --config {args.config} --profile {path} ...)")
    return 0


def describe_profile(p: Any) -> str:
    s = p.step
    lines = [
        f"{p.model.name} tp={p.tensor_parallel_size} pp={p.pipeline_parallel_size} on {p.device} "
        f"({p.source}); KV {p.kv_bytes_per_token} B/token, {p.kv_capacity_tokens} tokens",
        f"step = {s.overhead_s * 1e3:.3f} ms + {s.s_per_seq * 1e6:.2f} us/seq + "
        f"{s.combine}(compute {s.s_per_token * 1e6:.3f} us/token + {s.s_per_attn * 1e9:.3f} ns/pair, "
        f"memory {s.weights_s * 1e3:.3f} ms + {s.s_per_ctx * 1e9:.3f} ns/context token)",
    ]
    for name, t in sorted(p.connectors.items()):
        lines.append(
            f"transfer {name}: {t.latency_s * 1e6:.1f} us + {t.bytes_per_s / 1e9:.2f} GB/s"
        )
    if p.fit_error:
        lines.append(
            "fit error (relative): " + ", ".join(f"{k} {v:.3g}" for k, v in p.fit_error.items())
        )
    return "\n".join(lines)


# -- pdserve sim --------------------------------------------------------------------------


def _add_sim(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench.serve import add_load_flags, add_workload_flags

    p = sub.add_parser("sim", help="simulate a cluster YAML under a workload, in virtual time")
    p.add_argument("--config", required=True, help="the cluster YAML that `pdserve serve` takes")
    p.add_argument(
        "--profile", action="append", default=[], help="profile file (repeatable: one per layout)"
    )
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=None,
        help="mean request rate(s) in req/s; several: a sweep",
    )
    p.add_argument(
        "--region-share",
        nargs="+",
        default=None,
        metavar="REGION=SHARE",
        help="share of requests whose home is each region (default: even)",
    )
    p.add_argument(
        "--full", action="store_true", help="step every instance step by step (no fast mode)"
    )
    p.add_argument(
        "--startup-s", type=float, default=30.0, help="seconds for an added instance to start"
    )
    p.add_argument("--out", default="bench/out/sim", help="output folder")
    p.add_argument("--name", type=file_stem, default="sim", help="output file stem")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--noise-draws",
        type=int,
        default=1,
        metavar="N",
        help="a calibrated profile's noise (pdserve sim-validate --write-profiles): "
        "simulate N draws of it and give TTFT and TPOT p50 and p90 as their "
        "mean, the rest of a rate's figures and its records the first draw's "
        "(0: no noise, the model's mean times)",
    )
    _add_workers_flag(p)
    add_device_flags(p)
    add_host_flag(p)
    add_workload_flags(p)
    add_load_flags(p)
    p.set_defaults(func=cmd_sim, prog="pdserve sim")


def _add_workers_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="shard the fleet over N worker processes (by region, large regions by "
        "instance group; pdserve.sim.sharded); 1: simulate in this process",
    )


def region_shares(names: list[str], given: list[str] | None) -> list[float]:
    if not given:
        return [1.0] * len(names)
    shares = dict.fromkeys(names, 0.0)
    for item in given:
        name, _, value = item.partition("=")
        if name not in shares:
            raise InvalidArgumentError("region_share", f"unknown region {name!r}; known: {names}")
        try:
            shares[name] = float(value)
        except ValueError:
            raise InvalidArgumentError("region_share", f"{item!r} is not REGION=NUMBER") from None
    return [shares[n] for n in names]


def _max_rss_mib() -> float:
    """The peak resident memory of this process or of its largest worker, MiB."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


def _cpu_s() -> float:
    """CPU seconds of this process and of its ended workers."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def check_workers(args: SimFlags) -> None:
    """``--workers``: at least 1, and only with what a sharded run can split."""
    if args.workers < 1:
        raise InvalidArgumentError("workers", f"--workers must be at least 1, got {args.workers}")
    if args.workers == 1:
        return
    shared = {
        "max_concurrency": args.run.max_concurrency is not None,
        "host_cores": args.host_cores > 0,
    }
    for name, given in shared.items():
        if given:
            raise InvalidArgumentError(
                "workers",
                f"a sharded run (--workers {args.workers}) does not take --"
                f"{name.replace('_', '-')}: simulate it with --workers 1",
            )


def _write_sim_outputs(
    args: SimFlags, payload: dict[str, Any], runs: list[RunResult], slo: Slo
) -> list[Path]:
    """The JSON of a ``pdserve sim`` run under ``--out`` and, unless ``--no-plots``,
    bench serve's plots and the last rate's instance counts over virtual time."""
    from pdserve.bench.serve import write_outputs
    from pdserve.sim.report import plot_instance_counts

    out = Path(args.out)
    if args.no_plots:
        from pdserve.bench.report import write_json

        return [write_json(out / f"{args.name}.json", payload)]
    paths = write_outputs(out, args.name, payload, {"sim": runs}, slo)
    paths.append(
        plot_instance_counts(
            payload["runs"][-1]["instances_over_time"], out / f"{args.name}-instances.png"
        )
    )
    return paths


def quiet(profile: Any) -> Any:
    """``profile`` without its steps' and requests' noise (``--noise-draws 0``)."""
    import dataclasses

    def still(s: Any) -> Any:
        return dataclasses.replace(s, jitter=0.0, jitter_s=0.0)

    return dataclasses.replace(
        profile,
        step=still(profile.step),
        request_jitter=0.0,
        role_steps={r: still(s) for r, s in profile.role_steps.items()},
    )


def noise_draws(args: SimFlags, profiles: list[Any]) -> int:
    """How many runs ``--noise-draws`` asks for: one where no profile carries noise
    (every draw would be the same run), with a note saying so."""
    if args.noise_draws > 1 and all(quiet(p) == p for p in profiles):
        print(
            f"note: --noise-draws {args.noise_draws}: no profile carries noise "
            "(only calibrated ones do), so one run gives them all",
            file=sys.stderr,
        )
        return 1
    return max(1, args.noise_draws)


def _run(args: SimFlags, config: Any, book: Any, work: Any, options: Any, seed: int) -> Any:
    """One draw's run: in this process, or sharded over ``--workers`` processes."""
    import dataclasses

    from pdserve.sim.cluster import SimCluster
    from pdserve.sim.sharded import run_sharded

    seeded = dataclasses.replace(options, noise_seed=seed)
    if args.workers == 1:
        return SimCluster(config, book, work, seeded).run()
    if options.one_host:
        raise InvalidArgumentError(
            "workers", "calibrated profiles put every instance on one host: use --workers 1"
        )
    return run_sharded(config, book, work, seeded, args.workers)


def _simulate_rate(
    args: SimFlags,
    config: Any,
    book: Any,
    profiles: list[Any],
    rate: float | None,
    shares: list[float],
    slo: Slo,
    draws: int,
) -> tuple[dict[str, Any], RunResult]:
    """One rate's JSON entry and result: ``draws`` runs, one per draw of the
    noise, TTFT and TPOT p50 and p90 their mean, the rest the first draw's."""

    from pdserve.bench.serve import RunResult
    from pdserve.sim.calibrate import averaged
    from pdserve.sim.cluster import SimOptions
    from pdserve.sim.report import run_json
    from pdserve.sim.workload import workload_from_args

    work = workload_from_args(args.run, rate, shares)
    options = SimOptions(
        not args.full,
        len(work) <= RECORDS_LIMIT,
        args.startup_s,
        host_cores=args.host_cores,
        max_concurrency=args.run.max_concurrency,
        request_timeout_s=args.run.request_timeout,
        **calibrated_options(profiles),
    )
    start, cpu = time.perf_counter(), _cpu_s()
    runs = [_run(args, config, book, work, options, seed) for seed in range(draws)]
    wall, cpu, rss = time.perf_counter() - start, _cpu_s() - cpu, _max_rss_mib()
    records = runs[0].recorder.records() if len(work) <= RECORDS_LIMIT else []
    entry = run_json(runs[0], rate, slo, wall, "full" if args.full else "fast", records)
    if len(runs) > 1:
        summaries = [entry["summary"], *(r.recorder.summary(slo) for r in runs[1:])]
        entry["summary"] = {**averaged(summaries), "noise_draws": len(runs)}
    entry["sim"].update(cpu_s=round(cpu, 3), max_rss_mib=round(rss, 1), draws=len(runs))
    return entry, RunResult(rate, records, entry["summary"])


def describe_shards(shards: dict[str, Any]) -> str:
    """A sharded run's workers, their CPU seconds, and its critical path."""
    cpu = ", ".join(
        f"{'+'.join(w['cells'])} {w['arrivals']} arrivals {w['cpu_s']:.1f} s"
        for w in shards["workers"]
    )
    window = "" if shards["window_s"] is None else f" of {shards['window_s'] * 1e3:g} ms"
    return (
        f"workers: {cpu}; {shards['windows']} windows{window}, "
        f"coordinator {shards['coordinator_cpu_s']:.1f} s CPU; critical path "
        f"{shards['critical_path_cpu_s']:.1f} CPU-s (the wall time with a core per worker)"
    )


def cmd_sim(args: argparse.Namespace) -> int:
    return sim_command(options_from(SimFlags, args))


def sim_command(args: SimFlags) -> int:
    """The cluster simulated at each rate; bench serve's JSON and plots written."""
    from pdserve.bench.report import header
    from pdserve.bench.serve import (
        check_load_flags,
        command_line,
        options_json,
        slo_from,
        summary_table,
    )
    from pdserve.cluster.config import load_config
    from pdserve.sim.build import book_for
    from pdserve.sim.profile import load_profile

    check_load_flags(args.run)
    check_workers(args)
    if args.noise_draws < 0:
        raise InvalidArgumentError("noise_draws", f"must be at least 0, got {args.noise_draws}")
    config = load_config(args.config)
    profiles = [load_profile(p) for p in args.profile]
    if args.noise_draws == 0:
        profiles = [quiet(p) for p in profiles]
    book = book_for(config, profiles, args.analytic.device, assumptions_from(args.analytic, None))
    shares = region_shares([r.name for r in config.regions], args.region_share)
    slo, draws = slo_from(args.run), noise_draws(args, profiles)
    done = [
        _simulate_rate(args, config, book, profiles, rate, shares, slo, draws)
        for rate in (list(args.rate) if args.rate else [None])
    ]
    entries, runs = [e for e, _ in done], [r for _, r in done]
    payload = {
        **header(command_line(args.prog, args)),
        "config": str(args.config),
        "options": options_json(args),
        "runs": entries,
    }
    paths = _write_sim_outputs(args, payload, runs, slo)
    print(summary_table([(f"rate {r.rate:g}" if r.rate else "trace", r) for r in runs]))
    for e in entries:
        s = e["sim"]
        drawn = f", {s['draws']} draws of the noise" if s["draws"] > 1 else ""
        print(
            f"simulated {s['requests']} requests, {s['virtual_s']:.1f} s of virtual time in "
            f"{s['wall_s']:.2f} s wall, {s['cpu_s']:.2f} s CPU ({s['mode']} mode, "
            f"{s['events']} events{drawn}, peak RSS {s['max_rss_mib']:.0f} MiB)"
        )
        if "shards" in s:
            print(describe_shards(s["shards"]))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
