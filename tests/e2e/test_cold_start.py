"""Scale to zero on local Ray: cold starts, the bounded cold-start queue, the warm pool.

A region whose planner gave its last decode instance back serves the next
request after a cold start (the decode instance prefills, as the region has no
prefill instance) and refuses what overflows the queue with a retry hint; a
request that waits past the timeout fails with one; with a warm pool the start
takes the pooled instance.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve import LLM, SamplingParams
from tests.e2e.local_cluster import Running, event_log, generate

PROMPT = "a cold start wakes the region"
AT_ZERO = (0, 0, 0, 1)  # prefill min, max; decode min, max


@pytest.fixture(scope="module")
def want() -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return LLM("builtin:tiny").generate([PROMPT], params)[0].outputs[0].token_ids


def test_region_scaled_to_zero_serves_after_a_cold_start_and_refuses_overflow(
    ray_session, want
) -> None:
    c = Running(p=0, d=1, planner="on", bounds=AT_ZERO, router=", cold_start_queue: 1")
    try:
        assert generate(c.stub, PROMPT, 8) == want
        c.wait(lambda: c.status().regions[0].decode == 0, timeout_s=30, what="scale to zero")
        assert any(d.action == "remove_decode" for d in c.status().decisions)
        outcomes: list = [None] * 3

        def ask(i: int) -> None:
            try:
                outcomes[i] = generate(c.stub, PROMPT, 8)
            except grpc.RpcError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        served = [o for o in outcomes if isinstance(o, list)]
        refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
        assert served == [want] and len(refused) == 2, outcomes
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "cold_start_queue" in e.details()
            assert float(dict(e.trailing_metadata())["retry-after"]) > 0
        assert "cold start: a request waits for a decode instance" in event_log(c)
        assert c.router_stats().cold_refused == 2
        c.assert_idle()
    finally:
        c.stop()


def test_a_request_waiting_past_the_timeout_fails_with_a_retry_hint(ray_session) -> None:
    c = Running(p=0, d=0, bounds=AT_ZERO, router=", cold_start_timeout_s: 0.2")
    try:
        ask = {"model": c.config.router.model_name, "prompt": PROMPT, "max_tokens": 4}
        status, headers, body = _post(c, ask)
        assert status == 503 and float(headers["Retry-After"]) > 0, body
        assert "cold_start_timeout_s" in body["error"]["message"]
        # The request asked for an instance even so: it starts, and serves.
        c.wait(lambda: c.status().regions[0].decode == 1, timeout_s=60, what="the cold start")
        assert len(generate(c.stub, PROMPT, 4)) == 4
    finally:
        c.stop()


def test_a_start_takes_the_warm_pools_instance_and_the_pool_refills(ray_session, want) -> None:
    c = Running(p=0, d=0, bounds=AT_ZERO, warm_pool=1)
    try:
        c.wait(lambda: c.status().regions[0].warm == 1, timeout_s=60, what="the warm pool")
        assert generate(c.stub, PROMPT, 8) == want
        assert "from the warm pool" in event_log(c)
        [instance] = c.status().instances
        assert instance.role == "decode" and "-warm-" in instance.instance_id
        c.wait(lambda: c.status().regions[0].warm == 1, timeout_s=60, what="the pool to refill")
        c.assert_idle()
    finally:
        c.stop()


def _post(c: Running, body: dict) -> tuple[int, dict, dict]:
    url = f"http://{c.endpoints.host}:{c.endpoints.http_port}/v1/completions"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())
