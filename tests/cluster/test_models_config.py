"""The cluster YAML's models list and rollout section: parsed, and refused when wrong."""

from __future__ import annotations

import pytest

from pdserve.cluster.config import parse_config
from pdserve.cluster.fleet import canary_regions
from pdserve.core.errors import InvalidArgumentError

BASE = """\
model: builtin:tiny
name: tiny
regions:
  - name: east
    prefill: {count: 2, max: 4}
    decode: {count: 3, min: 2, max: 4}
  - name: west
models:
"""


def test_models_each_with_a_version_source_engine_and_pools() -> None:
    config = parse_config(
        BASE
        + """\
  - name: code
    model: registry:pycode@v7
    engine: {max_num_seqs: 8}
    regions:
      - name: west
        decode: {count: 1, min: 0}
rollout: {min_requests: 5, max_latency_regression: 0.25}
"""
    )
    assert config.router.model_name == "tiny" and config.version == "v1"
    (code,) = config.models
    assert (code.name, code.version, code.key) == ("code", "v7", "code@v7")
    sub = config.deployment(code)
    assert sub.model == "registry:pycode@v7" and sub.engine["max_num_seqs"] == 8
    assert [r.name for r in sub.regions] == ["west"] and (sub.planner.mode, sub.planner.policy) == (
        "advisory",
        "reactive",
    )
    assert config.rollout.min_requests == 5 and config.rollout.max_latency_regression == 0.25
    canary = canary_regions(config.regions)
    assert [(r.prefill.count, r.decode.count, r.decode.min) for r in canary] == [
        (1, 1, 1),
        (1, 1, 1),
    ]


@pytest.mark.parametrize(
    ("models", "message"),
    [
        (
            "  - {name: tiny, model: builtin:tiny, regions: [{name: east}]}",
            "duplicate model name 'tiny'",
        ),
        ("  - {name: a, model: builtin:tiny, regions: [{name: north}]}", "unknown region 'north'"),
        ("  - {name: a, model: builtin:tiny}", "at least one region"),
        ("  - {name: a, regions: [{name: east}]}", "models[0].model: required"),
        (
            "  - {name: a, model: builtin:tiny, regions: [{name: east}], colour: red}",
            "unknown field",
        ),
        (
            "  - {name: a, model: builtin:tiny, regions: [{name: east, latency_ms: {west: 5}}]}",
            "top-level regions",
        ),
        (
            "  - {name: a, model: builtin:tiny, engine: {max_num_seqs: 0}, regions: [{name: east}]}",
            "models[0].",
        ),
    ],
)
def test_bad_models_are_refused_naming_the_field(models: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        parse_config(BASE + models + "\n", "c.yaml")
    assert message in str(e.value) and "c.yaml:" in str(e.value), str(e.value)


def test_bad_rollout_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"rollout\.min_requests"):
        parse_config(BASE + "rollout: {min_requests: 0}\n")
    with pytest.raises(InvalidArgumentError, match=r"rollout\.speed"):
        parse_config(BASE + "rollout: {speed: 3}\n")
