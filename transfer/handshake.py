"""The compatibility check a prefill and a decode instance make when they pair.

Each side describes its KV cache in a :class:`KVSpec`. KV pages move between
them only if the model (its config and weights), the dtype, the weight
quantization (KV computed from int8 weights differs from float KV), the LoRA
adapters both hold (same name, same content: a request's KV is computed under
its adapter on the prefill side and extended under the same name on the decode
side) and the page
size agree; parallel layouts may differ (the transfer layer re-shards heads and
layers). A mismatch is refused with both sides' values, before any page moves:
never wrong output. Once they agree, each decode rank tells the prefill ranks how to
reach its cache (a :class:`PeerEndpoint`).

Light on purpose (no torch): the controller that pairs instances reads both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.core.adapters import adapter_fingerprint
from pdserve.core.errors import PdserveError
from pdserve.core.layout import Layout


class IncompatibleInstancesError(PdserveError):
    """A prefill and a decode instance cannot exchange KV pages."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 409


@dataclass(frozen=True)
class KVSpec:
    instance_id: str
    model_fingerprint: str
    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: Layout
    quantization: str = "none"
    # (name, content hash) of each LoRA adapter served, from adapter_fingerprints().
    lora_adapters: tuple[tuple[str, str], ...] = ()


def model_fingerprint(folder: str | Path) -> str:
    """Hash of config.json and the start of every weight file: same checkpoint, same hash."""
    root = Path(folder)
    h = hashlib.sha256()
    config = json.loads((root / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    for file in sorted(root.glob("*.safetensors")):
        with file.open("rb") as f:
            h.update(file.name.encode())
            h.update(f.read(1 << 16))
    return h.hexdigest()[:24]


def adapter_fingerprints(adapters: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """(name, hash of adapter_config.json and the weight files) of each (name, folder)."""
    return tuple((name, adapter_fingerprint(folder)) for name, folder in adapters)


def _adapter_problems(prefill: KVSpec, decode: KVSpec) -> list[str]:
    """Adapters both sides hold under one name with different content.

    A name only one side holds is no mismatch: adapters load and unload at
    runtime, instance by instance, and the router places a request under an
    adapter only on a pair that both hold it (with the same fingerprint).
    """
    p, d = dict(prefill.lora_adapters), dict(decode.lora_adapters)
    return [
        f"lora adapter {name!r}: prefill {prefill.instance_id} has "
        f"{p[name]}, decode {decode.instance_id} has {d[name]}"
        for name in sorted(p.keys() & d.keys())
        if p[name] != d[name]
    ]


def check_compatible(prefill: KVSpec, decode: KVSpec) -> None:
    """Raise IncompatibleInstancesError naming each mismatch with both values."""
    problems = []
    for name in (
        "model_fingerprint",
        "dtype",
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "quantization",
    ):
        a, b = getattr(prefill, name), getattr(decode, name)
        if a != b:
            what = "model" if name == "model_fingerprint" else name
            if name == "model_fingerprint":
                a, b = f"{prefill.model_name} ({a})", f"{decode.model_name} ({b})"
            problems.append(
                f"{what}: prefill {prefill.instance_id} has {a}, decode {decode.instance_id} has {b}"
            )
    problems += _adapter_problems(prefill, decode)
    if problems:
        raise IncompatibleInstancesError("cannot transfer KV pages; " + "; ".join(problems))


@dataclass(frozen=True)
class PeerEndpoint:
    """How to reach one decode rank's KV cache with one connector."""

    connector: str
    instance_id: str
    rank: int
    kv_shape: tuple[int, ...]  # [local layers, 2, blocks, block_size, local heads, head_dim]
    dtype: str
    address: Any  # connector-specific: a file path, an actor handle, a store address
    node_id: str = ""  # the Ray node the rank runs on ("" unknown: taken as the sender's)
    actor: Any = None  # the rank's actor: object-store messages reach any rank through it
