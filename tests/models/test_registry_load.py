"""A registry version is checked by content where its weights are loaded (each rank,
scale-up and replacement), against the hash the controller resolved; the node's shared
weights file is keyed by that hash and is this user's alone."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from pdserve.core import registry
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.distributed.context import ParallelContext
from pdserve.kernels.attention import select_backend
from pdserve.models.builtin import resolve_model
from pdserve.models.families import build_model
from pdserve.models.loader import load_checkpoint
from tests.core.test_registry import _tamper_keeping_stats


@pytest.fixture
def version(tmp_path, monkeypatch, tiny_path) -> ModelConfig:
    """``registry:tiny@v1`` as the controller resolved it (the config ranks are given)."""
    monkeypatch.setenv("PDSERVE_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.setenv("PDSERVE_WEIGHTS_CACHE", str(tmp_path / "weights"))
    registry.push("tiny", "v1", tiny_path)
    return ModelConfig.from_dir(resolve_model("registry:tiny@v1"))


def _load(config: ModelConfig) -> torch.nn.Module:
    """What a rank does with the config it is given."""
    backend = select_backend("torch", torch.device("cpu"))
    model = build_model(config, ParallelContext(), torch.float32, (0, config.num_layers), backend)
    load_checkpoint(model, config.path, config.sha256)
    return model


def test_a_rank_refuses_a_version_changed_after_it_was_resolved(version) -> None:
    _load(version)  # a first instance: its weights are now in the node's cache
    _tamper_keeping_stats(Path(version.path) / "model.safetensors")
    with pytest.raises(InvalidArgumentError, match=r"model\.safetensors does not match its hash"):
        _load(version)  # a scale-up or replacement, given the same config


def test_a_rank_refuses_a_version_whose_manifest_was_rewritten_to_match(version) -> None:
    folder = Path(version.path)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    manifest = json.loads((folder / registry.MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = registry.file_sha256(weights)
    manifest["sha256"] = registry._content_hash(manifest["files"])
    (folder / registry.MANIFEST).write_text(json.dumps(manifest))
    registry.verify(folder)  # consistent with itself now
    with pytest.raises(InvalidArgumentError, match="manifest changed since it was resolved"):
        _load(version)


def test_shared_weights_are_keyed_by_content_and_private(version, tmp_path) -> None:
    first = _load(version)
    cache = tmp_path / "weights"
    (weights,) = cache.glob("*.bin")
    # The same bytes with other stats: the same file serves them.
    os.utime(Path(version.path) / "model.safetensors", ns=(1, 1))
    weights.chmod(0o644)  # as an older pdserve left it: narrowed at the next load
    second = _load(version)
    assert [p.name for p in cache.glob("*.bin")] == [weights.name]
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    for path in cache.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name


def test_an_expert_re_placement_refuses_a_changed_version(
    tmp_path, monkeypatch, references
) -> None:
    from pdserve.parallel.expert_slots import moe_layers, reload_slots

    folder, _, _ = references("mixtral")
    monkeypatch.setenv("PDSERVE_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.setenv("PDSERVE_SHARE_WEIGHTS", "0")
    registry.push("moe", "v1", folder)
    config = ModelConfig.from_dir(resolve_model("registry:moe@v1"))
    model = _load(config)
    stale = {moe: {0} for moe in moe_layers(model, 0).values()}
    reload_slots(model, config.path, stale)  # EPLB reads slot 0's expert again: intact
    (weights,) = Path(config.path).glob("*.safetensors")
    _tamper_keeping_stats(weights)
    with pytest.raises(InvalidArgumentError, match="does not match its hash"):
        reload_slots(model, config.path, stale)
