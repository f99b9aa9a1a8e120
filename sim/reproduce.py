"""A published disaggregation result, reproduced by pdserve's simulator.

``pdserve reproduce distserve`` takes DistServe's motivating experiment
(Zhong et al., "DistServe: Disaggregating Prefill and Decoding for
Goodput-optimized Large Language Model Serving", OSDI 2024, Section 2.3 and its
first figure; told with the same numbers in the authors' post
https://hao-ai-lab.github.io/blogs/distserve/): a 13B model (OPT-13B, the
paper's 13B model) on A100-80GB GPUs, every request 512 prompt tokens and 64
output tokens, Poisson arrivals, SLOs P90 TTFT 0.4 s and P90 TPOT 0.04 s. The
paper reads from its measured curves:

- one colocated GPU meets the TTFT SLO up to ~3 req/s and the TPOT SLO up to
  ~1.6 req/s, so its goodput is 1.6 req/s per GPU;
- one prefill-only GPU meets the TTFT SLO up to ~5.6 req/s and one decode-only
  GPU the TPOT SLO up to ~10 req/s;
- two prefill GPUs with one decode GPU (2P1D) serve 10 req/s: 3.3 req/s per GPU,
  2.1x the colocated goodput per GPU.

pdserve finds each rate by bisection: the highest Poisson rate at which the
simulated layout meets the named P90 SLOs (the same engine scheduler, router and
hand-off as ``pdserve sim``, timed by the analytic A100 profile of the model).
Layouts of one role have the other role's instances in plenty (four), so only
the named role limits. Every instance runs at most ``max_num_batched_tokens``
tokens a step (2,048: vLLM's default for a model of 2,048 positions, the
paper's colocated baseline); prefill and decode GPUs share a node (KV pages
move over NVLink), as DistServe places them.

The paper's figures are read off plots by its authors ("roughly"); the number
this command is judged by is the ratio of disaggregated to colocated goodput
per GPU, within 25%.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from
from pdserve.sim.analytic import MODELS, Assumptions
from pdserve.sim.build import ProfileBook
from pdserve.sim.candidates import Candidates, LayoutCase, Outcome
from pdserve.sim.plan import LengthMix, PlanLimits, PlanSlo

GOAL = 0.25  # the ratio of goodputs per GPU within 25% of the paper's
PLENTY = 4  # instances of the role a one-role figure does not measure
FIT_STEPS = 7  # halvings of an efficiency's bracket [0.05, 1] when fitting it


@dataclass(frozen=True)
class Figure:
    """One rate the paper reports: a layout's counts, the SLOs it must meet, the GPUs
    the rate is divided by, and the paper's value (req/s)."""

    key: str
    label: str
    prefill: int
    decode: int
    meets: str  # "ttft", "tpot" or "both"
    gpus: int
    paper: float


@dataclass(frozen=True)
class Study:
    name: str
    citation: str
    model: str
    device: str
    prompt_len: int
    output_len: int
    slo: PlanSlo
    max_num_batched_tokens: int
    figures: tuple[Figure, ...]
    ratio: tuple[str, str, float]  # (numerator figure, denominator figure, paper's ratio)


DISTSERVE = Study(
    name="distserve",
    citation=(
        "Zhong et al., DistServe: Disaggregating Prefill and Decoding for Goodput-optimized "
        "Large Language Model Serving, OSDI 2024, Section 2.3 (and "
        "https://hao-ai-lab.github.io/blogs/distserve/)"
    ),
    model="opt-13b",
    device="a100",
    prompt_len=512,
    output_len=64,
    slo=PlanSlo(0.4, 0.04, 90.0),
    max_num_batched_tokens=2048,
    figures=(
        Figure("colocated_ttft", "colocated, 1 GPU, TTFT SLO only", 0, 1, "ttft", 1, 3.0),
        Figure("colocated_tpot", "colocated, 1 GPU, TPOT SLO only", 0, 1, "tpot", 1, 1.6),
        Figure("colocated", "colocated, 1 GPU, both SLOs (goodput/GPU)", 0, 1, "both", 1, 1.6),
        Figure("prefill_only", "1 prefill GPU, TTFT SLO", 1, PLENTY, "ttft", 1, 5.6),
        Figure("decode_only", "1 decode GPU, TPOT SLO", PLENTY, 1, "tpot", 1, 10.0),
        Figure("disaggregated", "2P1D, 3 GPUs, both SLOs (goodput/GPU)", 2, 1, "both", 3, 3.3),
    ),
    ratio=("disaggregated", "colocated", 3.3 / 1.6),
)
STUDIES = {s.name: s for s in (DISTSERVE,)}


@dataclass(frozen=True)
class ReproduceOptions:
    study: str
    num_requests: int = 1500
    iterations: int = 10
    mfu: float | None = None
    mbu: float | None = None
    seed: int = 0
    fit: bool = True
    out: str | None = None

    def __post_init__(self) -> None:
        if self.study not in STUDIES:
            raise InvalidArgumentError("study", f"one of {sorted(STUDIES)}, got {self.study!r}")
        if self.num_requests < 50:
            raise InvalidArgumentError("num_requests", f"must be >= 50, got {self.num_requests}")
        if self.iterations < 1:
            raise InvalidArgumentError("iterations", f"must be >= 1, got {self.iterations}")
        for name in ("mfu", "mbu"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise InvalidArgumentError(name, f"must be in (0, 1], got {value}")


@dataclass(frozen=True)
class Row:
    figure: Figure
    rate: float  # the highest rate meeting the figure's SLOs (req/s, whole layout)
    at: Outcome  # the simulation at that rate

    @property
    def per_gpu(self) -> float:
        return self.rate / self.figure.gpus


def _meets(fig: Figure, slo: PlanSlo) -> Callable[[Outcome], bool]:
    def ok(o: Outcome) -> bool:
        ttft, tpot = o.meets(slo)
        return {"ttft": ttft, "tpot": tpot, "both": ttft and tpot}[fig.meets]

    return ok


def highest_rate(
    case: LayoutCase, counts: tuple[int, int], ok: Callable[[Outcome], bool], opts: ReproduceOptions
) -> tuple[float, Outcome]:
    """The highest Poisson rate (req/s) at which ``counts`` meets ``ok``: doubled from
    0.25 req/s until it fails, then halved ``opts.iterations`` times. Every rate draws
    the same exponential gaps (one seed), scaled, so attainment falls with the rate."""

    def run(rate: float) -> Outcome:
        return Candidates(case, rate, opts.num_requests).run(*counts)

    lo, hi = 0.0, 0.25
    best = run(hi)
    while ok(best):
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise InvalidArgumentError("study", "the layout meets its SLOs at any rate")
        best = run(hi)
    first: Outcome | None = None if lo == 0 else run(lo)
    for _ in range(opts.iterations):
        mid = (lo + hi) / 2
        o = run(mid)
        if ok(o):
            lo, first = mid, o
        else:
            hi = mid
    if first is None:
        raise InvalidArgumentError("study", f"{counts} meets its SLOs at no rate")
    return lo, first


def reproduce_case(study: Study, opts: ReproduceOptions, effs: dict[str, float]) -> LayoutCase:
    book = ProfileBook(MODELS[study.model], [], study.device, replace(Assumptions(), **effs))
    n = study.prompt_len, study.output_len
    mix = LengthMix(np.array([n[0]], dtype=np.int64), np.array([n[1]], dtype=np.int64))
    limits = PlanLimits(max_num_batched_tokens=study.max_num_batched_tokens, seed=opts.seed)
    return LayoutCase(book, "r", mix, (1, 1), limits, study.slo)


def figure_rate(study: Study, key: str, opts: ReproduceOptions, effs: dict[str, float]) -> Row:
    (fig,) = [f for f in study.figures if f.key == key]
    counts = (fig.prefill, fig.decode)
    rate, at = highest_rate(reproduce_case(study, opts, effs), counts, _meets(fig, study.slo), opts)
    return Row(fig, rate, at)


def fit_efficiencies(study: Study, opts: ReproduceOptions) -> dict[str, float]:
    """The MFU that gives the study's one-role prefill figure and the MBU that gives its
    one-role decode figure, by bisection (as a measured profile corrects an analytic one:
    :func:`pdserve.sim.analytic.calibrate`); an efficiency the options name is kept."""
    effs = {k: v for k, v in (("mfu", opts.mfu), ("mbu", opts.mbu)) if v is not None}
    for name, key in (("mfu", "prefill_only"), ("mbu", "decode_only")):
        if name in effs:
            continue
        target = next(f.paper for f in study.figures if f.key == key)
        lo, hi = 0.05, 1.0
        for _ in range(FIT_STEPS):
            mid = (lo + hi) / 2
            try:
                got = figure_rate(study, key, opts, {**effs, name: mid}).per_gpu
            except InvalidArgumentError:  # too slow to meet the SLO at any rate
                got = 0.0
            lo, hi = (lo, mid) if got > target else (mid, hi)
        effs[name] = round((lo + hi) / 2, 3)
    return effs


def reproduce(opts: ReproduceOptions) -> tuple[dict[str, float], list[Row]]:
    """The efficiencies used (fitted unless given, or the defaults without ``fit``) and
    each of the study's figures, simulated with them."""
    study = STUDIES[opts.study]
    if opts.fit:
        effs = fit_efficiencies(study, opts)
    else:
        a = Assumptions()
        effs = {"mfu": opts.mfu or a.mfu, "mbu": opts.mbu or a.mbu}
    return effs, [figure_rate(study, f.key, opts, effs) for f in study.figures]


def ratio(study: Study, rows: list[Row]) -> float:
    """The study's ratio (numerator figure's rate per GPU over the denominator's)."""
    by = {r.figure.key: r for r in rows}
    top, bottom, _ = study.ratio
    return by[top].per_gpu / by[bottom].per_gpu


def report(study: Study, rows: list[Row]) -> str:
    """The paper's figures beside pdserve's, the ratio last."""
    lines = [
        f"{study.citation}",
        f"{study.model} on {study.device}, {study.prompt_len} prompt + {study.output_len} "
        f"output tokens, Poisson; P{study.slo.percentile:g} TTFT {study.slo.ttft_s * 1e3:g} ms, "
        f"P{study.slo.percentile:g} TPOT {study.slo.tpot_s * 1e3:g} ms",
        "",
        "| figure | paper req/s per GPU | pdserve req/s per GPU | pdserve / paper | "
        "TTFT p90 ms | TPOT p90 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f = r.figure
        lines.append(
            f"| {f.label} | {f.paper:.2f} | {r.per_gpu:.2f} | {r.per_gpu / f.paper:.2f}x | "
            f"{r.at.ttft_s * 1e3:.0f} | {r.at.tpot_s * 1e3:.1f} |"
        )
    got, paper = ratio(study, rows), study.ratio[2]
    off = got / paper - 1
    verdict = "within" if abs(off) <= GOAL else "outside"
    lines += [
        "",
        f"disaggregated / colocated goodput per GPU: paper {paper:.2f}x, pdserve {got:.2f}x "
        f"({off:+.0%}: {verdict} the {GOAL:.0%} goal)",
    ]
    return "\n".join(lines)


def cmd_reproduce(args: argparse.Namespace) -> int:
    opts = options_from(ReproduceOptions, args)
    study = STUDIES[opts.study]
    effs, rows = reproduce(opts)
    how = "fitted to the one-role figures" if opts.fit else "assumed"
    print(f"A100 efficiencies ({how}): MFU {effs['mfu']:.3f}, MBU {effs['mbu']:.3f}")
    print(report(study, rows))
    if opts.out:
        out = {
            "study": study.name,
            "citation": study.citation,
            "options": asdict(opts),
            "efficiencies": effs,
            "figures": [
                {**asdict(r.figure), "rate": r.rate, "per_gpu": r.per_gpu, "at": asdict(r.at)}
                for r in rows
            ],
            "ratio": {"paper": study.ratio[2], "pdserve": ratio(study, rows)},
        }
        Path(opts.out).write_text(json.dumps(out, indent=1))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reproduce", help="a published disaggregation result beside pdserve's simulation of it"
    )
    p.add_argument("study", choices=sorted(STUDIES))
    p.add_argument(
        "--num-requests", type=int, default=1500, help="requests simulated at each rate tried"
    )
    p.add_argument("--iterations", type=int, default=10, help="halvings of each rate's bracket")
    p.add_argument(
        "--no-fit",
        dest="fit",
        action="store_false",
        help="time the steps at the analytic profile's assumed efficiencies (MFU 0.5, "
        "MBU 0.8) instead of fitting them to the study's one-role figures",
    )
    p.add_argument("--mfu", type=float, default=None, help="the device's MFU (not fitted)")
    p.add_argument("--mbu", type=float, default=None, help="the device's MBU (not fitted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures (JSON)")
    p.set_defaults(func=cmd_reproduce)
