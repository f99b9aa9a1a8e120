"""A decode instance pre-filled from a prefill instance's cache, on real Ray actors.

The prefill instance prefills a prompt for nobody (no reservation: it only
keeps the prompt's pages as prefix cache). The decode instance is then asked to
reserve the prompt with that instance named as the peer holding its prefix: it
takes the pages over the real connector (re-sharded where the layouts differ),
computes the rest itself, and its tokens equal ``transformers``'.
"""

from __future__ import annotations

import time

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


def test_a_prefill_chosen_for_load_pulls_the_prefix_its_peer_holds(ray_session) -> None:
    """Round robin sends the second prompt to the other prefill instance; the router
    names the first as the peer holding the shared prefix, and the second pulls it
    over the real connector instead of computing it (the decode instance declines
    to prefill: local_prefill_cached_fraction is 1 in these clusters)."""
    from tests.e2e.local_cluster import Running, generate

    c = Running(p=2, d=1, policy="round_robin", router=", peer_kv_s_per_token: 0")
    try:
        shared = [(j * 13) % 900 + 5 for j in range(240)]  # 15 pages
        prompts = [shared + [7 + i] * 10 for i in range(2)]
        want = [
            o.outputs[0].token_ids
            for o in LLM("builtin:tiny").generate(
                prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            )
        ]
        assert generate(c.stub, prompts[0], 6) == want[0]

        def exported() -> int:
            stats = [ray.get(h.stats.remote()) for h in c.leaders("prefill")]
            return sum(s.leases["exported"] for s in stats)

        time.sleep(1.0)  # the prefill's KV events reach the router
        assert generate(c.stub, prompts[1], 6) == want[1]
        stats = [ray.get(h.stats.remote()) for h in c.leaders("prefill")]
        assert sorted(s.leases["peer_filled"] for s in stats) == [0, 1]
        assert exported() == 1
        c.assert_idle()
    finally:
        c.stop()
