"""``in_parallel``: a region's claimed instances start at once, results in order."""

from __future__ import annotations

import threading

import pytest

from pdserve.cluster.membership import in_parallel


def test_every_call_runs_at_once_and_results_keep_their_order() -> None:
    # each call waits for all the others: run one after another, the barrier breaks
    barrier = threading.Barrier(4, timeout=30)

    def start(i: int) -> int:
        barrier.wait()
        return i * 10

    assert in_parallel(start, [3, 1, 2, 0], "t") == [30, 10, 20, 0]


def test_an_error_is_raised_once_every_call_is_done() -> None:
    done: list[int] = []

    def start(i: int) -> int:
        if i == 0:
            raise RuntimeError("no placement for rank 0")
        done.append(i)
        return i

    with pytest.raises(RuntimeError, match="no placement"):
        in_parallel(start, [0, 1, 2], "t")
    assert sorted(done) == [1, 2]  # the others were not abandoned halfway
    assert in_parallel(start, [], "t") == [] and in_parallel(start, [5], "t") == [5]
