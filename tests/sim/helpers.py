"""Small clusters with hand-checkable latency models for the simulator's tests, and
synthetic engine step traces and kept-traces files for the calibration's."""

from __future__ import annotations

import argparse
import json

import numpy as np

from pdserve.cluster.config import ClusterConfig, parse_config
from pdserve.core.messages import StepRecord
from pdserve.sim.build import ProfileBook
from pdserve.sim.live import LiveFit
from pdserve.sim.profile import ModelShape, Profile, StepFeatures, StepModel, TransferModel
from pdserve.sim.validate_options import ValidateOptions
from pdserve.sim.workload import SimWorkload

TOY = ModelShape("toy", 2, 64, 4, 2, 16, 128, 256, 4096)


def cpu_profile(
    shape: ModelShape, step: StepModel, kv_tokens: int, connectors: dict[str, TransferModel]
) -> Profile:
    """A measured-looking float32 profile of ``shape`` on one CPU rank: ``step`` times every
    step, ``connectors`` every transfer."""
    return Profile(
        model=shape,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        device="cpu",
        source="measured",
        step=step,
        kv_bytes_per_token=shape.kv_bytes_per_token(4),
        kv_capacity_tokens=kv_tokens,
        connectors=connectors,
    )


def toy_profile(step: StepModel, kv_tokens: int = 1 << 16, latency_s: float = 0.005) -> Profile:
    """A profile of the toy model: ``step`` times every step; transfers take ``latency_s``."""
    return cpu_profile(TOY, step, kv_tokens, {"default": TransferModel(latency_s, 1e18)})


def toy_yaml(
    prefill: int, decode: int, engine: str = "", planner: str = "advisory", router: str = ""
) -> str:
    return (
        "model: toy\n"
        f"engine: {{max_num_seqs: 64, max_num_batched_tokens: 512{engine}}}\n"
        "regions:\n  - name: east\n"
        f"    prefill: {{count: {prefill}, min: 0, max: 4}}\n"
        f"    decode: {{count: {decode}, min: 1, max: 4}}\n"
        "slo: {ttft_ms: 1000, tpot_ms: 100}\n"
        f"router: {{max_inflight_per_region: 100000{router}}}\n"
        f'planner: {{mode: "{planner}", interval_s: 1, cooldown_s: 1}}\n'
    )


def toy_config(
    prefill: int, decode: int, engine: str = "", planner: str = "advisory", router: str = ""
) -> ClusterConfig:
    return parse_config(toy_yaml(prefill, decode, engine, planner, router))


TOY_YAML = toy_yaml(0, 1)  # one colocated instance


def book(profile: Profile) -> ProfileBook:
    return ProfileBook(TOY, [profile])


def workload(
    arrival: np.ndarray, prompt: int | np.ndarray, output: int | np.ndarray
) -> SimWorkload:
    n = len(arrival)
    p = np.broadcast_to(np.asarray(prompt, dtype=np.int64), (n,)).copy()
    o = np.broadcast_to(np.asarray(output, dtype=np.int64), (n,)).copy()
    return SimWorkload(np.asarray(arrival, dtype=np.float64), p, o, np.zeros(n, dtype=np.int16))


def step_timeline(
    model: StepModel,
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    start: float,
    truth: LiveFit,
    shared: list[bool],
) -> list[StepRecord]:
    """Steps of ``shapes`` back to back from ``start``, each as long as ``truth`` makes
    it (``shared``: whether another instance's step covers it)."""
    out, now = [], start
    for (new, cached), beside in zip(shapes, shared, strict=True):
        f = StepFeatures.of(list(zip(new, cached, strict=True)))
        compute = truth.compute_scale * model.compute_time(f)
        rest = truth.memory_scale * (model.time(f) - model.compute_time(f))
        t = compute + rest
        if beside:  # the shared factors are of the scaled parts, as scaled() applies them
            t += truth.shared_compute * compute + truth.shared_factor * rest
        out.append(StepRecord(now, t, new, cached))
        now += t
    return out


# builtin:tiny's step as `sim-validate` measured it here (disaggregated, decode's core,
# 2026-11-29). Tests that simulate a validation point's runs take it instead of measuring:
# a measured model moves with the machine's load, and with it how well a fit separates
# the overheads a test sets.
TINY_STEP = StepModel(
    overhead_s=0.0069, s_per_token=1.34e-4, s_per_attn=2.18e-7, s_per_ctx=1.82e-6, s_per_seq=3.6e-5
)


def typed(args: argparse.Namespace) -> ValidateOptions:
    """``pdserve sim-validate``'s parsed flags as its handler types them."""
    from pdserve.core.options import options_from

    return options_from(ValidateOptions, args)


def tiny_setup(setup: str, args: ValidateOptions) -> tuple[str, ProfileBook]:
    """``setup_profiles(setup, args)`` with :data:`TINY_STEP` in place of a measurement."""
    from pdserve.sim.analytic import model_shape
    from pdserve.sim.build import book_for
    from pdserve.sim.validate_measure import setup_config

    text, _ = setup_config(setup, args)
    link = TransferModel(0.0, 3.5e9)
    profile = cpu_profile(model_shape(args.model), TINY_STEP, 65536, {"shm": link, "default": link})
    return text, book_for(parse_config(text, f"<{setup}>"), [profile], None)


def keep_file(args, tmp_path, setup, text, book, runs, real):  # type: ignore[no-untyped-def]
    """Write ``real`` (measured ``runs``) as a ``--keep-traces`` file of ``setup`` and
    point ``args`` at it."""
    from pdserve.sim.kept import kept_entry

    kept = tmp_path / "kept.json"
    setups = {setup: kept_entry(text, book, runs, real)}
    kept.write_text(json.dumps({"setups": setups}))
    args.from_traces = str(kept)
    return setups
