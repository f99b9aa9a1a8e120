"""Priority in the engine scheduler: admission order, preemption victims, preempting to admit."""

from __future__ import annotations

from pdserve.core.config import build_engine_config
from pdserve.core.model_config import ModelConfig
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer
from pdserve.engine.engine import EngineCore
from pdserve.engine.priority import WaitingQueue, victim
from pdserve.engine.scheduler import MAX_PRIORITY_PREEMPTIONS, Scheduler
from pdserve.parallel.executor import LocalExecutor
from tests.engine.test_scheduler import make, step


def add(
    s: Scheduler, rid: str, n_prompt: int, priority: int = 0, max_tokens: int = 8, base: int = 0
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    req = Request(rid, [base + i for i in range(n_prompt)], params)
    s.add_request(req)
    return req


def run_to_end(s: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not s.num_unfinished:
            break
        step(s)
    assert not s.num_unfinished
    s.kv.assert_empty()


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    s = make(max_seqs=1, budget=64)
    for rid, priority in [("a0", 0), ("b-1", -1), ("c2", 2), ("d0", 0), ("e2", 2)]:
        add(s, rid, 4, priority, max_tokens=2, base=10 * len(s.requests))
    order: list[str] = []
    while s.num_unfinished:
        order += [q.request_id for q in step(s).seqs if q.request_id not in order]
    assert order == ["c2", "e2", "a0", "d0", "b-1"]
    s.kv.assert_empty()


def test_a_request_put_back_goes_to_the_front_of_its_priority() -> None:
    queue = WaitingQueue()
    reqs = {
        rid: Request(rid, [1], SamplingParams(priority=p))
        for rid, p in [("a", 0), ("b", 0), ("c", -1), ("d", 1), ("e", 0), ("f", -1), ("g", 1)]
    }
    for rid in "abcd":
        queue.push(reqs[rid])
    queue.push_front(reqs["e"])  # preempted, say
    queue.push_front(reqs["f"])
    queue.push(reqs["g"])
    assert [r.request_id for r in queue] == ["d", "g", "e", "a", "b", "f", "c"]


def test_the_victim_is_the_lowest_priority_then_the_newest() -> None:
    a, b, c = (Request(rid, [1], SamplingParams()) for rid in "abc")
    assert victim([a, b, c]) is c  # all equal: the newest, as before priorities
    low = Request("low", [1], SamplingParams(priority=-1))
    assert victim([low, a, b]) is low
    high = Request("high", [1], SamplingParams(priority=3))
    assert victim([a, b, high]) is b


def test_under_kv_pressure_the_low_priority_request_is_preempted_not_the_newest() -> None:
    # 6 blocks of 4 tokens; three requests growing to 12 tokens cannot all fit.
    s = make(num_blocks=6, budget=64)
    low = add(s, "low", 4, priority=-1, base=0)
    step(s)  # "low" is the oldest running request
    others = [add(s, rid, 4, base=100 * i) for i, rid in enumerate(["a", "b"], 1)]
    first_victim = None
    for _ in range(100):
        if not s.num_unfinished:
            break
        step(s)
        if first_victim is None and s.num_preemptions:
            first_victim = next(r for r in [low, *others] if r.num_preemptions)
    assert first_victim is low
    assert [r.num_preemptions for r in others] == [0, 0]
    run_to_end(s)
    assert all(r.num_output_tokens == 8 for r in [low, *others])


def _fill_with_low(s: Scheduler) -> Request:
    """One low-priority request holding 6 of 8 blocks: 20 prompt tokens, then decoding."""
    low = add(s, "low", 20, priority=-1)
    step(s)
    step(s)
    assert s.kv.num_free_blocks == 2
    return low


def test_a_higher_priority_arrival_preempts_a_lower_running_request() -> None:
    s = make(num_blocks=8, budget=64)
    low = _fill_with_low(s)
    high = add(s, "high", 12, priority=1, base=500)  # needs 3 blocks
    plan = step(s)
    assert [q.request_id for q in plan.seqs] == ["high"]  # low's decode row was taken back
    assert low.status is RequestStatus.PREEMPTED and s.num_preemptions == 1
    # "low" cannot preempt back: it waits until "high" is done, then finishes.
    while not high.finished:
        assert [q.request_id for q in step(s).seqs] == ["high"]
    assert s.num_preemptions == 1
    run_to_end(s)
    assert low.num_output_tokens == 8 and high.num_output_tokens == 8


def test_equal_priority_never_preempts_to_be_admitted() -> None:
    s = make(num_blocks=8, budget=64)
    low = _fill_with_low(s)
    same = add(s, "same", 12, priority=-1, base=500)
    plan = step(s)
    assert [q.request_id for q in plan.seqs] == ["low"]
    assert s.num_preemptions == 0 and same.status is RequestStatus.WAITING
    run_to_end(s)
    assert s.num_preemptions == 0 and low.num_output_tokens == same.num_output_tokens == 8


def test_no_preemption_when_the_lower_ones_cannot_make_room() -> None:
    s = make(num_blocks=8, budget=64)
    add(s, "mid", 20, priority=1)
    low = add(s, "low", 4, priority=-1, base=100)
    step(s)
    high = add(s, "high", 24, priority=1, base=500)  # 6 blocks: low holds 2, 0 free
    step(s)
    assert s.num_preemptions == 0
    assert high.status is RequestStatus.WAITING and low.status is RequestStatus.RUNNING
    run_to_end(s)


def test_preemptions_to_admit_are_bounded_per_step() -> None:
    s = make(num_blocks=10, budget=256, max_seqs=16)
    lows = [add(s, f"low{i}", 1, priority=-1, max_tokens=10, base=i) for i in range(10)]
    step(s)  # ten requests, one block each: the pool is full
    high = add(s, "high", 24, priority=1, base=500)  # needs 6 blocks
    step(s)
    assert s.num_preemptions == MAX_PRIORITY_PREEMPTIONS == 4
    assert [r.request_id for r in lows if r.num_preemptions] == ["low6", "low7", "low8", "low9"]
    assert high.status is RequestStatus.WAITING
    step(s)  # the rest of the room, newest lowest first
    assert s.num_preemptions == 6 and high.status is RequestStatus.RUNNING
    assert lows[4].num_preemptions == lows[5].num_preemptions == 1
    run_to_end(s)
    assert all(r.num_output_tokens == 10 for r in lows)


# -- the real engine on the tiny model ------------------------------------------


def _engine(tiny_path, **kwargs: int) -> EngineCore:
    model = ModelConfig.from_dir(str(tiny_path))
    config = build_engine_config(str(tiny_path), dtype="float32", **kwargs)
    executor = LocalExecutor(model, config)
    return EngineCore(config, model, executor, Tokenizer.from_dir(str(tiny_path)))


def _greedy(priority: int) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, priority=priority)


PROMPTS = {
    "low1": ([5 + i for i in range(10)], -1),
    "low2": ([40 + i for i in range(10)], -1),
    "high": ([80 + i for i in range(12)], 5),
}


def _finish(engine: EngineCore, done: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids


def test_preempted_and_resumed_requests_keep_their_greedy_tokens(tiny_path) -> None:
    alone: dict[str, list[int]] = {}
    reference = _engine(tiny_path)
    for rid, (prompt, priority) in PROMPTS.items():
        reference.add_request(rid, prompt, _greedy(priority))
        _finish(reference, alone)
    reference.shutdown()
    # 10 blocks of 4 tokens: the two low requests fill 8 of them in three steps.
    engine = _engine(tiny_path, num_blocks=10, block_size=4, max_num_batched_tokens=64)
    done: dict[str, list[int]] = {}
    for rid in ("low1", "low2"):
        engine.add_request(rid, PROMPTS[rid][0], _greedy(PROMPTS[rid][1]))
    for _ in range(3):
        engine.step()
    engine.add_request("high", PROMPTS["high"][0], _greedy(PROMPTS["high"][1]))
    engine.step()
    sched = engine.scheduler
    assert sched.num_preemptions == 1 and sched.requests["low2"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.running] == ["low1", "high"]
    _finish(engine, done)
    assert done == alone
    engine.assert_idle()
    engine.shutdown()
