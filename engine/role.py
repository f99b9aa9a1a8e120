"""What a serving role changes in the engine's step, as one object.

A colocated engine runs plans as scheduled. The prefill role annotates each
plan with the KV pages to stream to decode instances and recomputes the
requests whose pages did not all arrive; the decode role annotates each plan
with the pages that must have landed before it runs. A server hands its
:class:`RolePolicy` to the engine when it starts (``EngineCore.use_role``), and
an instance that flips role swaps the whole policy at once, so no hook of the
old role outlives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.core.step import StepPlan


@dataclass(frozen=True)
class RolePolicy:
    """``plan``: rewrites each scheduled plan before it runs (None: as scheduled).
    ``on_transfer_failure``: called with a plan whose KV pages did not all reach
    their decode instance (None: nothing to do)."""

    plan: Callable[[StepPlan], StepPlan] | None = None
    on_transfer_failure: Callable[[StepPlan], None] | None = None


COLOCATED = RolePolicy()  # an engine that serves whole requests itself
