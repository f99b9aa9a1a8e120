"""A drain that outlives ``health.drain_timeout_s`` loses no request.

One cluster (drain timeout 1 s) serves greedy streams far longer than that
while it (a) scales a decode instance away, (b) promotes a canary and (c)
switches blue/green to a new version. Each time the instance or version that
leaves still holds streams when its timeout passes: the router moves them to
the instances that stay (the rollout's new version, which has the same
weights), the step returns while they still run, and every stream ends with
exactly the tokens of an undisturbed run. Nothing is left behind: every
instance is idle and the router's per-request tables are empty. A cluster of
its own scales to zero under a stream: the stream moves, waits in the
cold-start queue for the decode instance its move asks for, and ends the same.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from tests.e2e.local_cluster import Running

PROMPT = "def drain(instance):"
TOKENS = 1000  # far longer than the drain timeout at the tiny model's pace here
EXTRA = """\
health: {drain_timeout_s: 1}
rollout: {drain_grace_s: 0.2, check_interval_s: 60}
"""


class Stream:
    """One greedy stream on a thread: its tokens, the versions its chunks name, its error."""

    def __init__(self, c: Running) -> None:
        self.tokens: list[int] = []
        self.versions: set[str] = set()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(c,))
        self.thread.start()

    def _run(self, c: Running) -> None:
        request = pb.CompletionRequest(prompt=PROMPT)
        request.sampling.CopyFrom(
            pb.SamplingOptions(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        )
        try:
            for chunk in c.stub.Generate(request, timeout=120):
                self.tokens.extend(chunk.token_ids)
                self.versions.add(chunk.model)
        except BaseException as e:
            self.error = e

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def result(self) -> list[int]:
        self.thread.join(timeout=240)
        assert self.error is None, repr(self.error)
        return self.tokens


def test_a_scale_to_zero_moves_what_outlives_the_drain_to_a_cold_start(ray_session) -> None:
    """Its own cluster (roles may go to 0), before the shared one starts."""
    c = Running(p=1, d=1, bounds=(0, 3, 0, 3), extra="health: {drain_timeout_s: 1}\n")
    try:
        want = Stream(c).result()
        s = Stream(c)
        c.wait(lambda: len(s.tokens) > 20, what="the stream under way")
        region = ray.get(c.controller.scale.remote("east", 0, 0))
        assert (region.prefill, region.decode) == (0, 0)
        assert s.result() == want  # it waited for the decode instance its move woke
        assert c.router_stats().migrations == 1
        assert "cold start" in "\n".join(c.status().events)
        c.assert_idle()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = Running(p=1, d=2, policy="round_robin", extra=EXTRA)
    try:
        want = Stream(c).result()  # the undisturbed run every stream must match
        yield c, want
    finally:
        c.stop()


def migrations(c: Running) -> int:
    return c.router_stats().migrations


def models(c: Running, action: str, **args) -> list[dict]:
    return ray.get(c.controller.models.remote(action, **args))


def check_moved(c: Running, streams: list[Stream], before: int, want: list[int]) -> None:
    """Every stream ends with the undisturbed tokens; some moved; nothing is left behind."""
    for s in streams:
        assert s.result() == want
    assert migrations(c) > before
    assert "s of draining: moved" in "\n".join(c.status().events)
    c.assert_idle()
    router = ray.get(c.controller.router_handle.remote())
    c.wait(
        lambda: not any(ray.get(router.tables.remote()).values()),
        timeout_s=30,
        what=lambda: f"empty router tables: {ray.get(router.tables.remote())}",
    )


def test_a_scale_down_moves_what_outlives_the_drain(cluster) -> None:
    c, want = cluster
    before = migrations(c)
    streams = [Stream(c), Stream(c)]  # round robin: one on each decode instance
    c.wait(
        lambda: all(s.free_blocks < s.num_blocks for s in c.decode_stats()),
        timeout_s=60,
        what=lambda: f"both decodes busy: {c.decode_stats()}",
    )
    began = time.monotonic()
    region = ray.get(c.controller.scale.remote("east", 1, 1))
    assert (region.prefill, region.decode) == (1, 1)
    assert any(s.running for s in streams), (
        f"the scale-down took {time.monotonic() - began:.1f} s: it waited for the streams"
    )
    check_moved(c, streams, before, want)


def test_a_canary_promote_moves_what_outlives_the_drain(cluster) -> None:
    c, want = cluster
    models(c, "rollout", name="builtin:tiny", version="v2", source="builtin:tiny", canary=0.01)
    before = migrations(c)
    streams = [Stream(c), Stream(c)]
    c.wait(lambda: all(len(s.tokens) > 20 for s in streams), what="both streams under way")
    rows = models(c, "promote", name="builtin:tiny")
    assert [(r["version"], r["traffic"]) for r in rows] == [("v2", 1.0)]
    assert any(s.running for s in streams), "the promote waited for the streams"
    check_moved(c, streams, before, want)
    assert all(s.versions == {"builtin:tiny@v1"} for s in streams)  # the version they began on


def test_a_blue_green_switch_moves_what_outlives_the_drain(cluster) -> None:
    c, want = cluster
    before = migrations(c)
    done: list[list[dict]] = []

    def blue_green() -> None:
        done.append(
            models(
                c,
                "rollout",
                name="builtin:tiny",
                version="v3",
                source="builtin:tiny",
                blue_green=True,
            )
        )

    switch = threading.Thread(target=blue_green)
    switch.start()
    # Two streams in their first half at any time while v3 starts: whenever the switch
    # comes, those on v2 still have half their tokens to go, far longer than the drain
    # timeout, so they outlive it and are moved (streams kept merely running may all be
    # near their end at the switch, and finish inside the timeout).
    streams: list[Stream] = []
    while switch.is_alive():
        if sum(s.running and len(s.tokens) < TOKENS // 2 for s in streams) < 2:
            streams.append(Stream(c))
        time.sleep(0.05)
    switch.join()
    assert [(r["version"], r["traffic"]) for r in done[0]] == [("v3", 1.0)]
    assert any(s.running for s in streams), "the switch waited for the streams"
    check_moved(c, streams, before, want)
