"""``--request-timeout`` in the simulator: a request past it fails where it is, its
pages go back, and a limit on requests in flight sends the next one at that instant."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.report import Slo
from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.cluster import SimCluster, SimOptions
from pdserve.sim.profile import StepModel
from pdserve.sim.results import ERRORS, TIMED_OUT
from tests.sim.helpers import book, toy_config, toy_profile, workload

CONSTANT = StepModel(overhead_s=0.010)  # every step takes 10 ms


def _run(prefill: int, work, **options) -> SimCluster:  # type: ignore[no-untyped-def]
    """Run to the end and check that nothing is left anywhere: no request on any
    instance, every block free, no request counted in flight by the router's view."""
    sim = SimCluster(
        toy_config(prefill, 1), book(toy_profile(CONSTANT)), work, SimOptions(**options)
    )
    run = sim.run()
    for inst in run.instances:
        inst.scheduler.check_integrity()
        assert not inst.scheduler.requests and not inst.scheduler.held
        inst.kv.assert_empty()
        assert inst.view.inflight == 0 and inst.view.pending_prompt_tokens == 0
    assert not sim.tracks and set(sim.inflight.values()) == {0}
    return sim


@pytest.mark.parametrize("fast", [False, True])
def test_a_closed_loop_sends_the_next_request_when_one_times_out(fast: bool) -> None:
    # One slot, 57 ms timeout, 10 ms steps. Requests 0-2 want 11 tokens (110 ms alone):
    # each times out 57 ms after it was sent, mid-step; the next is sent then and starts
    # at the next step. Request 3 wants 2 tokens: sent at 171 ms, it waits for the step
    # in flight (to 180), prefills to 190 (its first token) and ends at 200.
    work = workload(np.zeros(4), 100, np.array([11, 11, 11, 2]))
    rec = _run(0, work, fast=fast, max_concurrency=1, request_timeout_s=0.057).run_info.recorder
    np.testing.assert_allclose(rec.sent, [0, 0.057, 0.114, 0.171])
    np.testing.assert_allclose(rec.end, [0.057, 0.114, 0.171, 0.200])
    assert list(rec.error) == [TIMED_OUT] * 3 + [0]
    records = rec.records()
    for r in records[:3]:  # as the load generator records a request it gave up on
        assert not r.ok and r.error == ERRORS[TIMED_OUT] == "DEADLINE_EXCEEDED: Deadline Exceeded"
        assert r.ttft_s is None and r.output_len == 0 and r.itl_s == []
        assert r.e2e_s == pytest.approx(0.057)
    assert records[3].ttft_s == pytest.approx(0.019) and records[3].output_len == 2
    summary = rec.summary(Slo(1.0, 0.1))
    assert summary["num_failed"] == 3 and summary["errors"] == {ERRORS[TIMED_OUT]: 3}


@pytest.mark.parametrize(
    "timeout, where",
    [
        (0.004, "prefilling"),
        (0.012, "its pages in transfer"),
        (0.030, "decoding"),
        (0.010, "crossing to its region"),
    ],
)
def test_a_request_that_times_out_is_aborted_wherever_it_is(timeout: float, where: str) -> None:
    # Disaggregated: the prefill step runs 0-10 ms (first token at 10), the pages move
    # 10-15 ms, decode steps run from 15 ms to 55 ms. "crossing": the router's fixed
    # cost (20 ms) delays the launch past the deadline. Each place gives back what the
    # request held there (_run checks every block and counter).
    overhead = 0.020 if where == "crossing to its region" else 0.0
    sim = _run(
        1, workload(np.zeros(1), 100, 5), request_timeout_s=timeout, request_overhead_s=overhead
    )
    rec = sim.run_info.recorder
    assert rec.error[0] == TIMED_OUT, where
    assert rec.end[0] == pytest.approx(timeout) and rec.tokens[0] == 0


def test_a_timeout_no_request_reaches_changes_nothing() -> None:
    rng = np.random.default_rng(3)
    work = workload(
        np.sort(rng.uniform(0, 2, 60)), rng.integers(20, 400, 60), rng.integers(2, 40, 60)
    )
    never = _run(1, work).run_info.recorder
    late = _run(1, work, request_timeout_s=600.0).run_info.recorder
    np.testing.assert_array_equal(late.end, never.end)
    np.testing.assert_array_equal(late.first, never.first)
    unbounded = _run(1, work, request_timeout_s=math.inf)  # --request-timeout inf: never
    np.testing.assert_array_equal(unbounded.run_info.recorder.end, never.end)
    assert not unbounded.deadlines._due
    with pytest.raises(InvalidArgumentError, match="request_timeout"):
        SimOptions(request_timeout_s=0.0)
