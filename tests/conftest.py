"""Shared fixtures: a private model cache, reference models and outputs from transformers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Built-in models are generated into a cache private to this test session.
os.environ.setdefault("PDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pdserve-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each CPU rank a test starts zeroes its KV pool up front: 256 MiB by default, ~0.45
# CPU-s on a 2-core VM, for tests whose requests fill a few pages of it. A test that
# needs a pool of a given size names it in its config (which wins over this).
os.environ.setdefault("PDSERVE_CPU_KV_CACHE_BYTES", str(32 << 20))


# `make test` runs the tests that start Ray or a whole cluster one after another in a
# lane, the rest beside them (tests/lanes.py).
def starts_a_cluster(item: pytest.Item) -> bool:
    return "ray_session" in getattr(item, "fixturenames", ()) or "e2e" in item.path.parts


def pytest_itemcollected(item: pytest.Item) -> None:
    if starts_a_cluster(item):
        item.add_marker(pytest.mark.cluster)
    if item.path.name == "test_readme.py":
        item.add_marker(pytest.mark.readme)


# Tests that judge a real cluster's timings against the simulator's run first in their
# pytest process. In `make test`'s cluster lane that is while the rest lane runs mypy and
# the unit tests (one steady core, at a lower priority: tests/lanes.py) rather than its
# bursts of rank and node start-ups: a calibration run of a few requests that met such a
# burst set a per-request overhead of 99 ms, and its point's TTFT p50 was simulated 85%
# high (test_calibrate_cluster.py's cluster, calibrated alone three times: 12-16 ms).
TIMED = (
    "test_validation.py",
    "test_calibrate_cluster.py",
    "test_replay_live.py",
    "test_plan_check.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in TIMED)  # stable: files stay whole


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from pdserve.models.builtin import resolve_model

    return resolve_model("builtin:tiny")


@pytest.fixture(scope="session")
def reference_models(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``reference_models(name)`` -> folder of a tiny transformers checkpoint."""
    from tests.reference import REFERENCE_SPECS, build_reference_model

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            build_reference_model(REFERENCE_SPECS[name], folder)
            built[name] = folder
        return built[name]

    return get


@pytest.fixture(scope="session")
def references(reference_models):
    """Factory: ``references(name)`` -> (checkpoint folder, parity prompts, transformers' tokens).

    The tokens are ``transformers``' greedy continuation of each prompt, computed
    once per model for the whole session.
    """
    from pdserve.core.model_config import ModelConfig
    from tests.reference import hf_greedy, parity_prompts

    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(name: str) -> tuple[Path, list[list[int]], list[list[int]]]:
        if name not in cache:
            folder = reference_models(name)
            prompts = parity_prompts(ModelConfig.from_dir(folder).vocab_size)
            cache[name] = (folder, prompts, hf_greedy(folder, prompts))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs actors; shut down at the end."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
