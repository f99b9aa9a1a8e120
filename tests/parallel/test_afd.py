"""Attention-FFN disaggregation: attention and experts on different ranks keep greedy tokens."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.config import DisaggregationConfig, ParallelConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.layout import plan_layout
from pdserve.core.messages import PeerPrefix, PrefillRequest, ReserveRequest
from pdserve.core.model_config import ModelConfig
from tests.reference import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    ("attention", "experts", "micro_batches"),
    [(1, 1, 1), (1, 2, 2), (2, 1, 2)],
    ids=["1+1", "1+2-pingpong", "2+1-pingpong"],
)
def test_afd_matches_transformers(
    ray_session, references, attention: int, experts: int, micro_batches: int
) -> None:
    """Mixtral (4 experts): the experts on ``experts`` ranks, the attention on ``attention``."""
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        afd=True,
        afd_attention_ranks=attention,
        afd_expert_ranks=experts,
        afd_micro_batches=micro_batches,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
    )
    try:
        assert llm.instance.layout.world_size == attention + experts
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert tokens == reference
        # Every routed (token, expert) pair was routed once, on the expert ranks only.
        workers = llm.instance.workers
        routed = ray_session.get([w.expert_load.remote() for w in workers])
        assert all(not r for r in routed[:attention])
        for layer in range(3):
            total = sum(sum(r[layer]) for r in routed[attention:])
            assert total % 2 == 0 and total > 0  # top-2
        llm.check_idle()
    finally:
        llm.shutdown()


def _mixtral(references) -> ModelConfig:
    folder, _, _ = references("mixtral")
    return ModelConfig.from_dir(folder)


def test_afd_layouts_the_model_cannot_take_are_refused(references) -> None:
    model = _mixtral(references)
    cases = [
        (dict(afd_expert_ranks=3), "afd_expert_ranks", "4 experts"),
        (dict(afd_attention_ranks=3), "afd_attention_ranks", "heads"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size", "afd_attention_ranks"),
        (dict(expert_parallel_size=2), "expert_parallel_size", "afd_expert_ranks"),
    ]
    for kwargs, field, text in cases:
        with pytest.raises(InvalidArgumentError) as err:
            plan_layout(model, ParallelConfig(afd=True, **kwargs))
        assert err.value.field == field and text in str(err.value)
    layout = plan_layout(model, ParallelConfig(afd=True, afd_expert_ranks=2))
    assert layout.world_size == 3 and layout.expert_ranks() == [1, 2]


def test_afd_on_a_dense_model_names_the_field(references) -> None:
    folder, _, _ = references("llama")
    with pytest.raises(InvalidArgumentError) as err:
        LLM(str(folder), afd=True, num_cpus_per_rank=0.5)
    assert err.value.field == "afd" and "no experts" in str(err.value)


# Prefill plain or EP=2 and decode afd, and back: the KV moves between attention
# ranks only, whatever each instance's expert placement.
PAIRS = [
    ({"expert_parallel_size": 2}, {"afd": True}, "p2p"),  # p2p: decode waits for marks
    ({"afd": True}, {}, "shm"),
]


@pytest.mark.parametrize(
    ("prefill", "decode", "connector"), PAIRS, ids=["ep2-to-afd", "afd-to-plain"]
)
def test_afd_instances_of_a_disaggregated_pair_match_transformers(
    ray_session, references, prefill, decode, connector
) -> None:
    folder, prompts, reference = references("mixtral")
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector=connector,
        prefill=prefill,
        decode=decode,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
        # Prompts the decode instance holds (or can take) at least half of are
        # prefilled there; the others, but for the 1-token one, remotely.
        disaggregation=DisaggregationConfig(
            local_prefill_max_tokens=2, local_prefill_cached_fraction=0.5
        ),
    )
    try:
        _pull_from_peer(ray_session, llm, prompts[3], reference[3])  # the 150-token prompt
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert tokens == reference
        llm.check_idle()
        p, d = llm.backend.prefill, llm.backend.decode
        committed = ray_session.get(d.leader.stats.remote()).leases["committed"]
        assert committed >= 4  # the 3-, 17-, 33- and 260-token prompts at least
        # Pages left the prefill attention ranks and landed on the decode attention
        # ranks only: an expert rank neither sent nor received any.
        for instance, side in ((p, 0), (d, 1)):
            layout = ray_session.get(instance.leader.kv_spec.remote()).layout
            moved = [s[side]["bytes"] for s in _transfer_stats(ray_session, instance)]
            assert moved[0] > 0 or (side, connector) == (1, "shm")  # shm writes, uncounted
            assert not [n for r, n in enumerate(moved) if layout.is_expert_rank(r) and n]
    finally:
        llm.shutdown()


def _transfer_stats(ray_session, instance) -> list[tuple[dict, dict]]:
    return ray_session.get([w.transfer_stats.remote() for w in instance.group.workers])


def _pull_from_peer(ray_session, llm, prompt: list[int], want: list[int]) -> None:
    """The decode instance takes the prompt's prefix from the prefill instance's cache
    (an export: a step with pages to send and no forward), computes the rest."""
    b = llm.backend
    p, d = b.prefill.leader, b.decode.leader
    ray_session.get(p.prefill.remote(PrefillRequest("warm", prompt, GREEDY, None)))
    blocks = (len(prompt) - 1) // ray_session.get(p.kv_spec.remote()).block_size
    peer = PeerPrefix(b.prefill.instance_id, blocks)
    request = ReserveRequest("peer", prompt, GREEDY, peer=peer)
    assert ray_session.get(d.reserve.remote(request, None, None)).local
    (out,) = ray_session.get(d.wait.remote(["peer"]))
    assert out.outputs[0].token_ids == want
    assert ray_session.get(d.stats.remote()).leases["peer_filled"] == 1
