"""The file of ``pdserve sim-validate --keep-traces``: per setup what was measured
(the cluster YAML, the profile, each run's workload flags, summary and engines'
traced steps), which ``--from-traces`` reads back to calibrate and simulate again
without measuring. A file whose runs had other workloads than the flags give is
refused, naming the run and the flags: simulated with other workloads, its
calibration would be wrong without a word."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.calibrate import Runs
from pdserve.sim.live import Measured


def run_workloads(runs: Runs) -> list[dict[str, Any]]:
    """Each run's workload flags (the scalar ones, less the prompts' token seed, which a
    run draws and a simulation does not read) and rate, as a kept file records them."""
    return [
        {
            **{
                k: v
                for k, v in sorted(dataclasses.asdict(ns).items())
                if isinstance(v, (int, float, str)) and k != "prompt_seed"
            },
            "rate": rate,
        }
        for ns, rate in runs
    ]


def kept_entry(text: str, book: Any, runs: Runs, real: list[Measured]) -> dict[str, Any]:
    """A setup's entry in a ``--keep-traces`` file: what :func:`kept_runs` reads back."""
    return {
        "config": text,
        "profile": book.profiles[0].to_json(),
        "workloads": run_workloads(runs),
        "runs": [m.to_json() for m in real],
    }


def kept_setup(kept: dict[str, Any], setup: str) -> tuple[str, Any]:
    """(cluster YAML, profile book) of ``setup`` in a ``--keep-traces`` file's contents."""
    from pdserve.cluster.config import parse_config
    from pdserve.sim.build import book_for
    from pdserve.sim.profile import profile_from_json

    entry = kept.get(setup)
    if not isinstance(entry, dict) or not {"config", "profile", "runs"} <= set(entry):
        raise InvalidArgumentError("--from-traces", f"holds no {setup} setup: {sorted(kept)}")
    text = entry["config"]
    book = book_for(parse_config(text, f"<{setup}>"), [profile_from_json(entry["profile"])], None)
    return text, book


def kept_runs(kept: dict[str, Any], setup: str, runs: Runs) -> list[Measured]:
    """The measured runs of ``setup`` (:func:`kept_setup` first) in a ``--keep-traces``
    file's contents, which must hold ``runs`` (the same workloads, in order)."""
    entry = kept[setup]
    if len(entry["runs"]) != len(runs):
        raise InvalidArgumentError(
            "--from-traces",
            f"holds {len(entry['runs'])} {setup} runs, these flags measure "
            f"{len(runs)}: give the points, --repeat and --num-requests it was measured with",
        )
    held = entry.get("workloads")
    if held is None:  # simulated with other workloads, its calibration would be wrong
        raise InvalidArgumentError(
            "--from-traces", "records no workloads of its runs: measure again"
        )
    for i, (a, b) in enumerate(zip(held, run_workloads(runs), strict=True)):
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if diff:
            raise InvalidArgumentError(
                "--from-traces",
                f"{setup} run {i + 1} was measured with "
                f"other {', '.join(diff)} than these flags give",
            )
    return [Measured.from_json(r) for r in entry["runs"]]


def read_kept(path: Path) -> dict[str, Any]:
    """The setups of a ``--keep-traces`` file."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError("--from-traces", f"{path}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("setups"), dict):
        raise InvalidArgumentError("--from-traces", f"{path}: not a --keep-traces file")
    setups: dict[str, Any] = raw["setups"]
    return setups
