"""Batched LoRA: many adapters over one base model in one step (Punica / S-LoRA style).

Every token row of a step runs under one adapter or the base model. The runner
builds a :class:`LoRABatch` from the plan (rows grouped by adapter); each
targeted linear holds a :class:`LinearLoRA` and adds, for the rows of adapter
``i``, ``(x @ A_i^T) @ B_i^T`` on top of whatever its base path computed (dense,
packed or quantized). The scale ``alpha / r`` is folded into ``B`` at load time.

Shapes are per rank. A fused column layer (q/k/v, gate/up) keeps one pair per
adapter: ``A [sum r_j, in]`` stacks the logical matrices' A, and
``B [out_local, sum r_j]`` is block-diagonal, each block the rows of ``B_j`` that
this rank's slice of matrix ``j`` holds. A row-parallel layer keeps this rank's
columns of ``A [r, in_local]`` and the whole ``B [out, r]``; its partial delta is
added before the all-reduce, which sums it exactly (it is linear in ``x``).
Adapter weights are read from PEFT files by :mod:`pdserve.models.lora_loader`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.core.adapters import UnknownAdapterError


@dataclass(frozen=True)
class LoRABatch:
    """Which token rows of one step run under which adapter.

    groups: (adapter index, rows) per adapter present; ``rows`` is a [n] int64
    index into the step's flat tokens, or None when the adapter has every row.
    """

    groups: tuple[tuple[int, torch.Tensor | None], ...]

    @classmethod
    def build(
        cls, row_adapters: Sequence[int], device: torch.device | str = "cpu"
    ) -> LoRABatch | None:
        """From each token row's adapter index (-1: base); None when no row has one."""
        rows: dict[int, list[int]] = {}
        for row, index in enumerate(row_adapters):
            if index >= 0:
                rows.setdefault(index, []).append(row)
        if not rows:
            return None
        total = len(row_adapters)
        return cls(
            tuple(
                (i, None if len(r) == total else torch.tensor(r, dtype=torch.int64, device=device))
                for i, r in sorted(rows.items())
            )
        )


def adapter_indices(names: Sequence[str | None], served: Sequence[str | None]) -> list[int]:
    """Each name's slot among the served adapters (-1 for None, the base model).

    ``served[i]`` names the adapter in slot ``i`` (None: a free slot)."""
    index = {name: i for i, name in enumerate(served) if name is not None}
    out = []
    for name in names:
        if name is not None and name not in index:
            raise UnknownAdapterError(name, tuple(index))
        out.append(-1 if name is None else index[name])
    return out


class LinearLoRA:
    """The adapters of one linear layer: per adapter slot ``(A, B)`` or None (not
    targeted, or a free slot).

    A: [r, in_local], B: [out_local, r] with the adapter's scale folded in.
    """

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        self.weights = weights

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for w in self.weights if w is not None for t in w)

    def add(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """``y`` plus each row's adapter delta. x: [T, in_local], y: [T, out_local]."""
        for index, rows in batch.groups:
            w = self.weights[index]
            if w is None:
                continue
            a, b = w
            if rows is None:
                y = torch.addmm(y, x @ a.t(), b.t())
            else:
                y = y.index_add(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y
