"""Executors that run step plans on the ranks of one instance.

:class:`LocalExecutor` runs one rank in the calling process: the offline API on
one device, and each decode or prefill instance whose layout is a single rank.
Every executor keeps the time of its last steps (:class:`StepTimes`), which
``pdserve bench parallel`` compares across layouts.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.core.config import EngineConfig
from pdserve.core.model_config import ModelConfig
from pdserve.core.step import StepPlan, StepResult
from pdserve.engine.executor import Executor
from pdserve.parallel.draft_runner import DraftRunner
from pdserve.parallel.model_runner import ModelRunner


@dataclass
class StepTimes:
    """Wall seconds of the last ``keep`` steps an executor ran, with each step's tokens."""

    keep: int = 1024
    steps: deque[tuple[int, float]] = field(default_factory=deque)

    def record(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))
        if len(self.steps) > self.keep:
            self.steps.popleft()

    def median(self, tokens: int) -> float | None:
        """Median seconds of the kept steps of exactly ``tokens`` tokens; None if none."""
        times = [s for n, s in self.steps if n == tokens]
        return statistics.median(times) if times else None

    def clear(self) -> None:
        self.steps.clear()


def time_plans(executor: Executor, plans: list[StepPlan]) -> list[float]:
    """Run each plan on ``executor``; the seconds each took (``pdserve profile``, whose
    plans' pages belong to no request)."""
    out = []
    for plan in plans:
        start = time.perf_counter()
        executor.execute(plan)
        out.append(time.perf_counter() - start)
    return out


class LocalExecutor(Executor):
    """One rank, in-process (and the draft model, with ``speculative_method: draft``)."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig) -> None:
        self.runner = ModelRunner(model_config, config)
        runner = self.runner
        self.drafter = DraftRunner.for_engine(model_config, config, runner.device, runner.dtype)
        num_blocks = runner.max_num_blocks(self.drafter.bytes_per_block() if self.drafter else 0)
        runner.allocate_kv(num_blocks)
        if self.drafter is not None:
            self.drafter.allocate_kv(num_blocks)
        self.step_times = StepTimes()

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def draft_proposer(self) -> DraftRunner | None:
        return self.drafter

    @property
    def tier_slots(self) -> tuple[int, int]:
        return self.runner.tier_slots()

    def tier_io(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
        return self.runner.tier_io()

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        result = self.runner.execute(plan)
        self.step_times.record(plan.num_tokens, time.perf_counter() - start)
        return result

    def adapter_fingerprints(self) -> dict[str, str]:
        return dict(self.runner.adapter_fingerprints)

    def load_adapter(self, slot: int, name: str, folder: str) -> str:
        adapter = self.runner.read_adapter(name, folder)
        self.runner.load_adapter(slot, name, adapter)
        return adapter.fingerprint

    def unload_adapter(self, slot: int, name: str) -> None:
        self.runner.unload_adapter(slot)

    def shutdown(self) -> None:
        self.runner.close()
