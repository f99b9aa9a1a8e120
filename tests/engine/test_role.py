"""A serving role's policy in the engine's step: it sees every plan while it is the
engine's, hears of every plan whose pages did not all arrive, and a swap takes effect
from the next step on, whole."""

from __future__ import annotations

import dataclasses

from pdserve.core.config import build_engine_config
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import StepPlan, StepResult
from pdserve.engine.engine import EngineCore
from pdserve.engine.executor import Executor
from pdserve.engine.role import COLOCATED, RolePolicy
from pdserve.parallel.executor import LocalExecutor

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class LosesPages(Executor):
    """The real executor, reporting that a step's KV pages did not all arrive while
    ``losing`` is set (as a rank whose connector failed reports it)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.losing = False

    @property
    def num_kv_blocks(self) -> int:
        return self.inner.num_kv_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.inner.execute(plan)
        return dataclasses.replace(result, kv_transfer_ok=not self.losing)

    def shutdown(self) -> None:
        self.inner.shutdown()


class Recorder:
    def __init__(self) -> None:
        self.plans: list[StepPlan] = []
        self.failed: list[StepPlan] = []

    def policy(self) -> RolePolicy:
        return RolePolicy(plan=self.see, on_transfer_failure=self.failed.append)

    def see(self, plan: StepPlan) -> StepPlan:
        self.plans.append(plan)
        return plan


def _tokens(engine: EngineCore, rid: str, prompt: list[int]) -> list[int]:
    engine.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def test_the_engines_role_sees_its_steps_and_a_swap_is_whole(tiny_path) -> None:
    model = ModelConfig.from_dir(str(tiny_path))
    config = build_engine_config(str(tiny_path), max_num_batched_tokens=256)
    executor = LosesPages(LocalExecutor(model, config))
    engine = EngineCore(config, model, executor, None)
    assert engine.role is COLOCATED
    plain = _tokens(engine, "plain", [5, 6, 7, 8, 9])

    first, second = Recorder(), Recorder()
    engine.use_role(first.policy())
    assert _tokens(engine, "first", [5, 6, 7, 8, 9]) == plain  # a plan passed on as is
    assert first.plans and all(p.seqs[0].request_id == "first" for p in first.plans)
    assert first.failed == []

    engine.use_role(second.policy())  # a role flip: the old policy sees nothing more
    executor.losing = True
    seen = len(first.plans)
    assert _tokens(engine, "second", [5, 6, 7, 8, 9]) == plain
    assert len(first.plans) == seen and first.failed == []
    assert second.failed == second.plans and len(second.plans) >= 2  # prefill, then decodes

    engine.use_role(COLOCATED)
    seen = len(second.plans)
    assert _tokens(engine, "third", [5, 6, 7, 8, 9]) == plain
    assert len(second.plans) == seen
