"""``pdserve rollout``: move a model to a new version (canary, blue/green, promote, rollback).

    pdserve rollout --model pycode --version v2 --source ./pycode-v2 --canary 10
    pdserve rollout --model pycode --promote        # v2 takes all traffic, v1 retires
    pdserve rollout --model pycode --rollback       # v1 takes all traffic, v2 retires
    pdserve rollout --model pycode --version v3 --blue-green
    pdserve rollout                                 # every served version

A registry model (``registry:NAME@VERSION``) rolls out to ``registry:NAME@V``
when no ``--source`` is given; its weights are checked against their hashes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from

DEFAULT_CANARY = 10.0  # percent of new requests a canary takes


@dataclass(frozen=True)
class RolloutOptions:
    """``pdserve rollout``'s options, in the order of its flags."""

    model: str | None = None  # the model's name, as clients name it
    version: str | None = None  # the version to roll out
    source: str | None = None  # its weights (None: a registry model's VERSION)
    canary: float | None = None  # percent of new requests it takes (None: DEFAULT_CANARY)
    blue_green: bool = False  # all traffic at once, old retired
    promote: bool = False  # the canary takes all traffic
    rollback: bool = False  # the stable version takes it all
    ray_address: str = "auto"  # auto, local or a Ray address


def cmd_rollout(args: argparse.Namespace) -> int:
    from pdserve.deploy.cluster_cli import _controller, _get, print_versions

    action, options = _action(options_from(RolloutOptions, args))
    controller = _controller(args.ray_address)
    print_versions(_get(controller.models.remote(action, **options)))
    return 0


def _action(args: RolloutOptions) -> tuple[str, dict[str, Any]]:
    """(the controller's step, its arguments); a flag the step would not read is refused
    (it was dropped without a word: ``--promote --canary 50`` promoted)."""
    steps = [s for s in ("promote", "rollback") if getattr(args, s)]
    if len(steps) > 1 or (steps and (args.version or args.blue_green)):
        raise InvalidArgumentError("rollout", "give one of --version, --promote, --rollback")
    if (steps or args.version) and not args.model:
        raise InvalidArgumentError("model", "--model is required for a rollout step")
    given = [
        f
        for f, v in (
            ("--source", args.source),
            ("--canary", args.canary),
            ("--blue-green", args.blue_green),
        )
        if v not in (None, False)
    ]
    if given and not args.version:
        step = f"--{steps[0]}" if steps else "a status listing"
        raise InvalidArgumentError(
            given[0][2:], f"applies to a rollout of a --version, not to {step}"
        )
    if args.blue_green and args.canary is not None:
        raise InvalidArgumentError("canary", "a --blue-green rollout takes all traffic at once")
    if steps:
        return steps[0], {"name": args.model}
    if args.version:
        return "rollout", {
            "name": args.model,
            "version": args.version,
            "source": args.source,
            "canary": DEFAULT_CANARY if args.canary is None else args.canary,
            "blue_green": args.blue_green,
        }
    return "status", {}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollout", help="a model's versions: canary or blue/green rollout, promote, rollback"
    )
    p.add_argument("--model", default=None, help="the model's name, as clients name it")
    p.add_argument("--version", default=None, help="the version to roll out")
    p.add_argument(
        "--source",
        default=None,
        help="its weights: a folder, builtin:NAME or registry:NAME@VERSION "
        "(default for a registry model: the registry's VERSION)",
    )
    p.add_argument(
        "--canary",
        type=float,
        default=None,
        help=f"percent of new requests it takes (default {DEFAULT_CANARY:g})",
    )
    p.add_argument("--blue-green", action="store_true", help="all traffic at once, old retired")
    p.add_argument("--promote", action="store_true", help="the canary takes all traffic")
    p.add_argument("--rollback", action="store_true", help="the stable version takes it all")
    p.add_argument("--ray-address", default="auto", help="auto, local or a Ray address")
    p.set_defaults(func=cmd_rollout)
