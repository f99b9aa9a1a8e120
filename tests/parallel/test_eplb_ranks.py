"""EPLB on real ranks: replicas and re-placement keep greedy tokens; skewed routing evens out."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.bench.eplb import EplbSetup, measure
from pdserve.core.errors import InvalidArgumentError
from tests.reference import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


def test_replicas_keep_greedy_tokens_across_replacements(ray_session, references) -> None:
    """Mixtral (4 experts), ep=2 with 2 redundant slots: 3 slots a rank."""
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        expert_parallel_size=2,
        redundant_experts=2,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
    )
    leader = llm.instance.leader
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert tokens == reference
        # Every routed (token, expert) pair was computed by exactly one rank's slot.
        workers = llm.instance.workers
        routed = ray_session.get([w.expert_load.remote() for w in workers])
        rows = ray_session.get([w.expert_rows.remote() for w in workers])
        for layer in range(3):
            assert sum(sum(r[layer]) for r in routed) == sum(r[layer] for r in rows) > 0
        # Expert 3 hot: it gets both replicas, one on each rank.
        skewed = {layer: [10, 20, 30, 1000] for layer in range(3)}
        placed = ray_session.get(leader.rebalance_experts.remote(skewed))
        assert sorted(placed) == [0, 1, 2]
        for slots in placed.values():
            assert sorted(slots) == [0, 1, 2, 2, 3, 3] and 3 in slots[:3] and 3 in slots[3:]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert tokens == reference
        # Again, from what the ranks counted since the last placement.
        ray_session.get(leader.rebalance_experts.remote())
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert tokens == reference
        llm.check_idle()
    finally:
        llm.shutdown()


def test_slots_that_do_not_split_over_the_ranks_are_refused(ray_session, references) -> None:
    folder, _, _ = references("mixtral")
    with pytest.raises(InvalidArgumentError) as err:
        LLM(str(folder), expert_parallel_size=2, redundant_experts=1, num_cpus_per_rank=0.5)
    assert err.value.field == "redundant_experts" and "5 slots" in str(err.value)


def test_skewed_routing_evens_out_over_ranks_after_replacement() -> None:
    """One MoE layer on two gloo processes; the router's bias sends most tokens to
    experts 6 and 7, which statically share rank 1."""
    result = measure(EplbSetup(hidden=64, inter=128, tokens=64, bias=2.0, steps=2))
    before, after = result["before"], result["after"]
    assert before["imbalance_by_rank"] > 1.5
    assert after["imbalance_by_rank"] < 1.2
    assert (
        sum(before["rows_per_rank"]) == sum(after["rows_per_rank"]) == 64 * 2 * 2
    )  # top-2, 2 steps
    assert result["diff"] < 1e-5, "replicas hold the same weights"
    placement = after["placement"]
    assert set(placement) == set(range(8)) and placement.count(6) == placement.count(7) == 2


def test_the_leader_re_places_the_experts_periodically_while_serving(
    ray_session, references
) -> None:
    """With rebalance_interval_s the leader re-places between steps on its own; tokens
    generated meanwhile stay the reference's."""
    import time

    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        expert_parallel_size=2,
        redundant_experts=2,
        rebalance_interval_s=0.2,
        rebalance_min_tokens=1,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
    )
    leader = llm.instance.leader
    try:
        for _ in range(3):
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
        deadline = time.monotonic() + 10
        while ray_session.get(leader.expert_placement.remote())[0] < 2:
            assert time.monotonic() < deadline, "no periodic re-placement ran"
            time.sleep(0.1)
        _, placement = ray_session.get(leader.expert_placement.remote())
        assert sorted(placement) == [0, 1, 2] and all(len(s) == 6 for s in placement.values())
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
    finally:
        llm.shutdown()
