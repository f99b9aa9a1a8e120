"""The simulator places requests with the router's own chooser and prefix index."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.cluster.config import parse_config
from pdserve.sim.cluster import SimCluster, SimOptions, SimRun
from pdserve.sim.profile import StepModel
from pdserve.sim.workload import SimWorkload
from tests.sim.helpers import book, toy_config, toy_profile

# Prefill costs per token computed, so a prefix hit shows in the TTFT.
PER_TOKEN = StepModel(overhead_s=0.002, s_per_token=1e-4)
# 16 shared blocks of 16 tokens, then 6 of each request's own: under the 80% cached
# on the decode instance that would make it prefill a prompt itself
PREFIX, TAIL = 256, 96


def _families(n: int, seed: int = 0) -> tuple[SimWorkload, np.ndarray]:
    """Requests 0.5 s apart (nothing queues), each a prompt of one of two families:
    the family's 256-token prefix, then 96 tokens of its own."""
    family = np.random.default_rng(seed).integers(0, 2, n)
    prompts = tuple(
        tuple([3 + f] * PREFIX + [100 + (i * TAIL + k) % 150 for k in range(TAIL)])
        for i, f in enumerate(family)
    )
    lens = np.full(n, PREFIX + TAIL, dtype=np.int64)
    work = SimWorkload(
        np.arange(n) * 0.5,
        lens,
        np.full(n, 4, dtype=np.int64),
        np.zeros(n, dtype=np.int16),
        prompts,
    )
    return work, family


def _run(policy: str, work: SimWorkload) -> SimRun:
    config = toy_config(2, 1, router=f", policy: {policy}")
    return SimCluster(config, book(toy_profile(PER_TOKEN)), work, SimOptions()).run()


def _prefill_tokens(run: SimRun) -> int:
    return sum(x.stats.tokens for x in run.instances if x.role == "prefill")


def test_cost_model_sends_a_prompt_to_the_prefill_instance_holding_its_prefix() -> None:
    n = 24
    work, family = _families(n)
    run = _run("cost_model", work)
    assert (run.recorder.error == 0).all()
    # Each family's prefix is computed once; every later prompt of it finds its
    # prefill instance through the router's index and computes its tail only.
    assert _prefill_tokens(run) == 2 * (PREFIX + TAIL) + (n - 2) * TAIL
    ttft = run.recorder.first - run.recorder.arrival
    first = [int(np.argmax(family == f)) for f in (0, 1)]
    later = np.setdiff1d(np.arange(n), first)
    assert ttft[later].max() < ttft[first].min()  # hits are faster than the misses


def test_the_index_follows_the_block_pools_through_evictions() -> None:
    # 40 blocks a prefill instance: each prompt's own 6 blocks stay cached until
    # later prompts evict them, so the index must drop blocks as well as add them.
    work, _ = _families(24)
    profile = toy_profile(PER_TOKEN, kv_tokens=40 * 16)
    cluster = SimCluster(toy_config(2, 1), book(profile), work, SimOptions())
    cluster.run()
    prefills = [x for x in cluster.all if x.role == "prefill"]
    assert sum(x.kv.pool.num_cached_blocks for x in prefills) < 2 * 16 + 24 * 6  # evicted
    for inst in prefills:
        cached = inst.kv.pool.cached_hashes()
        assert cluster.prefixes.cached_blocks(inst.instance_id, cached) == len(cached)
        assert cluster.prefixes.size(inst.instance_id) == len(cached)


def test_round_robin_recomputes_prefixes_the_other_instance_holds() -> None:
    n = 24
    work, _ = _families(n)
    cost = _prefill_tokens(_run("cost_model", work))
    blind = _prefill_tokens(_run("round_robin", work))
    assert blind >= cost + 2 * PREFIX  # each family's prefix computed on both instances


def test_a_request_spills_to_a_farther_region_only_when_that_is_faster() -> None:
    # 30 prompts of 2,000 tokens arrive at east 50 ms apart (0.2 s of prefill
    # each); west is 30 ms away. Once east's estimated queue outweighs the 60 ms
    # round trip, some go west. West's own prompts, an idle minute later, stay home.
    config = parse_config(
        "model: toy\n"
        "engine: {max_num_seqs: 64, max_num_batched_tokens: 512}\n"
        "regions:\n"
        "  - name: east\n    latency_ms: {west: 30}\n"
        "    prefill: {count: 1}\n    decode: {count: 1}\n"
        "  - name: west\n    latency_ms: {east: 30}\n"
        "    prefill: {count: 1}\n    decode: {count: 1}\n"
        "slo: {ttft_ms: 5000, tpot_ms: 100}\n"
        "router: {max_inflight_per_region: 100000}\n"
    )
    n = 40
    home = np.array([0] * 30 + [1] * 10, dtype=np.int16)
    arrival = np.concatenate([np.arange(30) * 0.05, 60.0 + np.arange(10) * 5.0])
    work = SimWorkload(
        arrival, np.full(n, 2000, dtype=np.int64), np.full(n, 2, dtype=np.int64), home
    )
    run = SimCluster(config, book(toy_profile(PER_TOKEN)), work, SimOptions()).run()
    rec = run.recorder
    assert (rec.error == 0).all()
    assert rec.region[0] == 0  # nothing queued yet: it stays home
    spilled = np.flatnonzero(rec.region[:30] == 1)
    assert 5 < len(spilled) < 25  # east and west share the burst
    assert ((rec.first - rec.arrival)[spilled] > 0.030).all()  # after crossing over
    assert (rec.region[30:] == 1).all()


@pytest.mark.parametrize("policy", ["cost_model", "least_loaded", "round_robin"])
def test_every_policy_places_every_request(policy: str) -> None:
    work, _ = _families(12)
    run = _run(policy, work)
    assert (run.recorder.error == 0).all()
    for inst in run.instances:
        inst.scheduler.check_integrity()
        assert not inst.scheduler.requests and not inst.scheduler.held
