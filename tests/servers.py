"""What the prefill and decode server tests share: a real one-rank engine on the tiny model.

:func:`tiny_engine` builds the :class:`~pdserve.engine.engine.EngineCore` that
``pdserve.LLM`` and a one-rank instance use, over :class:`ScriptedExecutor`: the
real :class:`~pdserve.parallel.executor.LocalExecutor`, which also records every
plan and lets a test hold a step, fail it, or report its pages undelivered.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.core.layout import Layout
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import StepPlan, StepResult
from pdserve.engine.engine import EngineCore
from pdserve.parallel.executor import LocalExecutor

BLOCK_SIZE = 4
# 14 tokens a step: a 30-token prompt runs as chunks [0, 14), [14, 28), [28, 30),
# the first one ending inside a page.
STEP_TOKENS = 14


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def one_rank(model: ModelConfig) -> Layout:
    return Layout(1, 1, 1, ((0, model.num_layers),))


class ScriptedExecutor(LocalExecutor):
    """The local executor, recording each plan; ``gate``, ``fail``, ``deliver``, ``after`` script a step.

    - ``gate``: while set to an unset event, a step waits for it (``entered`` is
      set once a step is waiting or running);
    - ``fail(plan)``: an exception for the step to raise instead of running, or None;
    - ``deliver``: False reports the step's KV pages undelivered (``kv_transfer_ok``);
    - ``after(plan)``: runs once the step ran (where a rank would send its pages).
    """

    def __init__(self, model_config: ModelConfig, config: EngineConfig) -> None:
        super().__init__(model_config, config)
        self.plans: list[StepPlan] = []
        self.entered = threading.Event()
        self.gate: threading.Event | None = None
        self.fail: Callable[[StepPlan], BaseException | None] | None = None
        self.deliver = True
        self.after: Callable[[StepPlan], None] | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        error = self.fail(plan) if self.fail is not None else None
        if error is not None:
            raise error
        result = super().execute(plan)
        if self.after is not None:
            self.after(plan)
        if plan.kv_sends and not self.deliver:
            return dataclasses.replace(result, kv_transfer_ok=False)
        return result

    def plans_of(self, request_id: str) -> list[StepPlan]:
        return [p for p in self.plans if any(s.request_id == request_id for s in p.seqs)]


def tiny_engine(tiny_path: Path, num_blocks: int = 64) -> EngineCore:
    """An engine core on the built-in tiny model: ``num_blocks`` pages of BLOCK_SIZE tokens."""
    model = ModelConfig.from_dir(tiny_path)
    config = EngineConfig(
        model=str(tiny_path),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=STEP_TOKENS),
    )
    return EngineCore(config, model, ScriptedExecutor(model, config), tokenizer=None)


def executor_of(engine: EngineCore) -> ScriptedExecutor:
    assert isinstance(engine.executor, ScriptedExecutor)
    return engine.executor


def eventually(condition: Callable[[], object], timeout_s: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def send_pages_between(sender: EngineCore, receiver: EngineCore) -> None:
    """After each step of ``sender``, copy its plan's ``kv_sends`` into ``receiver``'s
    cache, as a rank's connector would (every layer, K and V)."""
    src = executor_of(sender).runner.kv_cache  # [layers, 2, blocks, bs, heads, D]
    dst = executor_of(receiver).runner.kv_cache

    def send_pages(plan: StepPlan) -> None:
        for send in plan.kv_sends:
            dst[:, :, send.dst_blocks] = src[:, :, send.src_blocks]

    executor_of(sender).after = send_pages
