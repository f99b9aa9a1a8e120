"""The built-in model is generated deterministically and is a valid HF checkpoint."""

from __future__ import annotations

import hashlib
import json

from pdserve.core.model_config import ModelConfig
from pdserve.core.tokenizer import Tokenizer
from pdserve.models.builtin import BUILTIN_MODELS, write_builtin


def digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_generation_is_deterministic(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_builtin(BUILTIN_MODELS["tiny"], a)
    write_builtin(BUILTIN_MODELS["tiny"], b)
    assert digest(a) == digest(b)
    assert set(digest(a)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_cached_model_is_reused(tiny_path) -> None:
    from pdserve.models.builtin import resolve_model

    before = (tiny_path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("builtin:tiny") == tiny_path
    assert (tiny_path / "model.safetensors").stat().st_mtime_ns == before


def test_config_and_tokenizer_agree(tiny_path) -> None:
    config = ModelConfig.from_dir(tiny_path)
    tok = Tokenizer.from_dir(tiny_path)
    assert config.vocab_size == tok.vocab_size
    assert config.num_kv_heads < config.num_heads  # GQA
    assert config.rope.kind == "llama3"
    assert config.eos_token_ids == tok.eos_token_ids
    assert "random weights" in json.loads((tiny_path / "config.json").read_text())["pdserve_note"]
    text = 'Hello, wörld! 東京 {"a": 1}'
    ids = tok.encode(text)
    assert ids[0] == config.bos_token_id
    assert tok.decode(ids) == text


def test_chat_template_renders(tiny_path) -> None:
    tok = Tokenizer.from_dir(tiny_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|begin_of_text|><|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.token_id("<|user|>") in ids
