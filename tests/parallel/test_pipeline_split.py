"""Micro-batch cutting for pipeline parallelism."""

from __future__ import annotations

from pdserve.core.step import ScheduledSeq, StepPlan
from pdserve.parallel.pipeline import split_micro_batches


def plan(*sizes: int) -> StepPlan:
    return StepPlan(1, [ScheduledSeq(f"r{i}", [1] * n, 0, [0]) for i, n in enumerate(sizes)])


def test_split_keeps_order_and_every_sequence() -> None:
    p = plan(1, 1, 1, 1, 40, 1, 1, 1)
    parts = split_micro_batches(p, 2)
    assert len(parts) == 2
    assert [s for part in parts for s in part.seqs] == p.seqs


def test_split_balances_tokens() -> None:
    parts = split_micro_batches(plan(*([1] * 32)), 4)
    assert [part.num_tokens for part in parts] == [8, 8, 8, 8]


def test_no_more_parts_than_sequences() -> None:
    assert len(split_micro_batches(plan(5, 5), 4)) == 2
    assert len(split_micro_batches(plan(5), 4)) == 1
    assert split_micro_batches(plan(3, 3), 1)[0].num_tokens == 6
