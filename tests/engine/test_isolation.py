"""One request's failure inside a step fails that request only; the engine goes on."""

from __future__ import annotations

import pytest

from pdserve.core.config import build_engine_config
from pdserve.core.errors import InstanceFailedError, InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import StepPlan, StepResult
from pdserve.core.tokenizer import Tokenizer
from pdserve.engine.engine import EngineCore
from pdserve.engine.executor import Executor
from pdserve.parallel.executor import LocalExecutor

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class FailsFor(Executor):
    """The real executor, made to raise whenever a plan holds ``poison`` (fault injection)."""

    def __init__(self, inner: Executor, poison: str, error: BaseException) -> None:
        self.inner = inner
        self.poison = poison
        self.error = error
        self.calls = 0

    @property
    def num_kv_blocks(self) -> int:
        return self.inner.num_kv_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        self.calls += 1
        if any(s.request_id == self.poison for s in plan.seqs):
            raise self.error
        return self.inner.execute(plan)

    def shutdown(self) -> None:
        self.inner.shutdown()


def _engine(tiny_path, poison: str = "", error: BaseException | None = None) -> EngineCore:
    model = ModelConfig.from_dir(str(tiny_path))
    config = build_engine_config(str(tiny_path), max_num_batched_tokens=256)
    executor: Executor = LocalExecutor(model, config)
    if error is not None:
        executor = FailsFor(executor, poison, error)
    return EngineCore(config, model, executor, Tokenizer.from_dir(str(tiny_path)))


PROMPTS = {"a": [5, 6, 7, 8, 9], "poison": [11, 12, 13], "b": [21, 22, 23, 24, 25, 26, 27]}


def _run(engine: EngineCore) -> dict[str, tuple[str | None, list[int]]]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    done: dict[str, tuple[str | None, list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].finish_reason, out.outputs[0].token_ids)
    return done


def test_a_failing_request_fails_alone(tiny_path) -> None:
    clean = _run(_engine(tiny_path))
    engine = _engine(tiny_path, "poison", IndexError("index 70000 is out of bounds"))
    done = _run(engine)
    assert done["poison"] == ("error", [])
    assert done["a"] == clean["a"] and done["b"] == clean["b"]  # same tokens as without it
    engine.assert_idle()  # the failed request's pages are back in the pool


def test_a_lost_rank_still_stops_the_engine(tiny_path) -> None:
    engine = _engine(tiny_path, "poison", InstanceFailedError("rank 1 is gone"))
    with pytest.raises(InstanceFailedError):
        _run(engine)


def test_the_engine_refuses_ids_the_model_does_not_have(tiny_path) -> None:
    engine = _engine(tiny_path)
    vocab = engine.model.vocab_size
    with pytest.raises(InvalidArgumentError, match="stop_token_ids"):
        engine.add_request("x", [1, 2, 3], SamplingParams(stop_token_ids=[vocab + 5]))
    engine.assert_idle()
