"""Expert load: counted on each rank, summed over ranks, imbalance per layer, exported."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve import LLM, SamplingParams
from pdserve.cluster.expert_load import ExpertLoadReader, imbalance
from pdserve.core.layout import Layout
from pdserve.core.snapshot import ClusterSnapshot, ExpertLoad, InstanceCounters, SnapshotCollector
from pdserve.models.moe import expert_load

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_imbalance_is_max_over_mean_per_expert_or_per_rank():
    assert imbalance([10, 10, 10, 10]) == 1.0
    assert imbalance([40, 0, 0, 0]) == 4.0
    assert imbalance([30, 10, 0, 0], parts=2) == 2.0  # ranks hold experts {0,1} and {2,3}
    assert imbalance([0, 0]) == 1.0


@dataclass
class _Group:
    layout: Layout


@dataclass
class _Instance:
    instance_id: str
    group: _Group


def test_the_reader_sums_ranks_and_measures_the_recent_window():
    reader = ExpertLoadReader()
    inst = _Instance("i", _Group(Layout(1, 1, 2, ((0, 2),))))
    update = reader._update  # (instance, tokens routed per rank, rows computed per rank)
    first = update(inst, [{0: [8, 0, 0, 0]}, {0: [0, 0, 4, 4]}], [{0: 8}, {0: 8}])  # type: ignore[arg-type]
    assert first.tokens == {0: [8, 0, 4, 4]}
    assert first.by_expert[0] == 2.0 and first.by_rank[0] == 1.0
    later = update(inst, [{0: [8, 4, 0, 0]}, {0: [0, 0, 4, 4]}], [{0: 12}, {0: 8}])  # type: ignore[arg-type]
    assert later.by_expert[0] == 4.0 and later.by_rank[0] == 2.0, "only the 4 new tokens count"
    again = update(inst, [{0: [8, 4, 0, 0]}, {0: [0, 0, 4, 4]}], [{0: 12}, {0: 8}])  # type: ignore[arg-type]
    assert again.by_rank[0] == 2.0, "no new tokens: the last ratio stays"


def test_with_replicas_the_ranks_work_is_what_they_computed():
    """EPLB split a hot expert over both ranks: by expert it is hot, by rank it is even."""
    reader = ExpertLoadReader()
    inst = _Instance("i", _Group(Layout(1, 1, 2, ((0, 2),))))
    load = reader._update(inst, [{0: [12, 0, 0, 0]}, {0: [0, 0, 0, 0]}], [{0: 6}, {0: 6}])  # type: ignore[arg-type]
    assert load.by_expert[0] == 4.0 and load.by_rank[0] == 1.0


def test_one_rank_counts_every_routed_token(references):
    folder, prompts, _ = references("mixtral")
    llm = LLM(str(folder), enable_prefix_caching=False)
    try:
        llm.generate(prompts[:3], GREEDY)
        model = llm.engine.executor.runner.model  # type: ignore[attr-defined]
        counts = expert_load(model, 0)
        computed = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts[:3])
        assert sorted(counts) == [0, 1, 2]
        assert all(sum(c) == computed * 2 for c in counts.values())  # top-2 routing
    finally:
        llm.shutdown()


def test_the_snapshot_exports_tokens_and_imbalance():
    load = ExpertLoad({3: [5, 1]}, {3: 1.6667}, {3: 1.0})
    counters = InstanceCounters("d0", "east", "decode", expert_load=load)
    collector = SnapshotCollector()
    collector.snapshot = ClusterSnapshot(0.0, [], [counters])
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'pdserve_moe_expert_tokens_total{expert="0",instance="d0",layer="3"' in text
    assert 'pdserve_moe_imbalance_ratio{instance="d0",layer="3",over="rank"' in text


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1), (2, 2)])
def test_ranks_together_count_each_token_once(ray_session, references, tp, ep):
    import ray

    folder, prompts, _ = references("mixtral")
    llm = LLM(
        str(folder),
        tensor_parallel_size=tp,
        expert_parallel_size=ep,
        num_cpus_per_rank=0.5,
        enable_prefix_caching=False,
    )
    try:
        llm.generate(prompts[:3], GREEDY)
        per_rank = ray.get([w.expert_load.remote() for w in llm.instance.workers])
        computed = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts[:3])
        for layer in range(3):
            total = sum(sum(r.get(layer, [])) for r in per_rank)
            assert total == computed * 2, (layer, per_rank)
    finally:
        llm.shutdown()
