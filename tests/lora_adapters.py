"""Random PEFT LoRA adapters over a reference checkpoint, and transformers' tokens with each.

PEFT initialises B to zero (a fresh adapter changes nothing), so every LoRA
weight is drawn at random. The reference is ``transformers`` with the adapter
merged into the weights (``merge_and_unload``), saved as a plain checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.reference import hf_greedy

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    r: int
    alpha: int
    targets: tuple[str, ...]
    seed: int


ADAPTERS = (
    AdapterSpec("qv", 4, 8, ("q_proj", "v_proj"), 10),
    AdapterSpec("all", 8, 16, tuple(ATTENTION + MLP), 11),
    AdapterSpec("mixed", 2, 6, ("k_proj", "o_proj", "gate_proj", "down_proj"), 12),
)


def make_adapter(base: Path, spec: AdapterSpec, folder: Path) -> None:
    """Save a PEFT adapter of ``spec`` with random A and B for the checkpoint in ``base``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets))
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(folder)


def merged_greedy(
    base: Path, adapter: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens with ``adapter`` merged into the base weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = adapter.parent / f"{adapter.name}-merged"
    merged.save_pretrained(out)
    return hf_greedy(out, prompts, max_new_tokens=max_new_tokens)


def build_lora_case(reference_models, tmp_path_factory, new_tokens: int):
    """(base folder, adapters {name: folder}, prompts, tokens {None or name: per prompt}):
    every adapter of :data:`ADAPTERS` over the llama reference, and transformers' tokens."""
    from pdserve.core.model_config import ModelConfig
    from tests.reference import parity_prompts

    base = reference_models("llama")
    prompts = parity_prompts(ModelConfig.from_dir(base).vocab_size)[:4]
    root = tmp_path_factory.mktemp("lora")
    adapters: dict[str, str] = {}
    tokens: dict[str | None, list[list[int]]] = {
        None: hf_greedy(base, prompts, max_new_tokens=new_tokens)
    }
    for spec in ADAPTERS:
        folder = root / spec.name
        make_adapter(base, spec, folder)
        adapters[spec.name] = str(folder)
        tokens[spec.name] = merged_greedy(base, folder, prompts, new_tokens)
    return base, adapters, prompts, tokens
