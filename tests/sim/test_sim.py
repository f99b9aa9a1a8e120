"""The simulator against hand-computed latencies, fast mode against full mode, no leaks."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from pdserve.bench import workload as wl
from pdserve.bench.report import Slo
from pdserve.core.errors import InvalidArgumentError
from pdserve.sim.cluster import SimCluster, SimOptions, SimRun
from pdserve.sim.profile import StepModel
from tests.sim.helpers import book, toy_config, toy_profile, workload

CONSTANT = StepModel(overhead_s=0.010)  # every step takes 10 ms, whatever it holds


def _check_no_leaks(run: SimRun) -> None:
    for inst in run.instances:
        inst.scheduler.check_integrity()
        assert not inst.scheduler.requests and not inst.scheduler.held
        inst.kv.assert_empty()


def _run(config, profile, work, **options) -> SimRun:  # type: ignore[no-untyped-def]
    run = SimCluster(config, book(profile), work, SimOptions(**options)).run()
    _check_no_leaks(run)
    return run


@pytest.mark.parametrize("fast", [False, True])
def test_colocated_constant_steps_match_hand_computation(fast: bool) -> None:
    # One instance, requests 10 s apart: each runs alone. Prompt 100 < budget 512:
    # one prefill step gives the first token (TTFT 10 ms), then 4 decode steps.
    work = workload(np.arange(5) * 10.0, 100, 5)
    run = _run(toy_config(0, 1), toy_profile(CONSTANT), work, fast=fast)
    rec = run.recorder
    assert (rec.error == 0).all()
    np.testing.assert_allclose(rec.first - rec.arrival, 0.010)
    np.testing.assert_allclose(rec.end - rec.arrival, 0.050)
    records = rec.records()
    assert all(r.tpot_s == pytest.approx(0.010) for r in records)
    assert all(r.itl_s == pytest.approx([0.010] * 4) for r in records)


def test_chunked_prefill_takes_one_step_per_chunk() -> None:
    # A 1200-token prompt with a 512-token budget: 3 prefill steps, then 2 decode steps.
    work = workload(np.zeros(1), 1200, 3)
    rec = _run(toy_config(0, 1), toy_profile(CONSTANT), work).recorder
    assert rec.first[0] == pytest.approx(0.030)
    assert rec.end[0] == pytest.approx(0.050)


def test_disaggregated_hand_off_timing() -> None:
    # Prefill: one 10 ms step -> first token at 10 ms; the KV lands 5 ms later;
    # decode then runs 10 ms steps for the 4 remaining tokens: end at 55 ms.
    work = workload(np.arange(3) * 10.0, 100, 5)
    run = _run(toy_config(1, 1), toy_profile(CONSTANT, latency_s=0.005), work)
    rec = run.recorder
    np.testing.assert_allclose(rec.first - rec.arrival, 0.010)
    np.testing.assert_allclose(rec.end - rec.arrival, 0.055)
    prefill = next(x for x in run.instances if x.role == "prefill")
    assert prefill.stats.tokens == 300  # it ran the prompts, decode never did


def test_steps_batch_arrivals_together() -> None:
    # Two requests at once share every step: same TTFT and end as one alone.
    work = workload(np.zeros(2), 50, 4)
    rec = _run(toy_config(0, 1), toy_profile(CONSTANT), work).recorder
    np.testing.assert_allclose(rec.first, 0.010)
    np.testing.assert_allclose(rec.end, 0.040)


@pytest.mark.parametrize("fast", [False, True])
def test_a_limit_on_requests_in_flight_holds_arrivals_as_the_load_generator_does(fast) -> None:  # type: ignore[no-untyped-def]
    # Six requests at once, at most two in flight (bench serve --max-concurrency 2):
    # each pair runs alone for 50 ms (one prefill step, four decode steps), the next
    # pair is sent as they end; latencies count from the send, as the client's do.
    work = workload(np.zeros(6), 50, 5)  # six prompts fit one step's token budget
    rec = _run(toy_config(0, 1), toy_profile(CONSTANT), work, fast=fast, max_concurrency=2).recorder
    np.testing.assert_allclose(rec.sent, [0, 0, 0.05, 0.05, 0.10, 0.10])
    np.testing.assert_allclose(rec.first - rec.sent, 0.010)
    np.testing.assert_allclose(rec.end, [0.05, 0.05, 0.10, 0.10, 0.15, 0.15])
    records = rec.records()
    assert [r.scheduled_s for r in records] == [0.0] * 6
    assert [r.ttft_s for r in records] == pytest.approx([0.010] * 6)
    assert rec.summary(Slo(0.5, 0.1))["offered_rate_rps"] is None  # all scheduled at 0
    # without the limit all six share every step
    rec = _run(toy_config(0, 1), toy_profile(CONSTANT), work, fast=fast).recorder
    np.testing.assert_allclose(rec.end, 0.05)
    assert rec.sent is rec.arrival


def test_a_refused_request_frees_its_place_in_flight() -> None:
    # one slot: a prompt past the context is refused at once and the next one is sent
    work = workload(np.zeros(3), 100, 5)
    work.prompt_len[0] = 10**6
    rec = _run(toy_config(0, 1), toy_profile(CONSTANT), work, max_concurrency=1).recorder
    assert rec.error[0] != 0 and (rec.error[1:] == 0).all()
    np.testing.assert_allclose(rec.sent, [0, 0, 0.05])
    with pytest.raises(InvalidArgumentError, match="max_concurrency"):
        SimOptions(max_concurrency=0)


def _poisson(n: int, rate: float, seed: int = 0) -> np.ndarray:
    return wl.arrival_times("poisson", rate, n, None, seed=seed)


LINEAR = StepModel(overhead_s=0.004, s_per_token=2e-5, s_per_ctx=2e-7, s_per_seq=5e-5)


def _pcts(run: SimRun) -> dict[str, float]:
    s = run.recorder.summary(run_slo())
    return {f"{k}.{p}": s[k][p] for k in ("ttft_ms", "tpot_ms", "e2e_ms") for p in ("p50", "p90")}


def run_slo() -> Slo:
    return Slo(1.0, 0.1)


def test_fast_mode_equals_full_mode_on_one_instance() -> None:
    # One instance: the fast mode cuts its runs at exactly the step boundaries the
    # full mode steps through, so every latency agrees to rounding.
    rng = np.random.default_rng(1)
    work = workload(_poisson(150, 4.0), rng.integers(20, 400, 150), rng.integers(2, 60, 150))
    full = _run(toy_config(0, 1), toy_profile(LINEAR), work, fast=False)
    fast = _run(toy_config(0, 1), toy_profile(LINEAR), work, fast=True)
    np.testing.assert_allclose(fast.recorder.first, full.recorder.first, rtol=1e-9)
    np.testing.assert_allclose(fast.recorder.end, full.recorder.end, rtol=1e-9)
    assert sum(x.stats.runs for x in fast.instances) < sum(x.stats.runs for x in full.instances) / 2


def test_fast_mode_close_to_full_mode_disaggregated() -> None:
    # Several instances: routing reads each instance's reported mean step time,
    # which a fast-mode run updates once per run, so placements may differ a
    # little. Percentiles agree within 5%.
    rng = np.random.default_rng(2)
    work = workload(_poisson(300, 12.0), rng.integers(50, 600, 300), rng.integers(2, 80, 300))
    full = _pcts(_run(toy_config(2, 3), toy_profile(LINEAR), work, fast=False))
    fast = _pcts(_run(toy_config(2, 3), toy_profile(LINEAR), work, fast=True))
    for key, value in full.items():
        assert fast[key] == pytest.approx(value, rel=0.05), key


@pytest.mark.parametrize("prefill", [0, 1])
def test_requests_past_the_context_fail_as_the_front_door_refuses_them(prefill: int) -> None:
    # The toy model's context is 4,096 tokens. Colocated, a 5,000-token prompt used to
    # wait forever for room it could never get; now it fails at arrival, as the live
    # front door answers it (a 400 naming the field), and the others are served.
    work = workload(
        np.arange(4) * 0.5, np.array([100, 5000, 4000, 4000]), np.array([5, 5, 200, 96])
    )
    rec = _run(toy_config(prefill, 1), toy_profile(CONSTANT), work, fast=True).recorder
    assert rec.error.tolist() == [0, 3, 4, 0]
    assert [r.error for r in rec.records()][1:3] == [
        "invalid: prompt: no room to generate within the context limit",
        "invalid: max_tokens: prompt + max_tokens exceed the context limit",
    ]
    assert rec.tokens[[0, 3]].tolist() == [5, 96]


def test_preemption_under_a_small_kv_cache_finishes_everything() -> None:
    # 40 blocks of 16 tokens for 8 requests of up to 300 tokens: the scheduler must
    # preempt; every request still finishes and every block comes back.
    work = workload(np.zeros(8), 200, 100)
    for fast in (False, True):
        run = _run(toy_config(0, 1, ", num_blocks: 40"), toy_profile(CONSTANT), work, fast=fast)
        assert (run.recorder.error == 0).all()
        assert (run.recorder.tokens == 100).all()
        assert sum(x.scheduler.num_preemptions for x in run.instances) > 0


@pytest.mark.parametrize("prefill, extra", [(0, ", num_blocks: 40"), (2, "")])
def test_token_counts_without_itl_equal_the_per_token_counts(prefill: int, extra: str) -> None:
    # Without ITL samples a request's tokens are counted at its finish, not per
    # step: counts, first-token and end times must come out the same, through
    # preemptions (a small cache, colocated) and hand-offs (disaggregated).
    rng = np.random.default_rng(3)
    work = workload(_poisson(120, 30.0), rng.integers(20, 300, 120), rng.integers(1, 90, 120))
    config, profile = toy_config(prefill, 2, extra), toy_profile(LINEAR)
    counted = _run(config, profile, work, keep_itl=True)
    at_finish = _run(config, profile, work, keep_itl=False)
    for key in ("tokens", "first", "end", "error"):
        got, want = getattr(at_finish.recorder, key), getattr(counted.recorder, key)
        np.testing.assert_array_equal(got, want, err_msg=key)
    assert (counted.recorder.tokens == work.output_len).all()
    preempted = sum(x.scheduler.num_preemptions for x in at_finish.instances)
    assert preempted > 0 if prefill == 0 else preempted == 0


def test_planner_in_on_mode_adds_decode_under_overload() -> None:
    slow = StepModel(overhead_s=0.002, s_per_seq=0.004)  # TPOT grows with the batch
    work = workload(_poisson(400, 20.0), 64, 40)
    run = _run(toy_config(1, 1, planner="on"), toy_profile(slow), work, startup_s=0.5)
    assert any(d["action"] == "add_decode" for d in run.decisions)
    assert max(row["east.decode"] for row in run.counts) > 1


def test_a_run_leaves_no_cyclic_garbage() -> None:
    # A run pauses the cyclic collector (sim/options.py): what it drops must be
    # freed by reference counting alone, or memory would grow with the requests.
    work = workload(_poisson(300, 40.0), 120, 20)
    cluster = SimCluster(toy_config(1, 2), book(toy_profile(LINEAR)), work, SimOptions())
    assert gc.isenabled()
    gc.collect()
    run = cluster.run()
    assert gc.isenabled(), "the collector is enabled again after the run"
    assert gc.collect() == 0, "the run made reference cycles"
    _check_no_leaks(run)


@pytest.mark.parametrize("fast", [False, True])
def test_a_step_after_idling_takes_the_cold_time(fast: bool) -> None:
    # Requests 10 s apart: each one's first step follows 10 s of idling and takes
    # twice its 10 ms; the decode steps after it follow at once and do not.
    cold = StepModel(overhead_s=0.010, cold_factor=1.0)
    run = _run(
        toy_config(0, 1), toy_profile(cold), workload(np.arange(5) * 10.0, 100, 5), fast=fast
    )
    rec = run.recorder
    np.testing.assert_allclose(rec.first - rec.arrival, 0.020)
    np.testing.assert_allclose(rec.end - rec.arrival, 0.060)


def test_a_step_beside_another_instances_step_takes_the_shared_time() -> None:
    # Request 1 arrives at 20 ms, while request 0's first decode step (15-25 ms)
    # runs: on one host its prefill step takes twice its 10 ms; on separate hosts not.
    shared = toy_profile(StepModel(overhead_s=0.010, shared_factor=1.0), latency_s=0.005)
    work = workload(np.array([0.0, 0.020]), 100, 5)
    apart = _run(toy_config(1, 1), shared, work, fast=False).recorder
    np.testing.assert_allclose(apart.first - apart.arrival, 0.010)
    together = _run(toy_config(1, 1), shared, work, fast=False, one_host=True).recorder
    np.testing.assert_allclose(together.first - together.arrival, [0.010, 0.020])
    assert (together.end > apart.end).all()


@pytest.mark.parametrize(("cores", "ttft"), [(0, 0.010), (2, 0.010), (1, 0.015), (1.5, 0.035 / 3)])
def test_instances_on_a_host_of_few_cores_share_them(cores: float, ttft: float) -> None:
    # Two colocated instances of one thread each; a 10 ms step on one from 0 ms, on
    # the other from 5 ms. On one core they share it from 5 ms: the first's last 5 ms
    # take 10 (ends at 15), the second's first 10 ms of time do 5 ms of work and its
    # last 5 run alone (ends at 20). On 1.5 cores each runs at 3/4 speed while both do.
    # On two cores, or devices of their own (0), neither slows.
    run = _run(
        toy_config(0, 2),
        toy_profile(CONSTANT),
        workload(np.array([0.0, 0.005]), 100, 1),
        fast=False,
        host_cores=cores,
    )
    assert {i.threads for i in run.instances} == {1}
    rec = run.recorder
    assert {r.instance_id for r in run.instances if r.stats.runs} == {
        i.instance_id for i in run.instances
    }
    np.testing.assert_allclose(rec.first - rec.arrival, [ttft, ttft])


def test_a_negative_host_core_count_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="host_cores"):
        SimOptions(host_cores=-1)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (", max_model_len: 5000", "exceeds the model's"),
        (", max_model_len: 4096, num_blocks: 100", "do not fit"),
    ],
)
def test_an_instance_takes_the_engines_context_limit_rule(extra: str, why: str) -> None:
    # the engine's own rule (resolve_max_model_len), not a copy: past the toy model's
    # 4,096 positions, or past what the pool holds, the config is refused
    work = workload(np.zeros(1), 100, 5)
    with pytest.raises(InvalidArgumentError, match=why) as e:
        _run(toy_config(0, 1, extra), toy_profile(CONSTANT), work)
    assert e.value.field == "max_model_len"
