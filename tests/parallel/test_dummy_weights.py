"""``load_format: dummy`` (a model's shape from config.json alone) and the CUDA graphs'
bucketing, on the CPU; the graphs themselves run in tests/parallel/test_cuda.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.bench.gpu import LLAMA3_8B
from pdserve.core.config import build_engine_config
from pdserve.core.errors import InvalidArgumentError, ModelNotFoundError
from pdserve.core.model_config import ModelConfig
from pdserve.parallel.cuda_graphs import batch_buckets, context_bound
from pdserve.parallel.model_runner import ModelRunner
from pdserve.sim.profile import load_profile

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "max_position_embeddings": 2048,
}


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    """Llama-3-8B's config.json shrunk to a few layers, and no weights beside it."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, **SMALL}))
    return tmp_path


def runner(folder: Path, **options: object) -> ModelRunner:
    config = build_engine_config(str(folder), device="cpu", dtype="float32", **options)
    return ModelRunner(ModelConfig.from_dir(folder), config)


def test_dummy_weights_are_seeded_and_fill_every_matrix(config_only: Path) -> None:
    a, b = (runner(config_only, load_format="dummy", seed=3) for _ in range(2))
    c = runner(config_only, load_format="dummy", seed=4)
    for (name, pa), pb, pc in zip(
        a.model.named_parameters(), b.model.parameters(), c.model.parameters(), strict=True
    ):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name
            assert 0.01 < pa.float().std().item() < 0.03, name


def test_without_dummy_a_folder_without_weights_is_refused(config_only: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        runner(config_only)
    with pytest.raises(InvalidArgumentError, match="load_format"):
        build_engine_config(str(config_only), load_format="random")


def test_profile_of_a_config_only_model(config_only: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from pdserve.deploy.cli import main

    out = tmp_path / "p.json"
    flags = ["--load-format", "dummy", "--repeats", "1", "--out", str(out)]
    assert main(["profile", "--model", str(config_only), *flags]) == 0
    profile = load_profile(out)
    assert profile.source == "measured" and profile.model.num_layers == 2
    assert "--load-format dummy" in profile.command
    assert {s.phase for s in profile.samples} == {"prefill", "decode"}


def test_graph_buckets_and_context_bounds() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert [context_bound(n, 4096) for n in (1, 256, 257, 3000, 5000)] == [
        256,
        256,
        512,
        4096,
        4096,
    ]


def test_no_graphs_off_cuda(config_only: Path) -> None:
    r = runner(config_only, load_format="dummy")
    r.allocate_kv(8)
    assert r.graphs is None
