"""Prefix blocks evicted from a small device pool come back from host memory and disk.

Every run is checked against ``transformers``' greedy tokens; the pool is so
small that each prompt evicts the previous ones, so the second round can only
reuse its prefixes through the lower tiers.
"""

from __future__ import annotations

import pytest

from pdserve import LLM
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.sampling_params import SamplingParams
from tests.reference import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 20  # 320 tokens: the longest parity prompt and little else


def _two_rounds(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, twice over: the second round finds its prefix below the device."""
    out = []
    for _ in range(2):
        for prompt in prompts:
            out.append(list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids))
    return out


@pytest.mark.parametrize(
    "tiers",
    [
        {"host_tier_bytes": 1 << 20},
        {"disk_tier_bytes": 1 << 20},
        {"host_tier_bytes": 40_000, "disk_tier_bytes": 1 << 20},  # host spills to disk
    ],
    ids=["host", "disk", "host+disk"],
)
def test_reloaded_blocks_give_transformers_tokens(references, tmp_path, tiers):
    folder, prompts, want = references("llama")
    llm = LLM(str(folder), num_blocks=NUM_BLOCKS, disk_tier_path=str(tmp_path), **tiers)
    try:
        assert _two_rounds(llm, prompts) == want + want
        counters = llm.engine.kv.tiers.counters
        assert counters.failed_loads == 0
        reloaded = sum(counters.hits.values())
        assert reloaded >= 10, f"only {reloaded} blocks came back from a lower tier"
        if "disk_tier_bytes" in tiers:
            assert counters.hits["disk"] > 0
        llm.check_idle()
        store = llm.engine.executor.runner.tiers
        store.finish()
        assert store.num_files() == llm.engine.kv.tiers.num_blocks("disk")
    finally:
        llm.shutdown()
    assert not list(tmp_path.glob("pdserve-kv-*")), "the disk tier's folder outlived its engine"


def test_corrupt_or_missing_disk_blocks_are_recomputed(references, tmp_path):
    folder, prompts, want = references("llama")
    llm = LLM(
        str(folder), num_blocks=NUM_BLOCKS, disk_tier_bytes=1 << 20, disk_tier_path=str(tmp_path)
    )
    try:
        for prompt, tokens in zip(prompts, want, strict=True):
            assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == tokens
        files = sorted(tmp_path.glob("pdserve-kv-*/*.kv"))
        assert files
        for i, path in enumerate(files):
            if i % 2:
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF  # one flipped bit of K or V
                path.write_bytes(bytes(data))
        for prompt, tokens in zip(prompts, want, strict=True):
            assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == tokens
        assert llm.engine.kv.tiers.counters.failed_loads > 0
        llm.check_idle()
    finally:
        llm.shutdown()


def test_stale_tier_folders_of_dead_processes_are_removed(tiny_path, tmp_path):
    stale = tmp_path / "pdserve-kv-999999999-tp0pp0-dead"
    stale.mkdir()
    (stale / "00.kv").write_bytes(b"x")
    llm = LLM(str(tiny_path), num_blocks=32, disk_tier_bytes=1 << 20, disk_tier_path=str(tmp_path))
    try:
        assert not stale.exists()
    finally:
        llm.shutdown()


def test_bad_tier_settings_are_refused_naming_the_field(tiny_path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = [
        ({"disk_tier_bytes": 1 << 20, "disk_tier_path": str(blocker / "sub")}, "disk_tier_path"),
        ({"disk_tier_bytes": 1 << 20}, "disk_tier_path"),
        ({"disk_tier_bytes": 1 << 60, "disk_tier_path": str(tmp_path)}, "disk_tier_bytes"),
        ({"host_tier_bytes": 1 << 60}, "host_tier_bytes"),
        ({"host_tier_bytes": -1}, "host_tier_bytes"),
        ({"host_tier_eviction": "mru"}, "host_tier_eviction"),
        ({"idle_eviction_s": 0}, "idle_eviction_s"),
        # budgets under one block: the tier was quietly off
        ({"host_tier_bytes": 100}, "host_tier_bytes: 100 bytes hold no KV block"),
        ({"disk_tier_bytes": 100, "disk_tier_path": str(tmp_path)}, "disk_tier_bytes: 100 bytes"),
    ]
    for options, field in bad:
        with pytest.raises(InvalidArgumentError, match=field):
            LLM(str(tiny_path), num_blocks=32, **options)
