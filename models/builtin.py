"""Built-in models (``builtin:tiny``, ``builtin:small``, ``builtin:pycode``,
``builtin:pycode-draft``) and model-name resolution.

``builtin:tiny`` and ``builtin:small`` are Llama-shaped checkpoints with **random
weights** and a real byte-level BPE tokenizer trained on a short text shipped
with pdserve. They are generated deterministically on first use and cached
(``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``), so the tests and the
benchmarks need no download. Their output is random text: the weights were
never trained.

``builtin:pycode`` is trained (on the Python standard library's source, by
``pdserve.models.pycode_train``) and ships inside the package as a checkpoint
folder (``models/data/pycode``, ``TRAINED_MODELS``); it is returned as it is. So is
``builtin:pycode-draft``, a much smaller model with the same tokenizer, trained
the same way as the draft model of speculative decoding for ``builtin:pycode``.

Each of them is an ordinary Hugging Face checkpoint folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``), loadable by ``transformers`` as well.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.core import registry
from pdserve.core.errors import ModelNotFoundError
from pdserve.core.private_files import cache_dir, make_private, private_dir

if TYPE_CHECKING:
    import torch

GENERATOR_VERSION = 1
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class BuiltinSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_target: int = 2048
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    seed: int = 0
    # Wide enough that greedy output varies with the prompt (0.02 repeats one token).
    init_std: float = 0.1


BUILTIN_MODELS = {
    "tiny": BuiltinSpec(
        hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=704
    ),
    "small": BuiltinSpec(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408, seed=1
    ),
}


# Trained built-in models: package data folders of pdserve.core.
TRAINED_MODELS = {"pycode": "data/pycode", "pycode-draft": "data/pycode-draft"}


TRAIN_OPTIONS = {"pycode": "", "pycode-draft": "--preset draft "}  # how each is trained


def builtin_names() -> list[str]:
    return sorted("builtin:" + n for n in [*BUILTIN_MODELS, *TRAINED_MODELS])


def resolve_model(name_or_path: str) -> Path:
    """Checkpoint folder for a path, a ``builtin:<name>`` (generated on first use) or a
    ``registry:<name>@<version>`` (checked against its recorded hashes)."""
    if name_or_path.startswith("builtin:"):
        return ensure_builtin(name_or_path.removeprefix("builtin:"))
    if name_or_path.startswith(registry.PREFIX):
        return registry.resolve(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            "model",
            f"{name_or_path!r} is not a checkpoint folder (no config.json) nor one of "
            f"{builtin_names()}",
        )
    return path


def ensure_builtin(name: str) -> Path:
    if name in TRAINED_MODELS:
        return packaged_builtin(name)
    if name not in BUILTIN_MODELS:
        raise ModelNotFoundError(
            "model", f"unknown built-in model {name!r}; known: {builtin_names()}"
        )
    target = cache_dir() / f"builtin-{name}-v{GENERATOR_VERSION}"
    if (target / "model.safetensors").is_file():
        return make_private(target)  # one written before its weights were kept private
    private_dir(target.parent)
    # Build in a private folder and rename, so concurrent first uses never see
    # a half-written checkpoint. Its weights stay this user's alone (0600 in 0700).
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write_builtin(BUILTIN_MODELS[name], tmp)
        make_private(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def packaged_builtin(name: str) -> Path:
    """The checkpoint folder of a trained built-in model, shipped with pdserve."""
    folder = Path(str(resources.files("pdserve.models") / TRAINED_MODELS[name]))
    if not (folder / "model.safetensors").is_file():
        raise ModelNotFoundError(
            "model",
            f"builtin:{name} is missing from this installation ({folder} has no "
            f"model.safetensors); reinstall pdserve, or train it with "
            f"python -m pdserve.models.pycode_train {TRAIN_OPTIONS[name]}--out {folder}",
        )
    return folder


def train_tokenizer(vocab_size: int, texts: Iterable[str] | None = None) -> Tokenizer:
    """Byte-level BPE over ``texts`` (default: the lines of the shipped tiny corpus)."""
    if texts is None:
        corpus = resources.files("pdserve.models").joinpath("data/tiny_corpus.txt")
        texts = corpus.read_text("utf-8").splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_builtin(spec: BuiltinSpec, folder: Path) -> None:
    tok = train_tokenizer(spec.vocab_target)
    vocab = tok.get_vocab_size()
    bos, eos = write_tokenizer_files(tok, folder, spec.max_position_embeddings)
    config = hf_config(spec, vocab, bos, eos)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import save_file  # torch only where a model is generated

    save_file(
        _random_weights(spec, vocab), str(folder / "model.safetensors"), metadata={"format": "pt"}
    )


def write_tokenizer_files(
    tok: Tokenizer, folder: Path, model_max_length: int
) -> tuple[int | None, int | None]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.

    Returns the (BOS, EOS) token ids.
    """
    tok.save(str(folder / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2)
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": model_max_length,
            },
            indent=2,
        )
    )
    return bos, eos


def hf_config(spec: BuiltinSpec, vocab: int, bos: int | None, eos: int | None) -> dict[str, object]:
    """The Hugging Face ``config.json`` of a Llama-shaped built-in model."""
    head_dim = spec.hidden_size // spec.num_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "rope_theta": 500000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "pdserve_note": "random weights, generated by pdserve; not a trained model",
    }


def _random_weights(spec: BuiltinSpec, vocab: int) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, d = spec.hidden_size, spec.hidden_size // spec.num_heads

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * spec.init_std

    weights = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h)}
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(vocab, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(spec.num_heads * d, h)
        weights[p + "self_attn.k_proj.weight"] = normal(spec.num_kv_heads * d, h)
        weights[p + "self_attn.v_proj.weight"] = normal(spec.num_kv_heads * d, h)
        weights[p + "self_attn.o_proj.weight"] = normal(h, spec.num_heads * d)
        weights[p + "mlp.gate_proj.weight"] = normal(spec.intermediate_size, h)
        weights[p + "mlp.up_proj.weight"] = normal(spec.intermediate_size, h)
        weights[p + "mlp.down_proj.weight"] = normal(h, spec.intermediate_size)
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return weights
