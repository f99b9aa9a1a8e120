"""``pdserve plan``: flags, the forecast and length mix, and the printed plan.

    pdserve plan --model llama-7b --device h100 --rate east=20 west=5,12,30 \\
        --prompt-len 1000 --output-len 256 --ttft-slo-ms 1000 --tpot-slo-ms 50

A region's forecast is one rate or rates over the day (comma-separated, or a
JSON file ``{"east": [r0, r1, ...]}``); the plan covers the peak. The length
mix is ``--prompt-len``/``--output-len`` (with spreads) or a trace's lengths.
``--layout both`` (the default) plans each region disaggregated and colocated,
prints the two side by side and recommends the cheaper (fewer devices; at a tie,
the higher SLO attainment); ``--out``'s cluster YAML is the recommended plan's.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import workload as wl
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from
from pdserve.sim.flags import DeviceFlags
from pdserve.sim.plan import (
    LengthMix,
    PlanLimits,
    PlanSlo,
    RegionPlan,
    cluster_yaml,
    open_pool,
)
from pdserve.sim.plan_choice import LayoutChoice, choose_regions, layouts_from

LIMITS = PlanLimits()  # the limits' defaults, which the flags' are


@dataclass(frozen=True)
class LengthMixFlags:
    """The length-mix flags of ``pdserve plan``."""

    prompt_len: int = 1000  # mean prompt length (tokens)
    prompt_len_std: float = 0.0  # normal spread of prompt lengths
    output_len: int = 256  # mean output length (tokens)
    output_len_std: float = 0.0  # normal spread of output lengths
    trace: str | None = None  # take the lengths of a trace (CSV or shipped name)
    length_scale: float = 1.0  # a trace's lengths are multiplied by this
    max_prompt_len: int | None = None  # clamp prompt lengths
    max_output_len: int | None = None  # clamp output lengths


@dataclass(frozen=True, kw_only=True)
class PlanFlags:
    """``pdserve plan``'s options, in the order of its flags."""

    model: str  # a preset (llama-7b ...) or a loadable model
    profile: list[str] = field(default_factory=list)  # profile files
    rate: list[str] = field(default_factory=list)  # REGION=R[,R...] forecasts
    forecast: str | None = None  # a JSON file {"region": [rates]}
    mix: LengthMixFlags = field(default_factory=LengthMixFlags)  # the length mix
    ttft_slo_ms: float = 1000.0  # TTFT SLO
    tpot_slo_ms: float = 50.0  # TPOT SLO
    percentile: float = 90.0  # the SLOs hold at this percentile
    max_devices: int = LIMITS.max_devices  # devices per region
    prefill_tp: list[int] = field(default_factory=lambda: list(LIMITS.prefill_tp))  # TP sizes
    decode_tp: list[int] = field(default_factory=lambda: list(LIMITS.decode_tp))  # TP sizes
    headroom: float = LIMITS.headroom  # planned load over the forecast (0.3: +30%)
    spares: int = LIMITS.spares  # spare instances per role (N+1)
    num_requests: int | None = LIMITS.num_requests  # simulated per candidate (None: enough)
    max_num_seqs: int = LIMITS.max_num_seqs  # engine option of every instance
    max_num_batched_tokens: int = LIMITS.max_num_batched_tokens  # engine option, likewise
    seed: int = 0  # seeds the simulations and the length mix
    layout: str = "both"  # colocated, disaggregated, or both compared
    out: str | None = None  # write the plan (JSON, with each region's YAML)
    jobs: int = field(default_factory=lambda: default_jobs())  # candidates simulated at once
    analytic: DeviceFlags = field(default_factory=DeviceFlags)  # an analytic profile's flags
    check: bool = False  # serve the recommended plan here and measure its attainment
    check_requests: int = 100  # requests the check sends


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve.sim.flags import add_device_flags

    p = sub.add_parser("plan", help="cheapest P:D counts and layouts per region for a forecast")
    p.add_argument("--model", required=True, help="a preset (llama-7b ...) or a loadable model")
    p.add_argument("--profile", action="append", default=[], help="profile file (repeatable)")
    p.add_argument(
        "--rate",
        nargs="+",
        default=[],
        metavar="REGION=R[,R...]",
        help="forecast req/s per region: one rate or rates over the day",
    )
    p.add_argument("--forecast", default=None, help='JSON file {"region": [rates]}')
    _add_length_mix_flags(p)
    _add_slo_and_limit_flags(p)
    p.add_argument(
        "--layout",
        choices=("colocated", "disaggregated", "both"),
        default="both",
        help="plan colocated instances (each prefilling its own prompts), disaggregated "
        "prefill and decode instances, or both side by side and recommend the cheaper",
    )
    p.add_argument("--out", default=None, help="write the plan (JSON, with each region's YAML)")
    p.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help="candidates simulated side by side, one worker process each (default: this "
        "machine's cores, at most 8); the plan is the same for any count",
    )
    add_device_flags(p)
    c = p.add_argument_group("the plan served here (pdserve.sim.plan_check)")
    c.add_argument(
        "--check",
        action="store_true",
        help="serve the recommended plan of a one-region forecast on this machine, load it "
        "at the forecast with the length mix, and print its SLO attainment beside the "
        "promised one (needs a profile of this machine: pdserve profile --config)",
    )
    c.add_argument("--check-requests", type=int, default=100, help="requests the check sends")
    p.set_defaults(func=cmd_plan, prog="pdserve plan")


def _add_length_mix_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("length mix")
    g.add_argument("--prompt-len", type=int, default=1000)
    g.add_argument("--prompt-len-std", type=float, default=0.0)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--output-len-std", type=float, default=0.0)
    g.add_argument(
        "--trace", default=None, help="take the lengths of a trace (CSV or shipped name)"
    )
    g.add_argument("--length-scale", type=float, default=1.0)
    g.add_argument("--max-prompt-len", type=int, default=None)
    g.add_argument("--max-output-len", type=int, default=None)


def _add_slo_and_limit_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("SLOs and limits")
    s.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    s.add_argument("--tpot-slo-ms", type=float, default=50.0)
    s.add_argument(
        "--percentile", type=float, default=90.0, help="the SLOs hold at this percentile"
    )
    d = LIMITS
    s.add_argument("--max-devices", type=int, default=d.max_devices, help="devices per region")
    s.add_argument("--prefill-tp", type=int, nargs="+", default=list(d.prefill_tp))
    s.add_argument("--decode-tp", type=int, nargs="+", default=list(d.decode_tp))
    s.add_argument("--headroom", type=float, default=d.headroom, help="0.3: plan for +30%% load")
    s.add_argument("--spares", type=int, default=d.spares, help="spare instances per role (N+1)")
    s.add_argument(
        "--num-requests",
        type=int,
        default=d.num_requests,
        help="simulated per candidate (default: enough to span ten times a request's latency "
        "or the TTFT SLO, at least 1500)",
    )
    s.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    s.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    s.add_argument("--seed", type=int, default=0)


MAX_DEFAULT_JOBS = 8


def default_jobs() -> int:
    """This machine's cores (as this process may use them), at most 8."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_DEFAULT_JOBS, cores or 1))


def forecast_from(args: PlanFlags) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    if args.forecast:
        try:
            raw = json.loads(Path(args.forecast).read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgumentError("forecast", f"{args.forecast}: {e}") from None
        if not isinstance(raw, dict):
            raise InvalidArgumentError("forecast", 'must be a JSON object {"region": [rates]}')
        for name, rates in raw.items():
            values = rates if isinstance(rates, list) else [rates]
            out[str(name)] = _rates("forecast", f"{args.forecast}: {name!r}", values)
    for item in args.rate:
        name, sep, given = item.partition("=")
        if not sep or not name:
            raise InvalidArgumentError("rate", f"{item!r} is not REGION=RATE[,RATE...]")
        out[name] = _rates("rate", repr(item), given.split(","))
    if not out:
        raise InvalidArgumentError("rate", "give a forecast: --rate REGION=RATE or --forecast FILE")
    return out


def _rates(field: str, where: str, values: list[Any]) -> list[float]:
    """A region's forecast: req/s over the day, each a number >= 0, not all 0."""
    try:
        rates = [float(v) for v in values]
    except (TypeError, ValueError):
        raise InvalidArgumentError(field, f"{where}: rates must be numbers") from None
    if not rates or not all(0 <= r < math.inf for r in rates) or not max(rates) > 0:
        raise InvalidArgumentError(field, f"{where}: rates must be >= 0 and not all 0, got {rates}")
    return rates


def mix_from(args: LengthMixFlags, seed: int) -> LengthMix:
    if args.trace:
        t = wl.scale_trace(
            wl.read_trace(wl.trace_path(args.trace)),
            1.0,
            args.length_scale,
            args.max_prompt_len,
            args.max_output_len,
        )
        return LengthMix(t.prompt_len, t.output_len)
    n = 4096
    prompt = wl.sample_lengths(
        n,
        args.prompt_len,
        args.prompt_len_std,
        high=args.max_prompt_len,
        seed=seed,
        name="prompt_len",
    )
    output = wl.sample_lengths(
        n,
        args.output_len,
        args.output_len_std,
        high=args.max_output_len,
        seed=seed + 1,
        name="output_len",
    )
    return LengthMix(prompt, output)


def cmd_plan(args: argparse.Namespace) -> int:
    return plan_command(options_from(PlanFlags, args))


def plan_command(args: PlanFlags) -> int:
    """The cheapest plan of each region, printed (and written with ``--out``)."""
    from pdserve.sim.analytic import DEVICES, model_shape
    from pdserve.sim.build import ProfileBook
    from pdserve.sim.flags import assumptions_from
    from pdserve.sim.profile import load_profile

    profiles = [load_profile(p) for p in args.profile]
    shape = (
        profiles[0].model
        if profiles and args.model == profiles[0].model.name
        else model_shape(args.model)
    )
    analytic = args.analytic
    book = ProfileBook(shape, profiles, analytic.device, assumptions_from(analytic, args.model))
    slo = PlanSlo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3, args.percentile)
    limits = PlanLimits(
        args.max_devices,
        tuple(args.prefill_tp),
        tuple(args.decode_tp),
        args.headroom,
        args.spares,
        args.num_requests,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        seed=args.seed,
    )
    device = analytic.device or (profiles[0].device if profiles else "cpu")
    peak_bw = DEVICES[device].mem_bw if device in DEVICES else float("nan")
    mix = mix_from(args.mix, args.seed)
    mix.check_context(shape.max_position_embeddings)
    peaks = {region: max(rates) for region, rates in forecast_from(args).items()}
    layouts = layouts_from(args.layout)
    with open_pool(args.jobs) as pool:
        choices = choose_regions(book, peaks, mix, limits, slo, peak_bw, pool, layouts)
    for choice in choices:
        if len(choice.plans) > 1:
            print(describe_choice(choice, slo))
        print(describe_plan(choice.chosen, slo, mix))
    payload: dict[str, Any] = {
        "model": shape.name,
        "device": device,
        "regions": [choice_json(c, shape.name, limits, slo) for c in choices],
    }
    if args.check:
        payload["check"] = served_check(payload, args, profiles)
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}")
    return 0


def served_check(payload: dict[str, Any], args: PlanFlags, profiles: list[Any]) -> dict[str, Any]:
    """``--check``: the recommended plan served here against its promise, printed; as JSON."""
    from pdserve.sim.plan_check import check_plan, checkable

    entry = checkable(payload, args.analytic.device, profiles)
    checked = check_plan(entry, args, profiles[0].dtype if profiles else "float32")
    print(checked.line())
    return {
        "promised": checked.promised,
        "measured": checked.measured,
        "kept": checked.kept,
        "summary": checked.summary,
    }


def describe_choice(c: LayoutChoice, slo: PlanSlo) -> str:
    """The layouts of one region side by side, and the recommendation."""
    q = f"p{slo.percentile:g}"
    lines = [
        f"== region {c.region}: layouts compared at {c.chosen.rate:g} req/s (SLO {q} TTFT "
        f"{slo.ttft_s * 1e3:g} ms, TPOT {slo.tpot_s * 1e3:g} ms)",
        f"  {'layout':<14}{'plan':<26}{'devices':>8}{'goodput/device':>17}{'SLO attainment':>16}",
    ]
    for layout, p in c.plans.items():
        if isinstance(p, RegionPlan):
            o = p.at_forecast
            lines.append(
                f"  {layout:<14}{_counts(p):<26}{p.devices:>8}"
                f"{o.goodput_rps / p.devices:>11.3f} req/s{o.attainment:>15.1%}"
            )
        else:
            lines.append(f"  {layout:<14}infeasible: {p.message}")
    lines.append(f"recommended: {c.chosen.layout} ({'; '.join(c.why)})")
    return "\n".join(lines)


def _counts(p: RegionPlan) -> str:
    if p.layout == "colocated":
        return f"{p.decode} x tp={p.decode_tp}"
    return f"{p.prefill} x tp={p.prefill_tp} + {p.decode} x tp={p.decode_tp}"


def choice_json(c: LayoutChoice, model: str, limits: PlanLimits, slo: PlanSlo) -> dict[str, Any]:
    """The recommended plan (its cluster YAML the one to serve), each layout compared, and
    why the others lost."""
    compared: dict[str, Any] = {}
    for layout, p in c.plans.items():
        if isinstance(p, RegionPlan):
            compared[layout] = {
                "prefill": p.prefill,
                "decode": p.decode,
                "prefill_tp": p.prefill_tp,
                "decode_tp": p.decode_tp,
                "devices": p.devices,
                "goodput_per_device": p.at_forecast.goodput_rps / p.devices,
                "attainment": p.at_forecast.attainment,
            }
        else:
            compared[layout] = {"infeasible": p.message}
    return plan_json(c.chosen, model, limits, slo) | {"compared": compared, "why": list(c.why)}


def describe_plan(p: RegionPlan, slo: PlanSlo, mix: LengthMix) -> str:
    one, tb, o = p.single, p.textbook, p.at_forecast
    q = f"p{slo.percentile:g}"
    prompt, output = float(np.mean(mix.prompt)), float(np.mean(mix.output))
    lines = [
        f"== region {p.region}: {p.rate:g} req/s (peak), {prompt:.0f}-token prompts, "
        f"{output:.0f} output tokens; SLO {q} TTFT {slo.ttft_s * 1e3:g} ms, TPOT {slo.tpot_s * 1e3:g} ms",
        f"one instance: prefill of one prompt {one.prefill_s * 1e3:.1f} ms; decode step at batch 1 "
        f"{one.decode_floor_s * 1e3:.2f} ms (weights at full bandwidth: {one.bandwidth_floor_s * 1e3:.2f} ms); "
        f"KV holds {one.max_batch} requests; largest batch within the TPOT SLO {one.batch} "
        f"(step {one.step_at_batch_s * 1e3:.1f} ms)",
        f"plan (simulated): {_roles(p)} = {p.devices} devices; at the forecast: TTFT {q} "
        f"{o.ttft_s * 1e3:.0f} ms, TPOT {q} {o.tpot_s * 1e3:.1f} ms, goodput {o.goodput_rps:.2f} "
        f"req/s = {o.goodput_rps / p.devices:.3f} req/s per device, SLO attainment "
        f"{o.attainment:.1%} ({p.simulations} simulations)",
    ]
    if p.layout != "colocated":  # the textbook sizes each role apart
        lines += [
            f"textbook: prefill rho={tb.prefill_rho:.2f} (M/D/1), {tb.prefill_rate:.1f} req/s each "
            f"-> {tb.prefill_bare} (+30%, N+1: {tb.prefill}); decode {tb.decode_rate:.2f} req/s "
            f"each at batch {one.batch} -> {tb.decode_bare} (+30%, N+1: {tb.decode}) = "
            f"{p.textbook_devices} devices",
            "why they differ: " + _why(p),
        ]
    if p.tried:
        lines.append("other tensor-parallel sizes: " + "; ".join(p.tried))
    return "\n".join(lines)


def _roles(p: RegionPlan) -> str:
    if p.layout == "colocated":
        return (
            f"colocated {p.decode} x tp={p.decode_tp} (no prefill instances: each prefills its "
            "own prompts, chunked, beside its decodes)"
        )
    return f"prefill {p.prefill} x tp={p.prefill_tp}, decode {p.decode} x tp={p.decode_tp}"


def _why(p: RegionPlan) -> str:
    tb = p.textbook
    parts = []
    dp, dd = p.prefill - tb.prefill, p.decode - tb.decode
    if dp:
        parts.append(
            f"prefill {'+' if dp > 0 else ''}{dp}: the textbook sizes for the mean M/D/1 wait; the "
            "simulation meets the percentile with chunked prefill, batching of prompts in one "
            "step, Poisson bursts and the KV hand-off in the TTFT"
        )
    if dd:
        parts.append(
            f"decode {'+' if dd > 0 else ''}{dd}: the textbook runs every instance at its SLO batch; "
            "in the simulation batches vary with arrivals, prefill-free decode steps and the "
            "router's balance, and the percentile (not the mean) must meet the TPOT SLO"
        )
    return "; ".join(parts) or "none at these figures"


def plan_json(p: RegionPlan, model: str, limits: PlanLimits, slo: PlanSlo) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "region": p.region,
        "layout": p.layout,
        "rate": p.rate,
        "prefill": p.prefill,
        "decode": p.decode,
        "prefill_tp": p.prefill_tp,
        "decode_tp": p.decode_tp,
        "devices": p.devices,
        "at_forecast": asdict(p.at_forecast),
        "single_instance": asdict(p.single),
        "textbook": asdict(p.textbook),
        "textbook_devices": p.textbook_devices,
        "cluster_yaml": cluster_yaml(
            model, p.region, p.prefill, p.decode, p.prefill_tp, p.decode_tp, limits, slo
        ),
        "other_layouts": p.tried,
    }
