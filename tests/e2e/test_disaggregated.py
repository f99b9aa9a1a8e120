"""Disaggregated prefill/decode on local Ray: parity, aborts, leases, back-pressure."""

from __future__ import annotations

import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.core.config import DisaggregationConfig
from pdserve.core.errors import OverloadedError, RequestAbortedError
from pdserve.core.messages import PrefillRequest, ReserveRequest
from pdserve.core.model_config import ModelConfig
from pdserve.transfer.handshake import IncompatibleInstancesError
from tests.reference import MAX_NEW_TOKENS, hf_greedy, parity_prompts

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
# Only the 1-token prompt is prefilled on decode; cached prompts still go remote
# (their cached pages are skipped), so every transfer path runs.
REMOTE = DisaggregationConfig(local_prefill_max_tokens=2, local_prefill_cached_fraction=1.0)

PAIRS = [
    ("llama", "shm", {}, {}),
    ("llama", "object_store", {}, {}),
    ("llama", "p2p", {}, {}),
    ("llama", "shm", {"tensor_parallel_size": 2}, {}),
    ("llama", "p2p", {}, {"tensor_parallel_size": 2}),
    ("qwen2", "object_store", {"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}),
    ("mixtral", "shm", {"expert_parallel_size": 2}, {}),
    ("qwen2", "nccl", {"tensor_parallel_size": 2}, {}),  # gloo pair groups on the CPU
]


@pytest.fixture(scope="module")
def references(reference_models):
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = reference_models(name)
            prompts = parity_prompts(ModelConfig.from_dir(folder).vocab_size)
            cache[name] = (folder, prompts, hf_greedy(folder, prompts))
        return cache[name]

    return get


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def stats(instance):
    return ray.get(instance.leader.stats.remote())


@pytest.mark.parametrize(("name", "connector", "prefill", "decode"), PAIRS, ids=lambda v: str(v))
def test_disaggregated_matches_colocated_and_transformers(
    ray_session, references, name, connector, prefill, decode
) -> None:
    folder, prompts, reference = references(name)
    colocated = LLM(str(folder), max_num_batched_tokens=64)
    assert tokens(colocated.generate(prompts, GREEDY)) == reference
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector=connector,
        prefill=prefill,
        decode=decode,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
        disaggregation=REMOTE,
    )
    try:
        assert tokens(llm.generate(prompts, GREEDY)) == reference
        # Again: now the decode instance holds the shared prefix, which is not resent.
        assert tokens(llm.generate(prompts, GREEDY)) == reference
        llm.check_idle()
        p, d = stats(llm.backend.prefill), stats(llm.backend.decode)
        assert p.leases["committed"] == d.leases["committed"] == 18
        assert p.sent["bytes"] > 0 and p.sent["failures"] == 0
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tiny_pair(ray_session):
    llm = LLM(
        "builtin:tiny",
        disaggregated=True,
        connector="shm",
        prefill=dict(max_num_batched_tokens=16, max_num_seqs=2),
        num_cpus_per_rank=0.5,
        disaggregation=DisaggregationConfig(local_prefill_max_tokens=4),
    )
    yield llm
    llm.shutdown()


def start(llm, rid: str, prompt: list[int], max_tokens: int = 8, ttl_s: float = 30.0):
    """Reserve on decode and start the prefill, as the router does; returns the refs."""
    b = llm.backend
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    res = ray.get(
        b.decode.leader.reserve.remote(
            ReserveRequest(rid, prompt, params, ttl_s), b.prefill.instance_id, None
        )
    )
    assert not res.local, "the test prompt should be prefilled remotely"
    first = b.prefill.leader.prefill.remote(PrefillRequest(rid, prompt, params, res))
    done = b.decode.leader.wait.remote([rid])
    return res, first, done


def assert_both_idle(llm, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            llm.check_idle()
            return
        except (AssertionError, ray.exceptions.RayTaskError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_abort_while_queued_at_prefill(tiny_pair) -> None:
    long = [5 + (i * 7) % 900 for i in range(1200)]  # 75 chunks of 16 tokens
    _, first_a, done_a = start(tiny_pair, "busy-a", long)
    _, first_b, done_b = start(tiny_pair, "busy-b", long)
    _, first_c, done_c = start(tiny_pair, "queued-c", long)  # max_num_seqs=2: waits at prefill
    tiny_pair.backend.client.abort("queued-c")
    with pytest.raises(RequestAbortedError):
        ray.get(first_c)
    assert ray.get(done_c)[0].outputs[0].finish_reason == "abort"
    for first, done in ((first_a, done_a), (first_b, done_b)):
        ray.get(first)
        assert len(ray.get(done)[0].outputs[0].token_ids) == 8
    assert_both_idle(tiny_pair)


def test_abort_while_prefilling(tiny_pair) -> None:
    # 225 prefill steps of 16 tokens: long enough that the abort lands mid-prefill
    # however fast the CPU kernels are, after a short wait for the prefill to start.
    prompt = [7 + (i * 11) % 800 for i in range(3600)]
    _, first, done = start(tiny_pair, "prefilling", prompt)
    time.sleep(0.15)
    assert not ray.wait([first], timeout=0)[0], "the prompt should still be prefilling"
    tiny_pair.backend.client.abort("prefilling")
    with pytest.raises(RequestAbortedError):
        ray.get(first)
    assert ray.get(done)[0].outputs[0].finish_reason == "abort"
    assert stats(tiny_pair.backend.decode).leases["aborted"] >= 1
    assert_both_idle(tiny_pair)


def test_abort_while_decoding(tiny_pair) -> None:
    _, first, done = start(tiny_pair, "decoding", list(range(300, 360)), max_tokens=2000)
    ray.get(first)
    time.sleep(0.2)
    tiny_pair.backend.client.abort("decoding")
    out = ray.get(done)[0].outputs[0]
    assert out.finish_reason == "abort" and 1 < len(out.token_ids) < 2000
    assert_both_idle(tiny_pair)


def test_abort_around_the_hand_off(tiny_pair) -> None:
    """Abort right as the first token returns, when the hand-off is in flight."""
    for i in range(6):
        _, first, done = start(
            tiny_pair, f"handoff-{i}", [900 - j - 50 * i for j in range(40)], max_tokens=400
        )
        ray.get(first)
        tiny_pair.backend.client.abort(f"handoff-{i}")
        assert ray.get(done)[0].outputs[0].finish_reason == "abort"
    assert_both_idle(tiny_pair)


def test_unfilled_reservation_expires(tiny_pair) -> None:
    decode = tiny_pair.backend.decode
    before = stats(decode)
    params = SamplingParams(max_tokens=4)
    ray.get(
        decode.leader.reserve.remote(
            ReserveRequest("orphan", list(range(5, 100)), params, 0.5), None, None
        )
    )
    assert stats(decode).free_blocks < before.free_blocks
    out = ray.get(decode.leader.wait.remote(["orphan"], 10))[0]
    assert out.outputs[0].finish_reason == "abort"
    after = stats(decode)
    assert after.leases["expired"] == before.leases["expired"] + 1
    assert after.free_blocks == after.num_blocks
    assert_both_idle(tiny_pair)


def test_short_prompt_is_prefilled_on_decode(tiny_pair) -> None:
    b = tiny_pair.backend
    res = ray.get(
        b.decode.leader.reserve.remote(
            ReserveRequest("short", [5, 6, 7], SamplingParams(max_tokens=3)),
            b.prefill.instance_id,
            None,
        )
    )
    assert res.local and res.block_ids == []
    assert len(ray.get(b.decode.leader.wait.remote(["short"]))[0].outputs[0].token_ids) == 3
    assert_both_idle(tiny_pair)


def test_mostly_cached_prompt_is_prefilled_on_decode(tiny_pair) -> None:
    b = tiny_pair.backend
    prompt = list(range(1000, 1100))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    _, first, done = start(tiny_pair, "cache-warm", prompt, max_tokens=3)
    ray.get([first, done])
    res = ray.get(
        b.decode.leader.reserve.remote(
            ReserveRequest("cache-hit", prompt, params), b.prefill.instance_id, None
        )
    )
    assert res.local  # 96 of 100 tokens are cached on decode
    assert (
        ray.get(b.decode.leader.wait.remote(["cache-hit"]))[0].outputs[0].token_ids
        == ray.get(done)[0].outputs[0].token_ids
    )
    assert_both_idle(tiny_pair)


def test_full_decode_makes_requests_wait(ray_session) -> None:
    prompts = [[(i * 31 + j) % 1000 + 3 for j in range(90)] for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference = tokens(LLM("builtin:tiny").generate(prompts, params))
    # 16 pages of 16 tokens hold two of these requests at a time.
    llm = LLM(
        "builtin:tiny",
        disaggregated=True,
        decode=dict(num_blocks=16),
        num_cpus_per_rank=0.5,
        disaggregation=REMOTE,
    )
    try:
        assert tokens(llm.generate(prompts, params)) == reference
        assert stats(llm.backend.decode).leases["refused"] > 0
        # Two held reservations leave 4 free pages: a third is refused, loudly.
        b = llm.backend
        for rid in ("hold-1", "hold-2"):
            ray.get(
                b.decode.leader.reserve.remote(
                    ReserveRequest(rid, prompts[0], params), b.prefill.instance_id, None
                )
            )
        with pytest.raises(OverloadedError, match="no room"):
            try:
                ray.get(
                    b.decode.leader.reserve.remote(
                        ReserveRequest("hold-3", prompts[1], params), b.prefill.instance_id, None
                    )
                )
            except ray.exceptions.RayTaskError as e:
                raise e.cause from None
        for rid in ("hold-1", "hold-2"):
            b.client.abort(rid)
        assert_both_idle(llm)
        llm.check_idle()
    finally:
        llm.shutdown()


def test_dead_prefill_releases_its_reservations(ray_session) -> None:
    llm = LLM("builtin:tiny", disaggregated=True, num_cpus_per_rank=0.5, disaggregation=REMOTE)
    try:
        b = llm.backend
        params = SamplingParams(max_tokens=4)
        ray.get(
            b.decode.leader.reserve.remote(
                ReserveRequest("held", list(range(5, 100)), params, 300),
                b.prefill.instance_id,
                None,
            )
        )
        ray.kill(b.prefill.leader)
        out = ray.get(b.decode.leader.wait.remote(["held"], 20))[0]
        assert out.outputs[0].finish_reason == "abort"
        d = stats(b.decode)
        assert d.leases["peer_lost"] == 1 and d.free_blocks == d.num_blocks
        ray.get(b.decode.leader.check_idle.remote())
    finally:
        llm.shutdown()


def test_incompatible_instances_are_refused(ray_session) -> None:
    with pytest.raises(
        IncompatibleInstancesError, match=r"dtype: prefill .* has float32, decode .* has bfloat16"
    ):
        LLM(
            "builtin:tiny", disaggregated=True, decode=dict(dtype="bfloat16"), num_cpus_per_rank=0.5
        )
