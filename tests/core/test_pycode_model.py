"""builtin:pycode: the shipped checkpoint loads, matches transformers, and is trained.

No training here: the checks read the committed checkpoint and its record.
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.core.model_config import ModelConfig
from pdserve.core.tokenizer import Tokenizer
from pdserve.models.builtin import resolve_model
from pdserve.models.pycode_train import is_held_out
from tests.reference import hf_greedy

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def push(self, item):",
    "import os\nimport sys\n\n\ndef main():",
]
# Per-token perplexity on held-out files. The shipped model scores about 72 on
# every held-out token and about 110 on the first 128 tokens of each file
# (licence headers and docstrings); the same shape with random weights scores
# about 4200, near the vocabulary size (4096).
MAX_HELD_OUT_PERPLEXITY = 100.0
MAX_FILE_START_PERPLEXITY = 200.0


@pytest.fixture(scope="module")
def pycode() -> Path:
    return resolve_model("builtin:pycode")


@pytest.fixture(scope="module")
def record(pycode: Path) -> dict:
    return json.loads((pycode / "training.json").read_text())


def test_resolves_to_the_shipped_checkpoint(pycode: Path, record: dict) -> None:
    config = ModelConfig.from_dir(pycode)
    assert config.family == "llama" and config.tie_word_embeddings
    assert config.dtype == "float32" and config.vocab_size == 4096
    assert (pycode / "model.safetensors").stat().st_size < 16 << 20
    assert {"README.md", "loss.png", "tokenizer.json"} <= {p.name for p in pycode.iterdir()}
    assert record["result"]["held_out_perplexity"] < MAX_HELD_OUT_PERPLEXITY


def test_greedy_matches_transformers(pycode: Path) -> None:
    llm = LLM("builtin:pycode")
    token_prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    reference = hf_greedy(pycode, token_prompts, max_new_tokens=16)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    llm.engine.assert_idle()


def test_held_out_perplexity_is_far_below_chance(pycode: Path, record: dict) -> None:
    from transformers import AutoModelForCausalLM

    names = record["data"]["held_out_files"]
    every = record["config"]["held_out_every"]
    assert names and all(is_held_out(n, every) for n in names)
    root = Path(sysconfig.get_paths()["stdlib"])
    tok = Tokenizer.from_dir(pycode)
    windows = [tok.encode((root / n).read_text("utf-8", "replace"))[:129] for n in names]
    windows = [w for w in windows if len(w) == 129][:8]  # files this Python has, long enough
    assert len(windows) >= 4
    model = AutoModelForCausalLM.from_pretrained(pycode, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor(windows)  # [N, 129]
        logits = model(ids[:, :-1]).logits  # [N, 128, V]
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    assert math.exp(loss.item()) < MAX_FILE_START_PERPLEXITY
