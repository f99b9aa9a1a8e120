"""EPLB placement (pure): every expert held, equal slots per rank, less imbalance."""

from __future__ import annotations

import pytest

from pdserve.core.config import ParallelConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.models.eplb import (
    Placement,
    imbalance,
    place,
    rank_loads,
    replica_counts,
    slots_per_rank,
    static_placement,
)
from pdserve.parallel.expert_slots import decode_rebalance, encode_rebalance, is_rebalance

SKEWED = [0, 0, 10, 20, 30, 40, 900, 500]  # the hot experts share rank 1 statically


def test_static_placement_is_the_layout_without_eplb():
    assert static_placement(8, 0, 2).rank_slots(0) == (0, 1, 2, 3)
    assert static_placement(8, 0, 2).rank_slots(1) == (4, 5, 6, 7)
    assert static_placement(4, 2, 2).slots == (0, 1, 2, 3, 0, 1)


@pytest.mark.parametrize(("redundant", "ep"), [(0, 2), (2, 2), (4, 4), (8, 2), (4, 2)])
@pytest.mark.parametrize("load", [SKEWED, [1] * 8, [0] * 8, list(range(8))])
def test_every_expert_is_held_and_ranks_hold_equal_slots(load, redundant, ep):
    p = place(load, redundant, ep)
    p.check(8)
    assert len(p.slots) == 8 + redundant
    assert all(len(p.rank_slots(r)) == (8 + redundant) // ep for r in range(ep))
    for e, slots in p.replicas.items():
        assert len({s // p.slots_per_rank for s in slots}) == len(slots), "replicas share a rank"
        assert e in range(8)
    assert sum(rank_loads(load, p)) == pytest.approx(sum(load))


def test_hot_experts_get_the_replicas():
    assert replica_counts(SKEWED, 2, cap=2) == [1, 1, 1, 1, 1, 1, 2, 2]
    assert replica_counts([100, 1, 1, 1], 3, cap=4) == [4, 1, 1, 1]
    assert replica_counts([100, 1, 1, 1], 3, cap=2) == [2, 2, 2, 1]


@pytest.mark.parametrize(("redundant", "bound"), [(0, 1.25), (2, 1.1), (4, 1.1)])
def test_placement_from_a_skewed_load_beats_the_static_one(redundant, bound):
    before = imbalance(rank_loads(SKEWED, static_placement(8, redundant, 2)))
    after = imbalance(rank_loads(SKEWED, place(SKEWED, redundant, 2)))
    assert after < before
    assert before > 1.8 and after < bound  # without replicas the 900 sits alone


def test_replicas_lower_imbalance_past_what_moving_experts_can():
    load = [1000, 10, 10, 10]
    moved = imbalance(rank_loads(load, place(load, 0, 2)))
    replicated = imbalance(rank_loads(load, place(load, 2, 2)))
    assert moved > 1.9 and replicated < 1.1


def test_placement_is_deterministic():
    assert place(SKEWED, 2, 2) == place(list(SKEWED), 2, 2)


def test_a_bad_placement_is_refused():
    with pytest.raises(ValueError, match="does not hold"):
        Placement((0, 1, 1, 2), 2).check(4)


@pytest.mark.parametrize(
    ("experts", "redundant", "ep", "reason"),
    [(4, 1, 2, "do not split evenly"), (4, 6, 2, "at most 4"), (4, -1, 2, ">= 0")],
)
def test_impossible_redundancy_names_the_field(experts, redundant, ep, reason):
    with pytest.raises(InvalidArgumentError) as err:
        slots_per_rank(experts, redundant, ep)
    assert err.value.field == "redundant_experts" and reason in str(err.value)


def test_config_checks_redundant_experts():
    assert ParallelConfig(expert_parallel_size=2, redundant_experts=2).redundant_experts == 2
    for bad in (dict(redundant_experts=-1), dict(redundant_experts=2)):
        with pytest.raises(InvalidArgumentError) as err:
            ParallelConfig(**bad)
        assert err.value.field == "redundant_experts"


def test_the_rebalance_message_is_no_step_plan():
    from pdserve.core.step import StepPlan

    message = encode_rebalance({3: [5, 1]})
    assert is_rebalance(message) and decode_rebalance(message) == {3: [5, 1]}
    assert decode_rebalance(encode_rebalance(None)) is None
    assert not is_rebalance(StepPlan(0, []).to_msgpack())
