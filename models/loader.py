"""Load this rank's share of a safetensors checkpoint into a model.

Reads ``model.safetensors.index.json`` when present (sharded checkpoints), else
every ``*.safetensors`` in the folder. Tensors are opened lazily: a layer reads
only the rows or columns of its own slice through ``get_slice``, so a rank never
materialises a tensor it does not hold.

Every parameter is filled with NaN before loading; one left NaN afterwards was
never written, and loading fails naming it rather than serving garbage.

A registry version (``sha256``: its content hash, from the config the controller
resolved) is checked by content in the loading process itself, every file hashed
as read now, before anything is loaded or mapped; a version changed since is an
error naming the file. Its shared weights file is keyed by that hash.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.core import registry
from pdserve.core.errors import ModelNotFoundError
from pdserve.models.shared_weights import load_shared
from pdserve.models.transformer import CausalLM

logger = logging.getLogger(__name__)


class SafeSliceSource:
    """A safetensors tensor read in parts; satisfies ``layers.TensorSource``."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def __getitem__(self, index: object) -> torch.Tensor:
        return self._slice[index]


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError("model", f"no *.safetensors files in {str(folder)!r}")
    return files


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, SafeSliceSource]]:
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, SafeSliceSource(handle, name)


def load_checkpoint(model: CausalLM, folder: str | Path, sha256: str = "") -> None:
    """Fill every parameter of ``model`` (one rank's stage and shards) from ``folder``,
    through the node's shared weights file where it can (:mod:`.shared_weights`).

    ``sha256``: the content hash of the registry version ``folder`` is ("" for a plain
    checkpoint folder); its files are checked against it first."""
    folder = Path(folder)
    if sha256:
        registry.verify(folder, expected=sha256)
    c = model.ctx
    rank = (
        f"tp {c.tp_rank}/{c.tp_size} pp {c.pp_rank}/{c.pp_size} ep {c.ep_rank}/{c.ep_size} "
        f"layers {model.layer_start}-{model.layer_end}"
    )
    files = checkpoint_files(folder)
    if load_shared(model, files, rank, lambda: _load(model, folder), content=sha256):
        logger.debug("weights of %s (%s) map the node's shared file", folder, rank)


@torch.no_grad()
def _load(model: CausalLM, folder: Path) -> None:
    for p in model.parameters():
        p.fill_(float("nan"))
    loaded = 0
    for name, source in iter_checkpoint(folder):
        for module, shard, is_bias in model.weight_targets(name):
            module.load(source, shard, is_bias)  # type: ignore[operator]
            loaded += 1
    missing = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        raise ModelNotFoundError(
            "model",
            f"checkpoint {str(folder)!r} lacks weights for {len(missing)} parameters, e.g. "
            f"{missing[:3]}",
        )
    logger.debug("loaded %d tensors from %s", loaded, folder)


@torch.no_grad()
def fill_random(model: CausalLM, seed: int) -> None:
    """``load_format: dummy``: every matrix (projections, embeddings, experts) drawn from
    N(0, 0.02) with ``seed``; vectors keep what the model was built with (norms at one,
    biases at zero). Each rank draws its own shards: the values are not one model's
    split across ranks, which timing does not need."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for param in model.parameters():
        if param.dim() > 1:
            param.normal_(0.0, 0.02, generator=generator)
