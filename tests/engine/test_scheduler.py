"""Scheduler: token budget, chunked prefill, decode priority, preemption, aborts."""

from __future__ import annotations

from pdserve.core.config import SchedulerConfig
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import StepPlan
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.scheduler import Scheduler


def make(
    num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, block_size: int = 4
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, 10_000
    )


def add(s: Scheduler, rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0) -> Request:
    req = Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens))
    s.add_request(req)
    return req


def step(s: Scheduler) -> StepPlan:
    """One step with the token each sampling row 'generates' being 7."""
    plan = s.schedule()
    s.update(plan, {q.request_id: 7 for q in plan.seqs if q.sampling is not None})
    s.check_integrity()
    return plan


def test_long_prompt_is_chunked_under_the_budget() -> None:
    s = make(budget=16)
    req = add(s, "long", 40)
    chunks = []
    while req.num_output_tokens == 0:
        plan = step(s)
        assert plan.num_tokens <= 16
        (seq,) = plan.seqs
        chunks.append((seq.start_pos, seq.num_tokens, seq.sampling is not None))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]


def test_decodes_run_every_step_while_a_prompt_prefills() -> None:
    s = make(budget=16)
    short = [add(s, f"d{i}", 3, max_tokens=20, base=100 * i) for i in range(3)]
    step(s)  # all three prompts in one step
    add(s, "long", 60)
    for _ in range(4):
        before = [r.num_output_tokens for r in short]
        plan = step(s)
        assert plan.num_tokens <= 16
        assert [r.num_output_tokens for r in short] == [b + 1 for b in before]
        long_seq = next(q for q in plan.seqs if q.request_id == "long")
        assert long_seq.num_tokens == 13  # what the three decodes left of the budget


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = make(max_seqs=2, budget=64)
    for i in range(4):
        add(s, f"r{i}", 2, base=10 * i)
    plan = step(s)
    assert sorted(q.request_id for q in plan.seqs) == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_preemption_frees_the_newest_and_everything_finishes() -> None:
    # 6 blocks of 4 tokens; three requests growing to 12 tokens cannot all fit.
    s = make(num_blocks=6, budget=64)
    reqs = [add(s, f"r{i}", 4, max_tokens=8, base=10 * i) for i in range(3)]
    saw_preemption = False
    for _ in range(100):
        if not s.num_unfinished:
            break
        step(s)
        saw_preemption |= any(r.status is RequestStatus.PREEMPTED for r in reqs)
    assert not s.num_unfinished
    assert saw_preemption and s.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8 for r in reqs)
    s.kv.assert_empty()


def test_abort_in_every_state_frees_blocks() -> None:
    s = make(budget=8)
    waiting = add(s, "waiting", 4, base=0)
    prefilling = add(s, "prefilling", 20, base=100)
    step(s)  # "waiting" prefilled (4), "prefilling" got 4 of 20
    assert prefilling.num_computed_tokens == 4 and waiting.num_output_tokens == 1
    queued = add(s, "queued", 4, base=200)
    for rid in ("prefilling", "waiting", "queued"):
        assert s.finish(rid, RequestStatus.FINISHED_ABORTED) is not None
        s.check_integrity()
    assert s.finish("waiting", RequestStatus.FINISHED_ABORTED) is None  # idempotent
    assert queued.status is RequestStatus.FINISHED_ABORTED
    s.kv.assert_empty()


def test_plan_round_trips_through_msgpack() -> None:
    s = make(budget=16)
    add(s, "a", 20)
    add(s, "b", 3)
    plan = s.schedule()
    again = StepPlan.from_msgpack(plan.to_msgpack())
    assert again == plan
