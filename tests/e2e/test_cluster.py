"""The serving cluster on local Ray: controller, scaling under load, failures, planner, role flip."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from pdserve import LLM, SamplingParams
from pdserve.cluster.config import parse_config
from pdserve.cluster.serve import start_controller
from pdserve.core.messages import PrefillRequest
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

BASE = """\
model: builtin:tiny
connector: shm
engine: {{dtype: float32, max_num_batched_tokens: {budget}}}
regions:
  - name: east
    prefill: {{count: {p}, min: 1, max: 3, num_cpus_per_rank: 0.25}}
    decode: {{count: {d}, min: 1, max: 3, num_cpus_per_rank: 0.25}}
slo: {{ttft_ms: {ttft}, tpot_ms: 200}}
server: {{host: 127.0.0.1, grpc_port: 0, http_port: 0}}
auth: {{disabled: true}}
planner: {{mode: "{planner}", interval_s: 0.5, cooldown_s: 1, idle_s: 2}}
disaggregation: {{local_prefill_max_tokens: 4, local_prefill_cached_fraction: 1.0}}
router: {{policy: {policy}}}
{extra}
"""


class Running:
    def __init__(
        self,
        p: int = 1,
        d: int = 1,
        planner: str = "off",
        ttft_ms: int = 2000,
        budget: int = 256,
        policy: str = "cost_model",
        extra: str = "",
    ) -> None:
        text = BASE.format(
            p=p, d=d, planner=planner, ttft=ttft_ms, budget=budget, policy=policy, extra=extra
        )
        self.config = parse_config(text, "test.yaml")
        self.controller, self.endpoints = start_controller(self.config)
        self.stub = pb_grpc.CompletionStub(
            grpc.insecure_channel(f"{self.endpoints.host}:{self.endpoints.grpc_port}")
        )

    def status(self):
        return ray.get(self.controller.status.remote())

    def router_stats(self):
        return ray.get(ray.get(self.controller.router_handle.remote()).stats.remote())

    def decode_stats(self):
        return [ray.get(h.stats.remote()) for h in self.leaders("decode")]

    def leaders(self, role: str):
        return [h for (r, h) in ray.get(self.controller.instance_handles.remote()) if r == role]

    def wait(self, check, timeout_s: float = 90.0, what="") -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, (
                f"timed out waiting for {what() if callable(what) else what or check}"
            )
            time.sleep(0.2)

    def assert_idle(self) -> None:
        self.wait(lambda: ray.get(self.controller.all_idle.remote()), timeout_s=20)

    def stop(self) -> None:
        ray.get(self.controller.stop.remote())
        ray.kill(self.controller)


def generate(
    stub, prompt: str | list[int], max_tokens: int, progress: list[int] | None = None
) -> list[int]:
    if isinstance(prompt, str):
        request = pb.CompletionRequest(prompt=prompt)
    else:
        request = pb.CompletionRequest(prompt_token_ids=pb.TokenIds(ids=prompt))
    request.sampling.CopyFrom(
        pb.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    tokens: list[int] = []
    for chunk in stub.Generate(request, timeout=120):
        tokens.extend(chunk.token_ids)
        if progress is not None:
            progress.append(len(tokens))
    return tokens


def test_scale_up_and_down_under_load_fails_nothing(ray_session) -> None:
    c = Running(p=1, d=1)
    try:
        stop, done, errors = threading.Event(), [], []

        def load(w: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    assert len(generate(c.stub, f"worker {w} request {i} says hello", 16)) == 16
                    done.append(1)
                except Exception as e:  # any failure counts
                    errors.append(repr(e))
                i += 1

        threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        region = ray.get(c.controller.scale.remote("east", 1, 2))
        assert (region.prefill, region.decode) == (1, 2)
        time.sleep(2.0)
        region = ray.get(c.controller.scale.remote("east", 1, 1))
        assert (region.prefill, region.decode) == (1, 1)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        assert errors == [] and len(done) > 10
        events = "\n".join(c.status().events)
        assert "removed" in events and "after draining" in events
        c.assert_idle()
    finally:
        c.stop()


def test_status_answers_while_an_instance_drains(ray_session) -> None:
    """A drain can take as long as the longest request it holds; the controller
    keeps answering (status, health) meanwhile, and the drained requests finish."""
    c = Running(p=1, d=2, policy="round_robin")  # both decode instances get requests
    try:
        errors, threads, results = _streams(c, [f"long request {i}" for i in range(6)], 600)
        # Both decode instances hold requests, so whichever drains has work to finish.
        c.wait(
            lambda: all(s.free_blocks < s.num_blocks for s in c.decode_stats()),
            timeout_s=60,
            what=lambda: f"both decodes busy: {c.decode_stats()} {errors} {len(results)}",
        )
        scaled: list = []
        scaler = threading.Thread(
            target=lambda: scaled.append(ray.get(c.controller.scale.remote("east", 1, 1)))
        )
        scaler.start()
        c.wait(
            lambda: any(i.draining for i in c.status().instances),
            timeout_s=30,
            what="status to show the draining instance",
        )
        assert scaler.is_alive(), "the drain ended before status could see it"
        scaler.join(timeout=300)
        assert (scaled[0].prefill, scaled[0].decode) == (1, 1)
        for t in threads:
            t.join(timeout=300)
        assert errors == [] and all(len(r) == 600 for r in results.values()), errors
        assert not any(i.draining for i in c.status().instances)
        c.assert_idle()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference():
    llm = LLM("builtin:tiny")

    def greedy(prompts: list, n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    return greedy


def _streams(c: Running, prompts: list, n: int, progress: list[int] | None = None):
    results: dict[int, list[int]] = {}
    errors: list[str] = []

    def run(i: int, prompt) -> None:
        try:
            results[i] = generate(c.stub, prompt, n, progress)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return errors, threads, results


def test_killed_decode_mid_stream_loses_and_repeats_nothing(ray_session, reference) -> None:
    c = Running(p=2, d=2)
    try:
        prompts = [f"stream number {i} tells a long story about servers" for i in range(4)]
        want = reference(prompts, 300)
        progress: list[int] = []
        errors, threads, results = _streams(c, prompts, 300, progress)
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
        errors, threads, results = _streams(c, prompts, 8)
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


def test_planner_adds_a_prefill_under_load_and_gives_it_back_when_idle(ray_session) -> None:
    # A 1 ms TTFT SLO: any traffic is a prefill overload.
    c = Running(p=1, d=1, planner="on", ttft_ms=1)
    try:
        for i in range(4):
            generate(c.stub, f"overload {i}", 4)
        c.wait(lambda: c.status().regions[0].prefill == 2)
        decisions = c.status().decisions
        assert (
            decisions[0].action == "add_prefill"
            and "TTFT p90" in decisions[0].reason
            and decisions[0].applied
        )
        # Then no traffic: after idle_s the planner removes one again.
        c.wait(lambda: c.status().regions[0].prefill == 1, timeout_s=60)
        assert any(
            d.action == "remove_prefill" and "no traffic" in d.reason for d in c.status().decisions
        )
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

    def inject(worker) -> None:
        worker.server.loop.call(die if how == "die" else stall)

    ray.get(leader.__ray_call__.remote(inject))


def _events(c: Running) -> str:
    return "\n".join(c.status().events)


def test_dead_engine_loop_is_reported_replaced_and_its_streams_migrate(
    ray_session, reference
) -> None:
    c = Running(p=1, d=2)
    try:
        prompts = [f"a stream that outlives its engine loop {i}" for i in range(4)]
        want = reference(prompts, 200)
        progress: list[int] = []
        errors, threads, results = _streams(c, prompts, 200, progress)
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
        assert "is unhealthy (engine loop stopped" in _events(c)
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
        c.wait(lambda: "made no progress" in _events(c), timeout_s=30, what=lambda: _events(c))

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
    """More prompts than the prefill leader's data-path threads (64) wait for their first
    token; health checks, stats and drops still answer, and nothing is replaced."""
    c = Running(p=1, d=1, budget=32)
    try:
        (prefill,) = c.leaders("prefill")
        before = sorted(i.instance_id for i in c.status().instances)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        refs = [
            prefill.prefill.remote(
                PrefillRequest(f"queued-{i}", [(i * 37 + j) % 1000 + 5 for j in range(600)], params)
            )
            for i in range(200)
        ]
        deadline = time.monotonic() + 2 * c.config.health.ping_timeout_s + 2
        while time.monotonic() < deadline:
            start = time.monotonic()
            ray.get(prefill.ping.remote(), timeout=2)
            ray.get(prefill.stats.remote(), timeout=2)
            assert time.monotonic() - start < 2
            time.sleep(0.5)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        assert len(refs) - len(done) > 64, "the data path emptied too soon to test anything"
        assert ray.get(prefill.drop.remote("no-such-request"), timeout=2) is False
        assert sorted(i.instance_id for i in c.status().instances) == before
        assert all(i.healthy for i in c.status().instances)
        assert "unhealthy" not in _events(c)
        ray.get(refs, timeout=300)
        c.assert_idle()
    finally:
        c.stop()


def test_failed_start_is_retried_with_backoff_until_the_region_is_whole(ray_session) -> None:
    """A scale-up that cannot start (no room) is retried until it can; the controller
    answers status meanwhile, and status and the metrics show the failures."""
    c = Running(p=1, d=1, extra="health: {start_timeout_s: 8, retry_backoff_s: 1}")
    hog = placement_group([{"CPU": ray.available_resources()["CPU"]}])  # no room left
    try:
        ray.get(hog.ready(), timeout=30)
        outcome: list = []

        def scale() -> None:
            try:
                outcome.append(ray.get(c.controller.scale.remote("east", 1, 2)))
            except Exception as e:
                outcome.append(e)

        scaler = threading.Thread(target=scale)
        scaler.start()
        c.wait(lambda: c.status().regions[0].starting == 1, timeout_s=10)
        start = time.monotonic()
        c.status()  # while the start waits for room, outside the controller's lock
        assert time.monotonic() - start < 1.0
        scaler.join(timeout=60)
        assert isinstance(outcome[0], Exception) and "GetTimeoutError" in str(outcome[0])
        c.wait(lambda: c.status().regions[0].failed_starts >= 2, timeout_s=60)
        region = c.status().regions[0]
        assert region.target_decode == 2 and region.decode == 1
        assert "starting a decode instance failed" in region.last_error
        metrics = _metrics(c)
        assert re.search(r'pdserve_planner_decisions_total\{[^}]*action="retry_decode"', metrics)
        remove_placement_group(hog)
        hog = None

        def whole() -> bool:
            r = c.status().regions[0]
            return r.decode == 2 and r.failed_starts == 0

        c.wait(whole, timeout_s=90, what=lambda: c.status().regions)
        assert "is whole again" in _events(c)
        assert len(generate(c.stub, "after the retries", 8)) == 8
        c.assert_idle()
    finally:
        if hog is not None:
            remove_placement_group(hog)
        c.stop()


def _metrics(c: Running) -> str:
    url = f"http://{c.endpoints.host}:{c.endpoints.http_port}/metrics"
    deadline = time.monotonic() + 10
    while True:  # the controller pushes its snapshot every health round
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        if "retry_decode" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.5)
