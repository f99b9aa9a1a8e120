"""What pdserve needs to know about a model, read from a Hugging Face checkpoint folder.

`ModelConfig.from_dir` parses ``config.json`` (and ``generation_config.json`` when
present) into one frozen dataclass. It reads both spellings of RoPE settings:
``rope_scaling`` plus a top-level ``rope_theta`` (released Llama 3.x checkpoints)
and ``rope_parameters`` with ``rope_theta`` inside (written by transformers 5).
Nothing here touches weights; :mod:`pdserve.models.loader` does that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.core import registry
from pdserve.core.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedError

# Architecture name in config.json -> model family implemented in pdserve.models.families.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}

_DTYPE_NAMES = {"float32", "bfloat16", "float16"}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. ``kind`` is "default", "linear" or "llama3"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise UnsupportedError(f"rope type {self.kind!r} is not supported")
        if self.theta <= 0:
            raise InvalidArgumentError("rope_theta", f"must be > 0, got {self.theta}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of one decoder-only transformer checkpoint."""

    path: str
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str
    num_experts: int = 0
    num_experts_per_tok: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    # A registry version's content hash, as its manifest read here had it ("": not a
    # registry version); every process that loads the weights checks the files
    # against it (pdserve.core.registry).
    sha256: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                "num_key_value_heads",
                f"{self.num_kv_heads} does not divide num_attention_heads={self.num_heads}",
            )
        if self.dtype not in _DTYPE_NAMES:
            raise InvalidArgumentError("dtype", f"must be one of {sorted(_DTYPE_NAMES)}")
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise InvalidArgumentError(
                "num_experts_per_tok",
                f"must be in [1, num_local_experts={self.num_experts}]",
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int = 1) -> int:
        """Bytes of K and V one token occupies on one rank, over all layers."""
        local_kv_heads = max(1, self.num_kv_heads // tp_size)
        return 2 * self.num_layers * local_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError("model", f"no config.json in {str(folder)!r}")
        try:
            raw = json.loads(config_file.read_text())
            generation = {}
            gen_file = folder / "generation_config.json"
            if gen_file.is_file():
                generation = json.loads(gen_file.read_text())
            config = cls.from_hf_dict(raw, str(folder), generation)
        except InvalidArgumentError:
            raise
        except KeyError as e:  # a value every config names
            raise InvalidArgumentError(f"{config_file}: {e.args[0]}", "is missing") from None
        except (TypeError, ValueError, OverflowError, AttributeError, RecursionError) as e:
            # not JSON, or a value of the wrong type (int("x"), int(None), int(nan))
            raise InvalidArgumentError(str(config_file), f"malformed: {e}") from None
        return replace(config, sha256=registry.content_hash(folder))

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], path: str, generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedError(
                f"architectures {archs} in {path}/config.json: pdserve supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden // heads
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"hidden_act {act!r} (only 'silu' is supported)")
        if raw.get("use_sliding_window") or (
            family == "llama" and raw.get("sliding_window") is not None
        ):
            raise UnsupportedError("sliding-window attention is not supported")
        eos = _eos_ids((generation or {}).get("eos_token_id", raw.get("eos_token_id")))
        return cls(
            path=path,
            architecture=arch,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            dtype=_dtype_name(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            num_experts=int(raw.get("num_local_experts", 0)) if family == "mixtral" else 0,
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
        )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype_name(value: str) -> str:
    name = str(value).removeprefix("torch.")
    return {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    max_pos = int(raw.get("max_position_embeddings", 8192))
    return RopeConfig(
        theta=float(theta),
        kind=str(kind),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_pos)
        ),
    )
