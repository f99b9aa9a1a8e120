"""int8 in disaggregated mode: a pair that agrees serves like one engine; a mismatch is refused."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.config import DisaggregationConfig
from pdserve.core.model_config import ModelConfig
from pdserve.transfer.handshake import IncompatibleInstancesError
from tests.reference import MAX_NEW_TOKENS, parity_prompts

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
# Every prompt longer than 2 tokens is prefilled on the prefill instance.
REMOTE = DisaggregationConfig(local_prefill_max_tokens=2, local_prefill_cached_fraction=1.0)


def test_int8_pair_matches_the_int8_engine(ray_session, reference_models) -> None:
    folder = reference_models("llama")
    prompts = parity_prompts(ModelConfig.from_dir(folder).vocab_size)
    colocated = LLM(str(folder), quantization="int8", max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in colocated.generate(prompts, GREEDY)]
    llm = LLM(
        str(folder),
        quantization="int8",
        disaggregated=True,
        connector="shm",
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
        disaggregation=REMOTE,
    )
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
        llm.check_idle()
    finally:
        llm.shutdown()


def test_int8_prefill_and_float_decode_are_refused(ray_session) -> None:
    with pytest.raises(
        IncompatibleInstancesError, match=r"quantization: prefill .* has int8, decode .* has none"
    ):
        LLM(
            "builtin:tiny",
            disaggregated=True,
            prefill=dict(quantization="int8"),
            num_cpus_per_rank=0.5,
        )
