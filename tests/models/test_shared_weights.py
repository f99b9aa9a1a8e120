"""Weights shared between a node's instances: one file per (checkpoint, rank layout),
mapped by every instance; the same outputs as a plain load, and a new file when the
checkpoint or the layout changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.core.model_config import ModelConfig
from pdserve.distributed.context import ParallelContext
from pdserve.kernels.attention import select_backend
from pdserve.models.builtin import resolve_model
from pdserve.models.families import build_model
from pdserve.models.loader import load_checkpoint


def _model(config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    backend = select_backend("torch", torch.device("cpu"))
    ctx = ParallelContext(tp_rank=tp_rank, tp_size=tp_size)
    model = build_model(config, ctx, torch.float32, (0, config.num_layers), backend)
    load_checkpoint(model, config.path)
    return model


def test_instances_map_one_file_and_equal_a_plain_load(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_WEIGHTS_CACHE", str(tmp_path))
    config = ModelConfig.from_dir(resolve_model("builtin:tiny"))
    first, second = _model(config), _model(config)
    files = sorted(p.name for p in tmp_path.glob("*.bin"))
    assert len(files) == 1  # written once, mapped twice
    monkeypatch.setenv("PDSERVE_SHARE_WEIGHTS", "0")
    plain = _model(config)
    for (name, a), b, c in zip(
        first.named_parameters(), second.parameters(), plain.parameters(), strict=True
    ):
        assert torch.equal(a, c) and torch.equal(b, c), name
        assert a.data_ptr() != b.data_ptr()  # two mappings of the same pages
    size = os.path.getsize(tmp_path / files[0])
    assert size >= sum(p.numel() * 4 for p in plain.parameters())
    monkeypatch.setenv("PDSERVE_SHARE_WEIGHTS", "1")
    _model(config, tp_rank=1, tp_size=2)  # another layout: a file of its own
    assert len(list(tmp_path.glob("*.bin"))) == 2


def test_a_damaged_manifest_is_rewritten(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_WEIGHTS_CACHE", str(tmp_path))
    config = ModelConfig.from_dir(resolve_model("builtin:tiny"))
    _model(config)
    (meta,) = tmp_path.glob("*.json")
    meta.write_text("{not json")
    model = _model(config)
    assert meta.read_text().startswith("[")
    monkeypatch.setenv("PDSERVE_SHARE_WEIGHTS", "0")
    for a, b in zip(model.parameters(), _model(config).parameters(), strict=True):
        assert torch.equal(a, b)


def _cached_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """(the tiny model, a copy of it whose weights are now in the cache, the cache)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_WEIGHTS_CACHE", str(cache))
    source = resolve_model("builtin:tiny")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    _model(ModelConfig.from_dir(copy))
    return source, copy, cache


def test_files_of_deleted_checkpoints_are_removed(tmp_path, monkeypatch) -> None:
    source, copy, cache = _cached_copy(tmp_path, monkeypatch)
    assert len(list(cache.glob("*.bin"))) == 1
    shutil.rmtree(copy)
    _model(ModelConfig.from_dir(source))  # writing another file prunes the gone one's
    assert len(list(cache.glob("*.bin"))) == 1


def test_a_record_being_written_is_not_taken_for_a_gone_checkpoint(tmp_path, monkeypatch) -> None:
    # The lock is per file: one rank may prune while another (its own lock held)
    # writes its record. Read half-written, the record once read as "checkpoint
    # gone" and the other rank's weights file was removed before it mapped it.
    source, _, cache = _cached_copy(tmp_path, monkeypatch)
    (src,) = cache.glob("*.src")
    src.write_text("")  # as the other rank's record looks while it is written
    _model(ModelConfig.from_dir(source))  # writes a second file and prunes
    assert src.with_suffix(".bin").is_file() and src.with_suffix(".json").is_file()
    assert len(list(cache.glob("*.bin"))) == 2
