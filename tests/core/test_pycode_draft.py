"""builtin:pycode-draft: shipped, small, the tokenizer of builtin:pycode, and trained.

No training here: the checks read the committed checkpoint and its record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.model_config import ModelConfig
from pdserve.models.builtin import builtin_names, resolve_model
from pdserve.models.pycode_train import PRESETS, parse_args
from tests.reference import hf_greedy

# The shipped draft scores about 147 per token on every held-out token; the same
# shape with random weights scores near the vocabulary size (4096).
MAX_HELD_OUT_PERPLEXITY = 250.0


@pytest.fixture(scope="module")
def draft() -> Path:
    return resolve_model("builtin:pycode-draft")


def test_ships_beside_pycode_with_its_tokenizer(draft: Path) -> None:
    assert "builtin:pycode-draft" in builtin_names()
    target = resolve_model("builtin:pycode")
    config, target_config = ModelConfig.from_dir(draft), ModelConfig.from_dir(target)
    assert config.vocab_size == target_config.vocab_size
    assert config.num_layers < target_config.num_layers
    assert config.hidden_size < target_config.hidden_size
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    assert (draft / "model.safetensors").stat().st_size < 3 << 20
    assert {"README.md", "loss.png", "training.json"} <= {p.name for p in draft.iterdir()}


def test_was_trained_by_the_draft_preset(draft: Path) -> None:
    record = json.loads((draft / "training.json").read_text())
    assert "--preset draft" in record["command"]
    preset = parse_args(["--preset", "draft", "--out", "x"])
    for name, value in PRESETS["draft"].items():
        assert getattr(preset, name) == value
        if name not in ("steps", "minutes", "eval_every"):  # the run's budget may be changed
            assert record["config"][name] == value, name
    assert record["training"]["loop_wall_s"] <= 8 * 60
    assert record["result"]["held_out_perplexity"] < MAX_HELD_OUT_PERPLEXITY


def test_greedy_matches_transformers(draft: Path) -> None:
    llm = LLM("builtin:pycode-draft")
    assert llm.tokenizer is not None
    prompts = [llm.tokenizer.encode(p) for p in ("def main():", "import os\nimport ")]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert got == hf_greedy(draft, prompts, max_new_tokens=12)
