"""A decode instance pre-filled from a prefill instance's cache, on real Ray actors.

The prefill instance prefills a prompt for nobody (no reservation: it only
keeps the prompt's pages as prefix cache). The decode instance is then asked to
reserve the prompt with that instance named as the peer holding its prefix: it
takes the pages over the real connector (re-sharded where the layouts differ),
computes the rest itself, and its tokens equal ``transformers``'.
"""

from __future__ import annotations

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.core.config import DisaggregationConfig
from pdserve.core.messages import PeerPrefix, PrefillRequest, ReserveRequest
from tests.reference import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
BLOCK = 16

PAIRS = [
    ("shm", {}, {}),
    ("p2p", {"tensor_parallel_size": 2}, {}),  # arrival marks, two routes into one rank
    ("p2p", {}, {}),
    ("shm", {"tensor_parallel_size": 2}, {}),
]


@pytest.mark.parametrize(("connector", "prefill", "decode"), PAIRS, ids=lambda v: str(v))
def test_the_decode_instance_reuses_the_peers_prefix_with_transformers_tokens(
    ray_session, references, connector, prefill, decode
) -> None:
    folder, prompts, reference = references("llama")
    index = max(range(len(prompts)), key=lambda i: len(prompts[i]))  # the 150-token prompt
    prompt, want = prompts[index], reference[index]
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector=connector,
        prefill=prefill,
        decode=decode,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
        disaggregation=DisaggregationConfig(local_prefill_cached_fraction=0.5),
    )
    try:
        b = llm.backend
        p, d = b.prefill.leader, b.decode.leader
        ray.get(p.prefill.remote(PrefillRequest("warm", prompt, GREEDY, None)))
        blocks = (len(prompt) - 1) // BLOCK
        peer = PeerPrefix(b.prefill.instance_id, blocks)
        res = ray.get(
            d.reserve.remote(ReserveRequest("peer", prompt, GREEDY, peer=peer), None, None)
        )
        assert res.local, "mostly held by the peer: prefilled on the decode instance"
        (out,) = ray.get(d.wait.remote(["peer"]))
        assert out.outputs[0].token_ids == want
        assert out.metrics.num_cached_prompt_tokens == blocks * BLOCK, "only the rest computed"
        ps, ds = ray.get(p.stats.remote()), ray.get(d.stats.remote())
        assert ps.leases["exported"] == 1 and ds.leases["peer_filled"] == 1
        assert ps.sent["bytes"] > 0 and ps.sent["failures"] == 0
        llm.check_idle()
    finally:
        llm.shutdown()
