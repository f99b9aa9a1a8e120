"""Placing one rank's MoE expert slots (EPLB): at start-up, and again between steps.

A re-placement runs on every rank of an instance at the same point of the
plan stream: the leader sends a rebalance message through the plan channel
(:func:`encode_rebalance`, told apart from a step plan by its prefix) and runs
it itself; each follower runs it when its loop reads it. On every rank,
:func:`rebalance` then, for each MoE layer of its stage:

1. takes the tokens per expert to place by: the ones given in the message, or
   the ones this stage's EP ranks routed since the last placement, summed over
   the EP group (one all-reduce);
2. computes the placement with :func:`pdserve.models.eplb.place`, which is
   deterministic, so every rank of the stage arrives at the same one;
3. reloads from the checkpoint on disk only the local slots whose expert
   changed (the loader's lazy slices: a rank reads only those experts).

Weights never cross ranks: each reads its new experts itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist
from torch import nn

from pdserve.core import registry
from pdserve.core.errors import ModelNotFoundError
from pdserve.models.eplb import Placement, place, static_placement
from pdserve.models.loader import iter_checkpoint
from pdserve.models.moe import W2_DOWN, SparseMoE
from pdserve.models.transformer import CausalLM

logger = logging.getLogger(__name__)

REBALANCE_PREFIX = b"pdserve-eplb\x00"  # a StepPlan (a msgpack array) never starts so


def encode_rebalance(loads: dict[int, list[int]] | None) -> bytes:
    """The plan-channel message that re-places experts (by ``loads`` if given)."""
    body = None if loads is None else [[int(k), list(v)] for k, v in loads.items()]
    return REBALANCE_PREFIX + bytes(msgpack.packb(body))


def is_rebalance(payload: bytes) -> bool:
    return payload.startswith(REBALANCE_PREFIX)


def decode_rebalance(payload: bytes) -> dict[int, list[int]] | None:
    body = msgpack.unpackb(payload[len(REBALANCE_PREFIX) :])
    return None if body is None else {int(k): list(v) for k, v in body}


def moe_layers(model: nn.Module, layer_start: int) -> dict[int, SparseMoE]:
    """Global layer index -> its MoE block, for this stage's MoE layers."""
    out: dict[int, SparseMoE] = {}
    for i, layer in enumerate(getattr(model, "layers", ())):
        moe = getattr(layer, "mlp", None)
        if isinstance(moe, SparseMoE):
            out[layer_start + i] = moe
    return out


def initial_placement(model: CausalLM, layer_start: int, redundant: int, folder: str) -> None:
    """Give every MoE layer ``redundant`` extra slots (replicas of the first experts)."""
    layers = moe_layers(model, layer_start)
    stale = {}
    for moe in layers.values():
        p = static_placement(moe.num_experts, redundant, moe.ctx.ep_size)
        stale[moe] = set(moe.set_placement(p))
    reload_slots(model, folder, stale)


def rebalance(
    model: CausalLM,
    layer_start: int,
    redundant: int,
    folder: str,
    loads: dict[int, list[int]] | None = None,
    min_tokens: int = 0,
) -> dict[int, Placement]:
    """Re-place this stage's expert slots (see the module doc); the placements that changed.

    Every rank of the stage must call it at the same point (it may all-reduce).
    A layer with no tokens to place by keeps its placement; one whose measured
    window holds fewer than ``min_tokens`` also keeps its window counting.
    """
    layers = moe_layers(model, layer_start)
    if not layers or next(iter(layers.values())).ctx.ep_size == 1:
        return {}
    window = loads if loads is not None else _recent_loads(layers)
    changed: dict[int, Placement] = {}
    stale: dict[SparseMoE, set[int]] = {}
    for layer, moe in layers.items():
        tokens = window.get(layer)
        if loads is None and tokens is not None and sum(tokens) < min_tokens:
            continue  # too few tokens yet to place by: keep counting
        if tokens is not None and sum(tokens) > 0:
            p = place(tokens, redundant, moe.ctx.ep_size)
            if p != moe.placement:
                stale[moe] = set(moe.set_placement(p))
                changed[layer] = p
        moe.routed_at_placement = moe.routed.clone()
    reload_slots(model, folder, stale)
    logger.info("expert re-placement: %d of %d MoE layers changed", len(changed), len(layers))
    return changed


def _recent_loads(layers: dict[int, SparseMoE]) -> dict[int, list[int]]:
    """Tokens per expert routed since the last placement, summed over the EP group."""
    mods = list(layers.values())
    window = torch.stack([m.routed - m.routed_at_placement for m in mods])  # [L, E]
    ctx = mods[0].ctx
    with ctx.comm.timed(window.numel() * window.element_size()):
        dist.all_reduce(window, group=ctx.ep_group)
    return {layer: row for layer, row in zip(layers, window.tolist(), strict=True)}


@torch.no_grad()
def reload_slots(model: CausalLM, folder: str | Path, stale: dict[SparseMoE, set[int]]) -> None:
    """Read the experts of the ``stale`` local slots of each MoE block from ``folder``.

    A registry version (the model's config carries its content hash) is checked by
    content first, every file hashed again: a re-placement loads weights too."""
    stale = {m: s for m, s in stale.items() if s}
    if not stale:
        return
    if model.config.sha256:
        registry.verify(Path(folder), expected=model.config.sha256)
    for name, source in iter_checkpoint(Path(folder)):
        for module, shard, _ in model.weight_targets(name):
            if not isinstance(module, SparseMoE) or module not in stale:
                continue
            assert isinstance(shard, tuple)
            if shard[0] == "expert":
                module.load_expert(source, shard[1], shard[2], stale[module])
            elif shard[0] == "fused":
                which = W2_DOWN if shard[1] == "w2" else "w13"
                module.load_fused(source, which, stale[module])
    for moe, slots in stale.items():
        idx = sorted(slots)
        if torch.isnan(moe.w13[idx]).any() or torch.isnan(moe.w2[idx]).any():
            raise ModelNotFoundError(
                "model", f"checkpoint {str(folder)!r} lacks weights of experts in slots {idx}"
            )
