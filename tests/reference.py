"""Reference checkpoints and outputs from Hugging Face ``transformers``.

Each spec is a tiny randomly initialised model of one family, saved as
safetensors next to the built-in tokenizer (so text prompts work too). The
reference output is ``transformers``' own greedy ``generate``, one prompt at a
time (no padding), with EOS disabled so every run yields the same count.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.models.builtin import resolve_model

MAX_NEW_TOKENS = 12


@dataclass(frozen=True)
class ReferenceSpec:
    family: str
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    max_shard_size: str | None = None


_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
)

REFERENCE_SPECS = {
    # GQA, llama3 RoPE scaling, tied embeddings, checkpoint split over several files.
    "llama": ReferenceSpec(
        "llama",
        options=dict(
            _COMMON,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        max_shard_size="100KB",
    ),
    # Untied embeddings, one KV head (MQA), plain RoPE.
    "llama_untied": ReferenceSpec(
        "llama", seed=1, options=dict(_COMMON, num_key_value_heads=1, tie_word_embeddings=False)
    ),
    "qwen2": ReferenceSpec("qwen2", seed=2, options=dict(_COMMON, tie_word_embeddings=False)),
    "mixtral": ReferenceSpec(
        "mixtral",
        seed=3,
        options=dict(
            _COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        ),
    ),
}


def build_reference_model(spec: ReferenceSpec, folder: Path) -> None:
    import transformers

    tokenizer_dir = resolve_model("builtin:tiny")
    vocab = _vocab_size(tokenizer_dir)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[spec.family]
    torch.manual_seed(spec.seed)
    config = config_cls(vocab_size=vocab, **spec.options)
    model = model_cls(config).eval()
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)


def _vocab_size(tokenizer_dir: Path) -> int:
    from pdserve.core.tokenizer import Tokenizer

    return Tokenizer.from_dir(tokenizer_dir).vocab_size


def hf_greedy(
    folder: Path,
    prompts: list[list[int]],
    max_new_tokens: int = MAX_NEW_TOKENS,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (``options``: more of generate's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            gen = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),  # id 0 is a real token here
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                **options,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def parity_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Ten prompts: four share a 70-token prefix, two are long enough to be chunked."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    shared = tokens(70)
    return [
        shared + tokens(5),
        tokens(3),
        shared + tokens(30),
        tokens(150),
        shared + tokens(1),
        tokens(17),
        tokens(1),
        shared + tokens(48),
        tokens(260),
        tokens(33),
    ]
