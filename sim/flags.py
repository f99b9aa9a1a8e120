"""Command-line flags the sim commands share: the device and its assumed efficiencies,
and the host that instances of a local cluster share."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.analytic import DEVICES, Assumptions


@dataclass(frozen=True)
class DeviceFlags:
    """The analytic-profile flags (:func:`add_device_flags`)."""

    device: str | None = None  # time layouts without a profile file from this datasheet
    mfu: float = Assumptions.mfu  # assumed share of peak FLOP/s in compute-bound steps
    mbu: float = Assumptions.mbu  # assumed share of memory bandwidth in memory-bound steps
    step_overhead_ms: float = Assumptions.step_overhead_s * 1e3  # fixed cost of a step
    calibrate: str | None = None  # a measured profile whose efficiencies replace mfu/mbu


def add_device_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("analytic profiles")
    g.add_argument(
        "--device",
        choices=sorted(DEVICES),
        default=None,
        help="time layouts without a profile file from this device's datasheet",
    )
    g.add_argument(
        "--mfu",
        type=float,
        default=Assumptions.mfu,
        help="assumed share of peak FLOP/s in compute-bound steps",
    )
    g.add_argument(
        "--mbu",
        type=float,
        default=Assumptions.mbu,
        help="assumed share of memory bandwidth in memory-bound steps",
    )
    g.add_argument("--step-overhead-ms", type=float, default=Assumptions.step_overhead_s * 1e3)
    g.add_argument(
        "--calibrate",
        default=None,
        metavar="PROFILE",
        help="a measured profile of the same device: its efficiencies replace --mfu/--mbu",
    )


def add_host_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-cores",
        type=float,
        default=0.0,
        metavar="N",
        help="the instances share a host of N cores, as a local cluster of this "
        "machine does: steps run slower while the busy instances' threads "
        "exceed N, step by step (default 0: each instance has devices of "
        "its own)",
    )


def assumptions_from(args: DeviceFlags, model: str | None) -> Assumptions:
    """The assumptions of analytic profiles of ``model`` (None: the ``--calibrate``
    profile's own) the flags give."""
    base = Assumptions(mfu=args.mfu, mbu=args.mbu, step_overhead_s=args.step_overhead_ms / 1e3)
    if args.calibrate is None:
        return base
    from dataclasses import replace

    from pdserve.sim.analytic import analytic_profile, measured_efficiency, model_shape
    from pdserve.sim.profile import load_profile

    if args.device is None:
        raise InvalidArgumentError("calibrate", "needs --device (the analytic profile it corrects)")
    measured = load_profile(args.calibrate)
    if measured.device != args.device:
        raise InvalidArgumentError(
            "calibrate",
            f"{args.calibrate} was measured on {measured.device!r}, not {args.device!r}",
        )
    shape = measured.model
    if model is not None and model != measured.model.name:
        shape = model_shape(model)
    first = analytic_profile(
        shape, args.device, measured.tensor_parallel_size, measured.pipeline_parallel_size, base
    )
    return replace(base, **measured_efficiency(first, measured))
