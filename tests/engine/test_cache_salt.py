"""Prefix-cache tenants: a request reuses cached KV only of requests with its
``cache_salt``, in the device pool and in the tiers below it, and the hashes a
router or a peer computes for it are the engine's."""

from __future__ import annotations

from pathlib import Path

from pdserve.core.request import Request
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_hash import adapter_salt, block_hashes, first_parent
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_tiers import KVTiers
from pdserve.router.prefix_index import prompt_block_hashes
from tests.servers import greedy, tiny_engine

BS = 4
PROMPT = list(range(3, 40))  # 9 full blocks and a token


def _request(rid: str, salt: str | None) -> Request:
    return Request(rid, PROMPT, SamplingParams(max_tokens=4, cache_salt=salt))


def _cache(kv: KVCacheManager, request: Request) -> None:
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    kv.free(request)
    if kv.tiers is not None:
        kv.tiers.take_ops()  # the step that copies the new blocks down


def test_a_salt_hits_only_its_own_blocks_on_the_device() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    _cache(kv, _request("a", "tenant-a"))
    assert len(kv.find_cached_prefix(_request("a2", "tenant-a"))) == 9
    assert kv.find_cached_prefix(_request("b", "tenant-b")) == []
    assert kv.find_cached_prefix(_request("shared", None)) == []
    _cache(kv, _request("shared", None))
    assert kv.find_cached_prefix(_request("b", "tenant-b")) == []
    assert len(kv.find_cached_prefix(_request("shared2", None))) == 9
    kv.assert_empty()


def test_a_salt_hits_only_its_own_blocks_below_the_device() -> None:
    # 9 device blocks: a second tenant's prompt evicts the first's into the host tier
    kv = KVCacheManager(num_blocks=10, block_size=BS, tiers=KVTiers(host_slots=32, disk_slots=0))
    _cache(kv, _request("a", "tenant-a"))
    _cache(kv, _request("b", "tenant-b"))  # the same tokens: nothing shared, a's evicted
    a_again, c = _request("a2", "tenant-a"), _request("c", "tenant-c")
    device = kv.find_cached_prefix(a_again)
    assert len(device) + len(kv.find_offloaded(a_again, len(device))) == 9
    assert kv.find_cached_prefix(c) == [] and kv.find_offloaded(c, 0) == []


def test_router_peer_and_engine_name_a_tenants_blocks_alike() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    request = _request("a", "tenant-a")
    kv.update_block_hashes(request)
    router = prompt_block_hashes(PROMPT, BS, None, "", "tenant-a")
    peer = block_hashes(PROMPT, BS, parent=first_parent(adapter_salt(None), "tenant-a"))
    assert request.block_hashes == router == peer
    assert router != prompt_block_hashes(PROMPT, BS, None, "", "tenant-b")
    assert prompt_block_hashes(PROMPT, BS) == block_hashes(PROMPT, BS)  # no salt: as before
    with_lora = prompt_block_hashes(PROMPT, BS, "sql", "f1", "tenant-a")
    assert with_lora != router and with_lora != prompt_block_hashes(PROMPT, BS, "sql", "f1")


def test_engine_reports_hits_of_the_same_salt_only(tiny_path: Path) -> None:
    engine = tiny_engine(tiny_path)

    def cached(rid: str, salt: str | None) -> int:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, cache_salt=salt)
        (out,) = engine.generate([(rid, PROMPT, params)])
        return out.metrics.num_cached_prompt_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("a2", "tenant-a") == 36  # every full block but the one of the last token
    assert cached("b1", "tenant-b") == 0  # a's exact prompt: a cold prompt for b
    assert cached("shared", None) == 0
    assert cached("b2", "tenant-b") == 36
    assert greedy(1).cache_salt is None
    engine.assert_idle()
