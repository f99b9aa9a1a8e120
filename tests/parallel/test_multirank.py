"""Instances of several ranks (Ray actors, gloo): TP, PP, EP against transformers."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.core.errors import InstanceFailedError, InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.distributed.context import ParallelContext
from pdserve.kernels.attention import select_backend
from pdserve.models.families import build_model
from pdserve.models.loader import SafeSliceSource, load_checkpoint
from tests.reference import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)

LAYOUTS = [
    ("llama", 2, 1, 1),
    ("llama", 1, 2, 1),
    ("llama", 2, 2, 1),
    ("llama_untied", 2, 1, 1),  # one KV head, replicated on both TP ranks
    ("qwen2", 2, 1, 1),
    ("qwen2", 1, 2, 1),
    ("qwen2", 2, 2, 1),
    ("mixtral", 1, 1, 2),
    ("mixtral", 2, 1, 2),
    ("mixtral", 2, 1, 1),
]


@pytest.mark.parametrize(("name", "tp", "pp", "ep"), LAYOUTS, ids=lambda v: str(v))
def test_layout_matches_transformers(
    ray_session, references, name: str, tp: int, pp: int, ep: int
) -> None:
    folder, prompts, reference = references(name)
    llm = LLM(
        str(folder),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        expert_parallel_size=ep,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
    )
    try:
        assert llm.instance.layout.world_size == max(tp, ep) * pp
        outputs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        llm.check_idle()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "field", "reason"),
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size", "attention heads"),
        (dict(pipeline_parallel_size=4), "pipeline_parallel_size", "3 layers"),
        (dict(expert_parallel_size=2), "expert_parallel_size", "no experts"),
        (dict(pipeline_parallel_size=2, pipeline_layers=(1, 1)), "pipeline_layers", "sums to 2"),
    ],
)
def test_impossible_layout_is_refused_before_any_actor(
    ray_session, references, kwargs: dict, field: str, reason: str
) -> None:
    folder, _, _ = references("llama")
    actors_before = len(ray_session.util.list_named_actors(all_namespaces=True))
    pgs_before = len(ray_session.util.placement_group_table())
    with pytest.raises(InvalidArgumentError) as err:
        LLM(str(folder), **kwargs)
    assert err.value.field == field and reason in str(err.value)
    assert len(ray_session.util.placement_group_table()) == pgs_before
    assert len(ray_session.util.list_named_actors(all_namespaces=True)) == actors_before


def test_ranks_the_cluster_cannot_place_fail_with_what_they_asked(ray_session) -> None:
    # More CPUs than the cluster has: refused at once, naming both counts, before any
    # placement group; CPUs the cluster has but others hold: a clear error once the start
    # timeout passes (it used to be Ray's GetTimeoutError), and the placement group is gone
    from ray.util.placement_group import placement_group, remove_placement_group

    from pdserve.core.config import build_engine_config
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model
    from pdserve.parallel.instance import RankGroup, RankResources

    config = build_engine_config("builtin:tiny", tensor_parallel_size=2)
    model = ModelConfig.from_dir(resolve_model("builtin:tiny"))

    def live() -> int:
        table = ray_session.util.placement_group_table().values()
        return sum(p["state"] != "REMOVED" for p in table)

    before = live()
    with pytest.raises(InvalidArgumentError, match="this layout needs 200 CPUs, the cluster has 4"):
        RankGroup.start(model, config, RankResources(num_cpus=100, start_timeout_s=2))
    assert live() == before
    # Every CPU back from the tests before (Ray returns them asynchronously), then a hog
    # of all but one: sized by what was free at one moment, the hog left room for both
    # ranks once an earlier test's CPU came back, and the ranks were placed.
    total = ray_session.cluster_resources()["CPU"]
    deadline = time.monotonic() + 120
    while ray_session.available_resources().get("CPU", 0) < total:
        assert time.monotonic() < deadline, f"CPUs held: {ray_session.available_resources()}"
        time.sleep(0.2)
    hog = placement_group([{"CPU": total - 1}])
    ray_session.get(hog.ready(), timeout=60)
    try:
        with pytest.raises(
            InstanceFailedError, match=r"2 ranks of \{'CPU': 1.0\} each were not placed within 2 s"
        ):
            RankGroup.start(model, config, RankResources(num_cpus=1.0, start_timeout_s=2))
        assert live() == before + 1  # the hog's alone
    finally:
        remove_placement_group(hog)


def test_dead_rank_fails_the_instance_quickly(ray_session) -> None:
    from pdserve.parallel.instance import _get
    from pdserve.parallel.rank_spec import GenerateItem

    llm = LLM("builtin:tiny", tensor_parallel_size=2, num_cpus_per_rank=0.5)
    try:
        items = [
            GenerateItem(f"r{i}", "hello " * 10, SamplingParams(max_tokens=3000, ignore_eos=True))
            for i in range(4)
        ]
        pending = llm.instance.leader.generate.remote(items)
        time.sleep(1.0)
        killed = time.monotonic()
        ray_session.kill(llm.instance.workers[1])
        with pytest.raises(InstanceFailedError, match="lost a rank"):
            _get(pending, 60)
        assert time.monotonic() - killed < 15
    finally:
        llm.shutdown()


def test_a_follower_whose_loop_fails_leaves_its_groups_so_the_leader_fails_fast(
    ray_session,
) -> None:
    """A follower that stops serving but stays alive (its step raised) must not leave the
    leader waiting out the collective timeout (60 s) for its half of an all-reduce."""
    from pdserve.parallel.instance import _get
    from pdserve.parallel.rank_spec import GenerateItem

    def broken(worker) -> None:  # type: ignore[no-untyped-def]
        def run(plan) -> None:  # type: ignore[no-untyped-def]
            raise RuntimeError("a step that fails on this rank only")

        worker.stage.run = run

    llm = LLM("builtin:tiny", tensor_parallel_size=2, num_cpus_per_rank=0.5)
    try:
        ray_session.get(llm.instance.workers[1].__ray_call__.remote(broken))
        started = time.monotonic()
        pending = llm.instance.leader.generate.remote(
            [GenerateItem("r0", "hello " * 10, SamplingParams(max_tokens=8))]
        )
        with pytest.raises(InstanceFailedError):
            _get(pending, 120)
        assert time.monotonic() - started < 40  # 60 s and more before
    finally:
        llm.shutdown()


def test_each_tp_rank_reads_only_its_slice(references, monkeypatch) -> None:
    folder, _, _ = references("llama")
    config = ModelConfig.from_dir(folder)
    reads: dict[str, list[int]] = {}
    original = SafeSliceSource.__getitem__

    def recording(self, index):
        out = original(self, index)
        reads.setdefault(self.name, []).append(out.numel())
        return out

    monkeypatch.setattr(SafeSliceSource, "__getitem__", recording)
    monkeypatch.setenv("PDSERVE_SHARE_WEIGHTS", "0")  # read the checkpoint, not the node's file
    ctx = ParallelContext(tp_rank=1, tp_size=2)
    model = build_model(
        config,
        ctx,
        torch.float32,
        (0, config.num_layers),
        select_backend("torch", torch.device("cpu")),
    )
    load_checkpoint(model, folder)
    sizes = {name: source.shape for name, source in _shapes(folder).items()}
    assert set(reads) == set(sizes)
    for name, counts in reads.items():
        total = torch.Size(sizes[name]).numel()
        if name.endswith("norm.weight"):
            assert counts == [total], name  # norms are replicated
        else:
            # Every read of a sharded tensor is at most half of it (the tied
            # embedding is read twice: for the embedding and the LM head).
            row = total // sizes[name][0]
            assert all(c <= -(-sizes[name][0] // 2) * row for c in counts), (name, counts, total)


def _shapes(folder):
    from pdserve.models.loader import iter_checkpoint

    return dict(iter_checkpoint(folder))


def test_kv_tiers_on_two_ranks_reload_each_shard_and_agree_on_misses(
    ray_session, references, tmp_path
) -> None:
    """Each TP rank keeps its shard of every offloaded block; a block missing on one rank
    is a miss on both (recomputed), never half a block."""
    folder, prompts, reference = references("llama")
    llm = LLM(
        str(folder),
        tensor_parallel_size=2,
        num_cpus_per_rank=0.5,
        num_blocks=20,
        host_tier_bytes=40_000,
        disk_tier_bytes=1 << 20,
        disk_tier_path=str(tmp_path),
    )
    try:
        for _ in range(2):
            got = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
            assert got == reference
        rank1 = sorted(tmp_path.glob("pdserve-kv-*-tp1pp0-*"))
        assert len(rank1) == 1 and list(rank1[0].glob("*.kv"))
        for path in rank1[0].glob("*.kv"):
            path.unlink()
        got = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
        assert got == reference
        llm.check_idle()
    finally:
        llm.shutdown()
    assert not list(tmp_path.glob("pdserve-kv-*"))
