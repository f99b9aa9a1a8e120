"""Prefix-cache tenants over HTTP on a real local cluster: a key's repeat reports the
tokens it found cached (``usage.prompt_tokens_details.cached_tokens``), another key
sending the same prompt finds none and learns nothing, keys of one tenant share.

Region ``local`` prefills on a prefill instance and hands the KV to its decode
instance; region ``solo`` has no prefill instance, so its decode instance
prefills every prompt itself. Each test pins its requests to one region.
"""

from __future__ import annotations

import json
import time

import pytest

from pdserve.router.config import RegionSpec, RouterConfig
from tests.e2e.raw_http import get, raw_post
from tests.e2e.tiny_cluster import Cluster

BLOCK = 16  # the tiny cluster's page size
KEYS = ("key-a", "key-b", "key-c", "key-d")


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = Cluster({"local": (1, 1), "solo": (0, 1)})
    # Far apart, so the router keeps each request in the region it names (a region named
    # is a home, not a pin: with no latency between them the router may place elsewhere).
    regions = (RegionSpec("local", {"solo": 30.0}), RegionSpec("solo", {"local": 30.0}))
    config = RouterConfig(
        model_name="tiny",
        regions=regions,
        api_keys=KEYS,
        api_key_tenants=(("key-c", "team"), ("key-d", "team")),
    )
    _, doors = c.router(config)
    c.doors = doors
    # While region local's prefill instance is not available to the router (at start,
    # and now and then on a loaded machine) the decode instance prefills (without_prefill:
    # local); a repeat that then goes to the prefill instance is honestly a miss there.
    deadline = time.monotonic() + 60
    while get(doors, "/ready")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    for region in ("local", "solo"):
        _send(c, "key-c", _prompt(99), region)
    time.sleep(1.0)
    yield c
    c.shutdown()


def _prompt(seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1100 for i in range(188)]


def _send(cluster, key: str, prompt: list[int], region: str, **extra) -> tuple[int, float]:
    """(cached_tokens, seconds to the answer) of a two-token completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "region": region, **extra}
    start = time.monotonic()
    status, answer = raw_post(cluster.doors, "/v1/completions", json.dumps(body).encode(), key)
    assert status == 200, answer
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return usage["prompt_tokens_details"]["cached_tokens"], time.monotonic() - start


def _hits(cluster) -> int:
    return sum(s.prefix_hits for s in cluster.stats().values())


@pytest.mark.parametrize("region", ["local", "solo"], ids=["disaggregated", "colocated"])
def test_a_key_hits_its_own_prompt_and_no_other_key_does(cluster, region) -> None:
    prompt, full = _prompt(1 if region == "local" else 2), (188 - 1) // BLOCK * BLOCK
    cold, cold_s = _send(cluster, "key-a", prompt, region)
    assert cold == 0
    hits = _hits(cluster)
    repeats = [_send(cluster, "key-a", prompt, region) for _ in range(2)]
    cached = [c for c, _ in repeats]
    if region == "solo":  # one instance serves every request
        assert cached == [full, full]  # every full page but the last
    else:  # a repeat sent to an instance that did not prefill the prompt before misses there
        assert full in cached and set(cached) <= {0, full}, cached
    # What the instances counted (a decode instance holding the pages counts them too).
    assert _hits(cluster) >= hits + full
    # Key b sends a's exact prompt: a cold prompt, as far as b can tell and as the
    # instances count it.
    hits = _hits(cluster)
    other, other_s = _send(cluster, "key-b", prompt, region)
    assert other == 0 and _hits(cluster) == hits
    # A new salt of a's own starts cold too; the salt's repeat hits.
    assert _send(cluster, "key-a", prompt, region, cache_salt="s1")[0] == 0
    salted = _send(cluster, "key-a", prompt, region, cache_salt="s1")[0]
    assert salted == full or (region == "local" and salted == 0)
    # Timings on a loaded 2-core machine say little; only a gross inversion fails.
    hit_s = min(s for _, s in repeats)
    assert hit_s < max(cold_s, other_s) * 3, (hit_s, cold_s, other_s)


def test_keys_of_one_tenant_share_their_prefix_cache(cluster) -> None:
    prompt, full = _prompt(3), (188 - 1) // BLOCK * BLOCK
    assert _send(cluster, "key-c", prompt, "solo")[0] == 0
    assert _send(cluster, "key-d", prompt, "solo")[0] == full
    assert _send(cluster, "key-a", prompt, "solo")[0] == 0
    cluster.assert_idle()
