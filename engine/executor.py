"""The seam between the engine core and whatever runs the model.

The engine core knows nothing about ranks, devices or Ray: it hands a
:class:`~pdserve.core.step.StepPlan` to an :class:`Executor` and gets the
sampled tokens back. A one-rank executor runs the model in-process; a
multi-rank executor broadcasts the plan to its ranks.
"""

from __future__ import annotations

import abc

from pdserve.core.errors import UnsupportedError
from pdserve.core.step import StepPlan, StepResult
from pdserve.engine.draft import DraftProposer


class Executor(abc.ABC):
    """Runs step plans on every rank of one instance.

    Contract:
        ``num_kv_blocks`` is fixed once the executor exists (its ranks have
        allocated their KV caches); the engine sizes its block pool from it.
        ``execute`` is called once per step, from one thread, with a non-empty
        plan; it blocks until the step is done and returns one token per
        sampling row. It raises :class:`~pdserve.core.errors.InstanceFailedError`
        if a rank died. ``shutdown`` releases ranks and memory; calling it twice
        is harmless.
    """

    @property
    @abc.abstractmethod
    def num_kv_blocks(self) -> int: ...

    @property
    def tier_slots(self) -> tuple[int, int]:
        """Blocks each rank's host and disk KV tiers hold (0: that tier is off)."""
        return 0, 0

    def tier_io(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
        """Bytes and seconds the leader rank moved per (tier, direction)."""
        return {}, {}

    @property
    def draft_proposer(self) -> DraftProposer | None:
        """The draft model of ``speculative_method: draft``, on the engine's rank (None: none)."""
        return None

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def adapter_fingerprints(self) -> dict[str, str]:
        """The start-up adapters' fingerprints, of the bytes the ranks read (name ->
        fingerprint); an adapter missing here is fingerprinted from its folder."""
        return {}

    def load_adapter(self, slot: int, name: str, folder: str) -> str:
        """Between two steps: read and check a PEFT adapter, then hold it in ``slot`` on
        every rank (plans name it ``name`` from the next step on); returns the fingerprint
        (``core.adapters.adapter_fingerprint``) of the bytes the ranks loaded. Raises
        InvalidArgumentError naming the field before any rank changes."""
        raise UnsupportedError("this executor cannot load LoRA adapters at runtime")

    def unload_adapter(self, slot: int, name: str) -> None:
        """Between two steps: drop the adapter in ``slot`` on every rank."""
        raise UnsupportedError("this executor cannot unload LoRA adapters at runtime")

    @abc.abstractmethod
    def shutdown(self) -> None: ...
