"""``pdserve sim-validate``'s points: a setup, a workload, a rate, and the load
generator's limits.

Setups: ``colocated`` (one decode-role instance prefilling every prompt itself,
both cores) and ``disaggregated`` (one prefill and one decode instance, a core
each). Workloads: ``conv`` and ``code`` (the Azure traces, lengths scaled by
``--length-scale`` and clamped) and ``long`` (synthetic 1,024-token prompts,
32-token outputs). Fields after the rate set the load generator's limits, which
the simulator applies as well: ``cN``, a closed loop that holds an arrival while N
requests are in flight (``--max-concurrency N``, :mod:`pdserve.sim.gate`), and
``tS``, a request given up on S seconds after it was sent (``--request-timeout S``,
:mod:`pdserve.sim.timeouts`); e.g. ``colocated:conv:4:c2`` or
``colocated:long:3:t6``. The report then gives the failed requests of each side.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.calibrate import bench_flags
from pdserve.sim.validate_options import ValidateOptions

if TYPE_CHECKING:
    from pdserve.bench.serve import RunFlags

WORKLOADS: dict[str, list[str]] = {
    "conv": ["--trace", "azure-conv", "--max-prompt-len", "1024", "--max-output-len", "128"],
    "code": ["--trace", "azure-code", "--max-prompt-len", "1024", "--max-output-len", "128"],
    "long": ["--prompt-len", "1024", "--output-len", "32"],
}
SETUPS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Point:
    setup: str
    workload: str
    rate: float
    concurrency: int | None = None  # a closed loop: at most this many requests in flight
    timeout_s: float | None = None  # the load generator's --request-timeout

    @classmethod
    def parse(cls, text: str) -> Point:
        fields = text.split(":")
        try:
            limits = {f[0]: f[1:] for f in fields[3:]}
            if len(fields) < 3 or len(limits) != len(fields) - 3 or set(limits) - {"c", "t"}:
                raise ValueError(text)
            point = cls(
                fields[0],
                fields[1],
                float(fields[2]),
                int(limits["c"]) if "c" in limits else None,
                float(limits["t"]) if "t" in limits else None,
            )
        except (ValueError, IndexError):
            raise InvalidArgumentError(
                "point", f"{text!r} is not SETUP:WORKLOAD:RATE[:cN][:tS]"
            ) from None
        if (
            point.setup not in SETUPS
            or point.workload not in WORKLOADS
            or not 0 < point.rate < math.inf
            or (point.concurrency is not None and point.concurrency < 1)
            or (point.timeout_s is not None and not 0 < point.timeout_s < math.inf)
        ):
            raise InvalidArgumentError(
                "point",
                f"{text!r}: setup in {SETUPS}, workload in {sorted(WORKLOADS)}, "
                "rate > 0 and finite, cN with N >= 1, tS with S > 0 and finite",
            )
        return point

    @property
    def name(self) -> str:
        closed = f":c{self.concurrency}" if self.concurrency is not None else ""
        timeout = f":t{self.timeout_s:g}" if self.timeout_s is not None else ""
        return f"{self.setup}:{self.workload}:{self.rate:g}{closed}{timeout}"


def workload_flags(point: Point, args: ValidateOptions) -> list[str]:
    """The point's ``pdserve bench serve`` workload and load-limit flags."""
    flags = list(WORKLOADS[point.workload])
    if point.workload in ("conv", "code"):
        flags += ["--length-scale", str(args.length_scale)]
    if point.concurrency is not None:
        flags += ["--max-concurrency", str(point.concurrency)]
    if point.timeout_s is not None:
        flags += ["--request-timeout", str(point.timeout_s)]
    return flags


def workload_args(point: Point, args: ValidateOptions) -> RunFlags:
    return bench_flags(workload_flags(point, args), args)


def sim_command(point: Point, args: ValidateOptions, written: dict[str, str]) -> str:
    """The ``pdserve sim`` command that simulates ``point`` with its setup's calibrated
    profile and cluster (``written``: their files, ``--write-profiles``)."""
    return shlex.join(
        [
            "pdserve",
            "sim",
            "--config",
            written["config"],
            "--profile",
            written["profile"],
            "--full",
            "--rate",
            f"{point.rate:g}",
            *workload_flags(point, args),
            "--num-requests",
            str(args.num_requests),
            "--seed",
            str(args.seed),
            "--noise-draws",
            str(args.noise_draws),
        ]
    )


def written_lines(
    points: list[Point], args: ValidateOptions, calibrations: dict[str, Any]
) -> list[str]:
    """With ``--write-profiles``: the files written and, per point, the ``pdserve sim``
    command that simulates it with them (as many draws of the noise as here)."""
    written = {s: c["written"] for s, c in calibrations.items() if "written" in c}
    lines = [f"{s}: wrote {w['config']} and {w['profile']}" for s, w in written.items()]
    if written:
        lines.append("each point simulated with them:")
    return lines + [sim_command(p, args, written[p.setup]) for p in points if p.setup in written]
