"""Read PEFT LoRA adapters and give each targeted linear of a rank its slice.

An adapter is a folder with ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``) and ``adapter_model.safetensors`` whose keys look like
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``
(A: [r, in], B: [out, r], full size). Every rank reads the whole (small) file
and keeps the part its layers need (see ``lora.py`` for the per-rank shapes).

Adapters are read at start-up (:func:`attach_adapters`) and at runtime, each
into a slot (:func:`install_adapter`, :func:`remove_adapter`). An adapter that
does not fit is refused, at start-up or at a runtime load, with an error naming
the adapter and the field: a rank above ``max_lora_rank``, a target module the
model has no adapter path for, a tensor whose shape does not match the model,
or a PEFT feature pdserve does not run (DoRA, per-module ranks, trained bias or
extra modules).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from pdserve.core.adapters import fingerprint_of
from pdserve.core.config import EngineConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.models.layers import ColumnParallelLinear, RowParallelLinear
from pdserve.models.lora import LinearLoRA
from pdserve.models.transformer import CausalLM, DecoderLayer, DenseMLP

_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight"
)
# PEFT module name -> (linear of the decoder layer, shard of a fused column layer).
_MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter read from disk: ``pairs[(layer, module)] = (A, B * scale)``, full size."""

    name: str
    rank: int
    scale: float
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str  # of the bytes this read took (core.adapters.adapter_fingerprint)


def _fail(name: str, field: str, message: str) -> InvalidArgumentError:
    return InvalidArgumentError("lora_adapters", f"adapter {name!r}: {field}: {message}")


def _expected_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable projection, full size."""
    h, d, inter = model.hidden_size, model.head_dim, model.intermediate_size
    q, kv = model.num_heads * d, model.num_kv_heads * d
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def _read_config(
    name: str, folder: Path, max_rank: int, data: bytes | None
) -> tuple[int, float, set[str]]:
    if data is None:
        raise _fail(name, "folder", f"no adapter_config.json in {str(folder)!r}")
    cfg: dict[str, Any] = json.loads(data)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise _fail(name, "r", f"must be an integer >= 1, got {rank!r}")
    if not isinstance(alpha, int | float):
        raise _fail(name, "lora_alpha", f"must be a number, got {alpha!r}")
    if rank > max_rank:
        raise _fail(name, "r", f"rank {rank} exceeds max_lora_rank={max_rank}")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise _fail(name, key, f"is not supported (got {cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise _fail(name, "bias", f"only 'none' is supported, got {cfg['bias']!r}")
    given = cfg.get("target_modules") or []
    if given == "all-linear":
        given = list(_MODULES)
    targets = set([given] if isinstance(given, str) else given)
    unknown = sorted(targets - set(_MODULES))
    if unknown:
        raise _fail(name, "target_modules", f"{unknown} are not adaptable; use {sorted(_MODULES)}")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return rank, float(scale), targets


def read_adapter(name: str, folder: str | Path, max_rank: int, model: ModelConfig) -> PeftAdapter:
    """Read and check one PEFT adapter; the scale ``alpha / r`` is folded into B."""
    root = Path(folder)
    config_file = root / "adapter_config.json"
    config_bytes = config_file.read_bytes() if config_file.is_file() else None
    weights = {f.name: f.read_bytes() for f in sorted(root.glob("*.safetensors"))}
    fingerprint = fingerprint_of([(config_file.name, config_bytes), *weights.items()])
    rank, scale, targets = _read_config(name, root, max_rank, config_bytes)
    if model.is_moe and targets & set(_MLP):
        raise _fail(
            name, "target_modules", "the MLP of a mixture-of-experts model is not adaptable"
        )
    files = [f for f in weights if f.startswith("adapter_model")]
    if not files:
        raise _fail(name, "folder", f"no adapter_model.safetensors in {str(root)!r}")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for file in files:
        for key, tensor in load_safetensors(weights[file]).items():
            m = _KEY.fullmatch(key)
            if m is None or m.group(2) not in targets:
                raise _fail(
                    name, "target_modules", f"weight {key!r} is not an adaptable projection"
                )
            halves[(int(m.group(1)), m.group(2), m.group(3))] = tensor
    expected = _expected_shapes(model)
    pairs = {}
    for (layer, module, half), a in halves.items():
        if half != "A":
            continue
        b = halves.get((layer, module, "B"))
        out, inp = expected[module]
        if layer >= model.num_layers:
            raise _fail(name, "target_modules", f"layer {layer} >= the model's {model.num_layers}")
        if b is None or a.shape != (rank, inp) or b.shape != (out, rank):
            got = f"A {tuple(a.shape)}, B {None if b is None else tuple(b.shape)}"
            raise _fail(
                name, f"layers.{layer}.{module}", f"{got} do not fit [r={rank}, {inp}], [{out}, r]"
            )
        pairs[(layer, module)] = (a.float(), b.float() * scale)
    return PeftAdapter(name, rank, scale, pairs, fingerprint)


def _column_pair(
    layer: ColumnParallelLinear, parts: list[tuple[int, torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused column layer's (A stacked [sum r, in], B block-diagonal [out_local, sum r])."""
    a = torch.cat([p[1] for p in parts])
    b = torch.zeros(sum(layer.local_sizes), a.shape[0])
    col = 0
    for shard, _, full_b in parts:
        src, rows, dst = layer.shard_rows(shard)
        r = full_b.shape[1]
        b[dst : dst + rows, col : col + r] = full_b[src : src + rows]
        col += r
    return a, b


def _row_pair(
    layer: RowParallelLinear, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A row layer's (A's columns of this rank [r, in_local], B [out, r])."""
    start = layer.ctx.tp_rank * layer.local_in
    return a[:, start : start + layer.local_in], b


def _layer_pairs(
    layer: DecoderLayer, index: int, adapter: PeftAdapter
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (A, B) of each linear of one decoder layer the adapter targets."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    fused: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for module, (linear, shard) in _MODULES.items():
        pair = adapter.pairs.get((index, module))
        if pair is None:
            continue
        if linear in ("o_proj", "down"):
            row = layer.attn.o_proj if linear == "o_proj" else _dense(layer).down
            out[linear] = _row_pair(row, *pair)
        else:
            fused.setdefault(linear, []).append((shard, *pair))
    for linear, parts in fused.items():
        column = layer.attn.qkv if linear == "qkv" else _dense(layer).gate_up
        out[linear] = _column_pair(column, parts)
    return out


def _dense(layer: DecoderLayer) -> DenseMLP:
    assert isinstance(layer.mlp, DenseMLP)
    return layer.mlp


def attach_adapters(
    model: CausalLM, config: EngineConfig
) -> tuple[list[str | None], dict[str, str]]:
    """Read every start-up adapter and hang each linear's share on it (``linear.lora``),
    adapter ``i`` in slot ``i`` of ``max_loras``; returns each slot's adapter (None: free)
    and each adapter's fingerprint, of the bytes this rank read."""
    fingerprints = {}
    for slot, (name, folder) in enumerate(config.lora_adapters):
        adapter = read_adapter(name, folder, config.max_lora_rank, model.config)
        install_adapter(model, slot, adapter, config.max_loras)
        fingerprints[name] = adapter.fingerprint
    slots: list[str | None] = [name for name, _ in config.lora_adapters]
    return slots + [None] * (config.max_loras - len(slots)), fingerprints


def _linears(layer: DecoderLayer) -> dict[str, ColumnParallelLinear | RowParallelLinear]:
    """The linears of a decoder layer that may carry adapters, by ``_MODULES`` name."""
    linears: dict[str, ColumnParallelLinear | RowParallelLinear] = {
        "qkv": layer.attn.qkv,
        "o_proj": layer.attn.o_proj,
    }
    if isinstance(layer.mlp, DenseMLP):
        linears.update(gate_up=layer.mlp.gate_up, down=layer.mlp.down)
    return linears


def install_adapter(model: CausalLM, slot: int, adapter: PeftAdapter, capacity: int) -> None:
    """Hold ``adapter`` in ``slot`` of each linear of this rank's layers that it targets."""
    weight = next(model.parameters())
    for offset, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        pairs = _layer_pairs(layer, model.layer_start + offset, adapter)
        for key, linear in _linears(layer).items():
            if key not in pairs:
                continue
            if linear.lora is None:
                linear.lora = LinearLoRA([None] * capacity)
            linear.lora.weights[slot] = _like(pairs[key], weight)


def remove_adapter(model: CausalLM, slot: int) -> None:
    """Drop whatever adapter ``slot`` holds from every linear (its memory is freed)."""
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        for linear in _linears(layer).values():
            if linear.lora is None:
                continue
            linear.lora.weights[slot] = None
            if all(w is None for w in linear.lora.weights):
                linear.lora = None


def _like(
    pair: tuple[torch.Tensor, torch.Tensor], weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = pair
    return a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype).contiguous()
