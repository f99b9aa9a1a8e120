"""The serving cluster on local Ray through failures and a role flip.

Killed instances and dead or stalled engine loops are reported, replaced, and
their streams finish with exactly the tokens a single engine gives; health
checks answer while prompts queue; an idle instance flips role and serves the
same tokens.
"""

from __future__ import annotations

import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.core.errors import RequestAbortedError
from pdserve.core.messages import PrefillRequest
from tests.e2e.local_cluster import Running, event_log, generate, start_streams


@pytest.fixture(scope="module")
def reference():
    llm = LLM("builtin:tiny")

    def greedy(prompts: list, n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    return greedy


def test_killed_decode_mid_stream_loses_and_repeats_nothing(ray_session, reference) -> None:
    c = Running(p=2, d=2)
    try:
        prompts = [f"stream number {i} tells a long story about servers" for i in range(4)]
        want = reference(prompts, 300)
        progress: list[int] = []
        errors, threads, results = start_streams(c, prompts, 300, progress)
        c.wait(lambda: len(progress) >= 4 * 10)  # every stream is decoding
        busiest = max(c.leaders("decode"), key=lambda h: _used_pages(h))
        ray.kill(busiest)
        for t in threads:
            t.join()
        assert errors == []
        assert [results[i] for i in range(4)] == want
        assert c.router_stats().migrations >= 1
        c.wait(lambda: sum(r.decode for r in c.status().regions) == 2)  # replaced
        c.assert_idle()
    finally:
        c.stop()


def _used_pages(leader) -> int:
    stats = ray.get(leader.stats.remote())
    return stats.num_blocks - stats.free_blocks


def test_killed_prefill_mid_prefill_is_rerun(ray_session, reference) -> None:
    c = Running(p=2, d=1, budget=32)
    try:
        prompts = [
            [(i * 37 + j) % 1000 + 5 for j in range(900)] for i in range(2)
        ]  # 29 chunks each
        want = reference(prompts, 8)
        errors, threads, results = start_streams(c, prompts, 8)
        time.sleep(0.4)
        for leader in c.leaders("prefill"):
            ray.kill(leader)  # both: whichever was prefilling
            break
        for t in threads:
            t.join()
        assert errors == []
        assert [results[i] for i in range(2)] == want
        c.wait(lambda: sum(r.prefill for r in c.status().regions) == 2)
        c.assert_idle()
    finally:
        c.stop()


def test_idle_instance_flips_role_without_reloading(ray_session, reference) -> None:
    c = Running(p=1, d=2)
    try:
        assert ray.get(c.controller.flip.remote("east", "decode", "prefill"))
        region = c.status().regions[0]
        assert (region.prefill, region.decode) == (2, 1)
        assert "flipped" in "\n".join(c.status().events)
        prompts = [f"after the flip {i}" for i in range(4)]
        for prompt, want in zip(prompts, reference(prompts, 12), strict=True):
            assert generate(c.stub, prompt, 12) == want
        c.assert_idle()
    finally:
        c.stop()


def _break_engine_loop(leader, how: str, seconds: float = 0.0) -> None:
    """Run a command on a leader's engine loop that kills it ("die") or holds it ("stall").

    Runs inside the live actor (``__ray_call__``); the functions are nested so
    they travel by value.
    """

    class EngineLoopKilled(BaseException):  # not an Exception: the loop thread dies of it
        pass

    def die(engine) -> None:
        raise EngineLoopKilled("the test killed this engine loop")

    def stall(engine) -> None:
        time.sleep(seconds)

    def inject(actor) -> None:
        actor.worker.server.loop.call(die if how == "die" else stall)

    ray.get(leader.__ray_call__.remote(inject))


def test_dead_engine_loop_is_reported_replaced_and_its_streams_migrate(
    ray_session, reference
) -> None:
    c = Running(p=1, d=2)
    try:
        prompts = [f"a stream that outlives its engine loop {i}" for i in range(4)]
        want = reference(prompts, 200)
        progress: list[int] = []
        errors, threads, results = start_streams(c, prompts, 200, progress)
        c.wait(lambda: len(progress) >= 4 * 10)  # every stream is decoding
        busiest = max(c.leaders("decode"), key=lambda h: _used_pages(h))
        old = {i.instance_id for i in c.status().instances if i.role == "decode"}
        _break_engine_loop(busiest, "die")
        seen: list = []

        def reported() -> bool:
            seen.extend(i for i in c.status().instances if not i.healthy)
            return bool(seen)

        c.wait(reported, timeout_s=30, what="status to show the instance unhealthy")
        assert (
            seen[0].role == "decode" and "engine loop stopped: EngineLoopKilled" in seen[0].reason
        )
        for t in threads:
            t.join()
        assert errors == []
        assert [results[i] for i in range(4)] == want
        assert c.router_stats().migrations >= 1

        def replaced() -> bool:
            now = [i for i in c.status().instances if i.role == "decode"]
            return (
                len(now) == 2
                and all(i.healthy for i in now)
                and not old <= {i.instance_id for i in now}
            )

        c.wait(replaced, timeout_s=60, what=lambda: c.status())
        assert "is unhealthy (engine loop stopped" in event_log(c)
        prompt = ["after the replacement"]
        assert generate(c.stub, prompt[0], 12) == reference(prompt, 12)[0]
        c.assert_idle()
    finally:
        c.stop()


def test_stalled_engine_loop_is_replaced_after_the_deadline(ray_session, reference) -> None:
    c = Running(p=1, d=1, extra="health: {stall_timeout_s: 2}")
    try:
        (prefill,) = c.leaders("prefill")
        (old,) = [i.instance_id for i in c.status().instances if i.role == "prefill"]
        _break_engine_loop(prefill, "stall", 15.0)  # busy, finishing nothing
        c.wait(lambda: "made no progress" in event_log(c), timeout_s=30, what=lambda: event_log(c))

        def replaced() -> bool:
            now = [i for i in c.status().instances if i.role == "prefill"]
            return len(now) == 1 and now[0].healthy and now[0].instance_id != old

        c.wait(replaced, timeout_s=60, what=lambda: c.status())
        prompt = ["after the stall"]
        assert generate(c.stub, prompt[0], 12) == reference(prompt, 12)[0]
        c.assert_idle()
    finally:
        c.stop()


def test_health_checks_answer_while_queued_prompts_fill_the_data_path(ray_session) -> None:
    """Many more prompts than the prefill leader's data-path threads (64) wait for their
    first token; health checks, stats and drops still answer, and nothing is replaced.
    Then every prompt is dropped: those in the engine stop, those still queued for a
    data-path thread are refused when they get one, and no page is left held."""
    c = Running(p=1, d=1, budget=32)
    try:
        (prefill,) = c.leaders("prefill")
        before = sorted(i.instance_id for i in c.status().instances)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        refs = [
            prefill.prefill.remote(
                PrefillRequest(f"queued-{i}", [(i * 37 + j) % 1000 + 5 for j in range(600)], params)
            )
            for i in range(640)  # more than the checks below leave time to prefill (a CI run
            # prefilled 259 of 320 in that time)
        ]
        deadline = time.monotonic() + 2 * c.config.health.ping_timeout_s + 2
        while time.monotonic() < deadline:
            start = time.monotonic()
            ray.get(prefill.ping.remote(), timeout=2)
            ray.get(prefill.stats.remote(), timeout=2)
            # each call has 2 s: queued behind the data path they would time out, not
            # merely be slow; both within 4 s leaves margin for two loaded cores
            assert time.monotonic() - start < 4
            time.sleep(0.5)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        assert len(refs) - len(done) > 64, "the data path emptied too soon to test anything"
        assert ray.get(prefill.drop.remote("no-such-request"), timeout=2) is False
        assert sorted(i.instance_id for i in c.status().instances) == before
        assert all(i.healthy for i in c.status().instances)
        assert "unhealthy" not in event_log(c)
        ray.get([prefill.drop.remote(f"queued-{i}") for i in range(len(refs))], timeout=120)
        dropped = 0
        for ref in refs:
            try:
                ray.get(ref, timeout=120)
            except RequestAbortedError:
                dropped += 1
        assert dropped > 64
        c.assert_idle()
    finally:
        c.stop()


def test_a_cluster_on_ipv6_loopback_gets_its_restarted_router_back(ray_session, reference) -> None:
    """A cluster served on ::1 (gRPC and HTTP, the batch self-URL) answers; Ray restarts
    its router after the router's process dies (router.max_restarts), which knows no
    instance then: the controller registers them with it again, on the same ports."""
    import os
    import socket
    import urllib.request

    ports = []
    for _ in range(2):
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            ports.append(s.getsockname()[1])
    server = f"grpc_port: {ports[0]}, http_port: {ports[1]}"
    c = Running(p=1, d=1, host="::1", server=server)
    try:
        assert c.endpoints.grpc_address == f"[::1]:{ports[0]}"
        prompt = ["before the router died"]
        assert generate(c.stub, prompt[0], 6) == reference(prompt, 6)[0]
        with urllib.request.urlopen(f"{c.endpoints.http_url}/health", timeout=30) as r:
            assert r.status == 200
        router = ray.get(c.controller.router_handle.remote())
        router.__ray_call__.remote(lambda self: os._exit(1))
        c.wait(
            lambda: "the router restarted" in event_log(c), timeout_s=90, what=lambda: event_log(c)
        )
        prompt = ["after the router came back"]
        assert generate(c.stub, prompt[0], 6) == reference(prompt, 6)[0]
        c.assert_idle()
    finally:
        c.stop()
