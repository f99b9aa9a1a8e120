"""Attention-FFN disaggregation: attention and experts on different ranks keep greedy tokens."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.config import ParallelConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.layout import plan_layout
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


def test_afd_on_a_disaggregated_decode_instance_names_the_field(ray_session, references) -> None:
    """The KV transfer of a prefill/decode pair does not reach afd ranks yet: refused."""
    folder, _, _ = references("mixtral")
    with pytest.raises(InvalidArgumentError) as err:
        LLM(str(folder), disaggregated=True, decode=dict(afd=True), num_cpus_per_rank=0.5)
    assert err.value.field == "afd" and "disaggregated" in str(err.value)
