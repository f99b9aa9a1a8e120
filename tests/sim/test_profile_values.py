"""Every value of a profile file is checked: a shipped profile with any field set to any
JSON value (or taken out) loads, or is refused with one InvalidArgumentError naming the
file and the field; a profile that loads simulates in bounded time, or its step is
refused as out of range. The command line says so in one line and exits 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy.cli import main
from pdserve.sim.build import book_for
from pdserve.sim.cluster import SimCluster
from pdserve.sim.options import SimOptions
from pdserve.sim.profile import COMBINES, MAX_SECONDS, load_profile
from tests.sim.helpers import workload

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "sim" / "profiles" / "h200-llama3-8b.json"

# `make fuzz` sets PDSERVE_FUZZ_EXAMPLES for a long run; `make test` runs a short one.
FUZZ_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)

NUMBERS = (
    st.integers()
    | st.floats()
    | st.sampled_from([0, -1, -1e-9, 1e-300, 1e30, 1e308, 2**64, math.nan, math.inf, -math.inf])
    | st.sampled_from([MAX_SECONDS, MAX_SECONDS * (1 + 1e-9), 0.5, 1, 2])
)
LEAF = st.none() | st.booleans() | NUMBERS | st.text(max_size=12)
JSON = st.recursive(
    LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into ``value`` (its objects' keys, its lists' first items)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list) and value:
        out += _paths(value[0], (*prefix, 0))
    return out


RAW = json.loads(SHIPPED.read_text())
PATHS = _paths(RAW)
GONE = object()  # the edit that takes the key out
EDITS = st.lists(st.tuples(st.sampled_from(PATHS), JSON | st.just(GONE)), min_size=1, max_size=3)


def _edited(edits: list[tuple[tuple[Any, ...], Any]]) -> dict[str, Any]:
    raw = json.loads(json.dumps(RAW))
    for path, value in edits:
        parent = raw
        for key in path[:-1]:
            if not isinstance(parent, (dict, list)) or key not in (
                parent if isinstance(parent, dict) else range(len(parent))
            ):
                break
            parent = parent[key]
        else:
            if isinstance(parent, dict) and value is GONE:
                parent.pop(path[-1], None)
            elif isinstance(parent, dict) or (isinstance(parent, list) and parent):
                parent[path[-1] if isinstance(parent, dict) else 0] = (
                    None if value is GONE else value
                )
    return raw


def _load_or_refuse(path: Path) -> Any:
    """The profile at ``path``, or None where it is refused the one clean way."""
    try:
        return load_profile(path)
    except InvalidArgumentError as e:
        assert e.field.startswith(f"{path}: "), e.field  # the file, then the field
        assert "\n" not in str(e) and len(str(e)) < 400, str(e)
        return None


def test_the_shipped_profile_loads() -> None:
    assert load_profile(SHIPPED).model.num_layers == 32


@FUZZ
@given(edits=EDITS)
def test_fuzz_profile_values_load_or_name_the_field(tmp_path_factory, edits) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("fuzz") / "profile.json"
    path.write_text(json.dumps(_edited(edits)))
    profile = _load_or_refuse(path)
    if profile is not None:  # what loads is in range: the simulator may trust it
        _assert_in_range(profile)


def _assert_in_range(profile: Any) -> None:
    def whole(v: Any, lo: int = 1) -> bool:
        return type(v) is int and lo <= v

    def seconds(v: Any, hi: float = MAX_SECONDS) -> bool:
        return type(v) in (int, float) and 0 <= v <= hi

    m = profile.model
    assert all(whole(getattr(m, f.name)) for f in fields(m) if f.name.startswith(("num_l", "hid")))
    assert all(whole(v) for v in (m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size))
    assert whole(m.intermediate_size) and whole(m.max_position_embeddings)
    assert whole(m.num_experts, 0) and whole(m.num_experts_per_tok, 0)
    for step in (profile.step, *profile.role_steps.values()):
        assert all(seconds(getattr(step, f.name), 100) for f in fields(step) if f.name != "combine")
        assert seconds(step.overhead_s) and seconds(step.s_per_seq) and step.combine in COMBINES
    for t in profile.connectors.values():
        assert seconds(t.latency_s) and type(t.bytes_per_s) in (int, float)
        assert 1 <= t.bytes_per_s < math.inf
    assert whole(profile.kv_bytes_per_token) and whole(profile.kv_capacity_tokens)
    assert whole(profile.tensor_parallel_size) and whole(profile.pipeline_parallel_size)
    assert seconds(profile.request_overhead_s) and seconds(profile.request_jitter, 2)
    assert all(s.phase in ("prefill", "decode") and seconds(s.seconds) for s in profile.samples)


CLUSTER = """\
model: {model}
engine: {{max_num_seqs: 16, max_num_batched_tokens: 512}}
regions:
  - name: east
    prefill: {{count: 1}}
    decode: {{count: 1}}
slo: {{ttft_ms: 500, tpot_ms: 50}}
"""

# the fields a value within its range changes the simulation through: the step and
# transfer models, the request overheads, the KV capacity and the context limit
TIMED_FIELDS = ("step", "connectors", "request_overhead_s", "request_jitter", "kv_capacity_tokens")
TIMED = [p for p in PATHS if p[0] in TIMED_FIELDS]
# in range or just past it, and far past it (a step of 1e12 s once ran the loop for ever)
EXTREME = st.sampled_from([0, 1e-300, 1e-9, 1, 7, 99.5, 100, 1e4, MAX_SECONDS, 1 << 40, 1e12, 1e30])


@settings(FUZZ, max_examples=max(1, FUZZ_EXAMPLES // 3))  # each simulates a little
@given(edits=st.lists(st.tuples(st.sampled_from(TIMED), EXTREME), min_size=1, max_size=4))
def test_fuzz_an_accepted_profile_simulates_in_bounded_time(tmp_path_factory, edits) -> None:  # type: ignore[no-untyped-def]
    from pdserve.cluster.config import parse_config

    path = tmp_path_factory.mktemp("fuzz") / "profile.json"
    path.write_text(json.dumps(_edited(edits)))
    profile = _load_or_refuse(path)
    if profile is None:
        return
    config = parse_config(CLUSTER.format(model=json.dumps(profile.model.name)))
    work = workload(np.arange(12) * 0.25, np.array([3000, 40] * 6), 6)
    start = time.perf_counter()
    options = SimOptions(request_timeout_s=600.0)  # pdserve sim's default
    try:
        run = SimCluster(config, book_for(config, [profile], None), work, options).run()
    except InvalidArgumentError as e:  # a step or a hand-off past MAX_SECONDS
        assert e.field in ("step", "connectors") and "past the 3600 s" in e.message, str(e)
    else:
        assert run.end_s < 3 * 600 + 2 * MAX_SECONDS  # timed out, the steps then running end
    assert time.perf_counter() - start < 20


BAD = [
    (("step", "s_per_seq"), -1, "step.s_per_seq: must be >= 0, got -1"),
    (("step", "overhead_s"), 1e30, "step.overhead_s: must be at most 3600, got 1e+30"),
    (("model", "num_layers"), "32", "model.num_layers: must be an integer, got '32'"),
    (("model", "hidden_size"), None, "model.hidden_size: must be an integer, got None"),
    (("connectors", "shm", "bytes_per_s"), math.nan, "connectors.shm.bytes_per_s: must be finite"),
    (("samples", 0, "seconds"), [], "samples[0].seconds: must be a number, got []"),
    (("kv_capacity_tokens",), GONE, "kv_capacity_tokens: is missing"),
]


def _flags(command: str, tmp_path: Path) -> list[str]:
    config = tmp_path / "cluster.yaml"
    config.write_text(CLUSTER.format(model=json.dumps(RAW["model"]["name"])))
    out = str(tmp_path / "out")
    return {
        "sim": ["--config", str(config), "--rate", "1", "--num-requests", "4", "--out", out],
        "plan": ["--model", RAW["model"]["name"], "--rate", "east=1", "--jobs", "1"],
    }[command]


@pytest.mark.parametrize("command", ["sim", "plan"])
@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_the_commands_name_the_file_and_field(
    tmp_path: Path, capsys: Any, command: str, field: tuple[Any, ...], value: Any, message: str
) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_edited([(field, value)])))
    assert main([command, "--profile", str(profile), *_flags(command, tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve {command}: error: {profile}: {message}"), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("command", "field", "value"),
    [("sim", ("step", "s_per_seq"), -1), ("plan", ("model", "num_heads"), [32])],
)
def test_a_bad_profile_value_is_one_line_and_status_2_not_a_traceback(
    tmp_path: Path, command: str, field: tuple[Any, ...], value: Any
) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_edited([(field, value)])))
    argv = [sys.executable, "-m", "pdserve.deploy.cli", command, "--profile", str(profile)]
    done = subprocess.run(
        argv + _flags(command, tmp_path), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    name = ".".join(map(str, field))
    assert done.stderr.startswith(f"pdserve {command}: error: {profile}: {name}: must be")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("value", ["x", None, [2], math.nan, -4])
def test_profile_names_a_bad_value_of_a_checkpoints_config(
    tmp_path: Path, capsys: Any, value: Any
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": value,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    out = str(tmp_path / "p.json")
    assert main(["profile", "--model", str(folder), "--device", "h100", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve profile: error: model: ") and len(err.strip().splitlines()) == 1
    assert "config.json" in err or "num_layers" in err, err


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (("prefill: {count: 1}", "prefill: {count: 1000000}"), "regions[0].prefill.count"),
        (("slo:", "planner: {interval_s: 1.0e-9}\nslo:"), "planner.interval_s"),
    ],
)
def test_sim_refuses_a_cluster_it_could_not_simulate_in_bounded_time(
    tmp_path: Path, capsys: Any, edit: tuple[str, str], named: str
) -> None:
    flags = _flags("sim", tmp_path)
    config = Path(flags[1])
    config.write_text(config.read_text().replace(*edit))
    assert main(["sim", "--profile", str(SHIPPED), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{config}:" in err and named in err and len(err.strip().splitlines()) == 1, err
