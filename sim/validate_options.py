"""``pdserve sim-validate``'s options: the points, their runs, the fit, what is written.

Built once from the command line by :func:`pdserve.sim.validate.cmd_sim_validate`;
the calibration (:mod:`pdserve.sim.calibrate`), the points
(:mod:`pdserve.sim.validate_points`) and the validation read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# (setup, workload, rate req/s) of the default run: each workload at a low rate and
# near saturation on builtin:small, two cores
DEFAULT_POINTS = (
    "colocated:conv:0.3",
    "colocated:conv:1.2",
    "disaggregated:code:0.3",
    "disaggregated:code:1.0",
    "disaggregated:long:0.2",
    "colocated:long:0.8",
)


@dataclass(frozen=True)
class ValidateOptions:
    """The flags of ``pdserve sim-validate``, in their order."""

    model: str = "builtin:small"  # the model of both setups
    points: list[str] = field(default_factory=lambda: list(DEFAULT_POINTS))  # SETUP:WORKLOAD:RATE
    num_requests: int = 40  # measured requests per point
    length_scale: float = 0.25  # for the Azure traces
    seed: int = 0  # arrivals and lengths
    calibration_requests: int = 8  # requests of a calibration run
    repeat: int = 1  # how many times every point is measured
    cores: list[int] = field(default_factory=lambda: [0, 1])  # the cores of both setups
    out: str = "bench/out/sim"  # output folder
    name: str = "validation"  # output file stem
    role_fit: bool = True  # fit each role's steps on their own
    host_check: bool = False  # a short check run before each measured run
    calibrate_around: bool = False  # the calibration runs again after the points
    noise_draws: int = 0  # draws of the fitted noise simulated (0: no noise)
    keep_traces: bool = False  # also write NAME-traces.json
    write_profiles: bool = False  # also write each setup's YAML and calibrated profile
    from_traces: str | None = None  # measure nothing: a --keep-traces file's runs
    prog: str = "pdserve sim-validate"  # the command, for the record
