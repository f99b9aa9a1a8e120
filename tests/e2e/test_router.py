"""The router and its front doors against a real local cluster (Ray, gRPC, HTTP)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import LLM, SamplingParams
from pdserve.models.builtin import resolve_model
from pdserve.router.config import RegionSpec, RouterConfig
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from tests.e2e.imported import imported
from tests.e2e.tiny_cluster import AUTH, KEY, Cluster, stub

PROMPT = "Hello there, how are you doing today? Tell me about the weather."


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = Cluster({"local": (1, 1)})
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def doors(cluster):
    return cluster._bootstrap[1]


@pytest.fixture(scope="module")
def reference():
    out = LLM("builtin:tiny").generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    return out.outputs[0]


def openai_client(endpoints, key: str = KEY):
    return openai.OpenAI(
        base_url=f"http://{endpoints.host}:{endpoints.http_port}/v1", api_key=key, max_retries=0
    )


def request(prompt: str = PROMPT, max_tokens: int = 12, **sampling) -> pb.CompletionRequest:
    options = {"max_tokens": max_tokens, "temperature": 0.0, **sampling}
    return pb.CompletionRequest(model="tiny", prompt=prompt, sampling=pb.SamplingOptions(**options))


# -- gRPC -----------------------------------------------------------------------------------


def test_grpc_stream_and_unary_match_the_engine(cluster, doors, reference) -> None:
    chunks = list(stub(doors).Generate(request(), metadata=AUTH))
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert "".join(c.text for c in chunks) == reference.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    assert all(not c.finish_reason for c in chunks[:-1])
    whole = stub(doors).Complete(request(), metadata=AUTH)
    assert list(whole.token_ids) == reference.token_ids and whole.text == reference.text
    assert whole.usage.prompt_tokens == len(LLM_TOKENIZER().encode(PROMPT))
    cluster.assert_idle()


def test_router_and_ranks_load_only_their_own_code_through_the_handles_they_hold(
    cluster, doors
) -> None:
    """Ray loads an actor's class wherever a handle to it is unpickled: the router holds
    the instances' handles, yet imports neither torch nor the rank's code; a CPU rank
    holds the router's, yet imports neither the router nor its front doors, nor Triton."""
    assert len(list(stub(doors).Generate(request(), metadata=AUTH))) > 0
    router = cluster._bootstrap[0]
    assert imported(router, ("torch", "pdserve.cluster.worker")) == []
    router_code = ("pdserve.router.router", "aiohttp", "triton")
    for instance in cluster.instances():
        assert imported(instance.leader, ("torch", "pdserve.cluster.worker")) == [
            "pdserve.cluster.worker",
            "torch",
        ]
        assert imported(instance.leader, router_code) == []


def LLM_TOKENIZER():
    from pdserve.core.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model("builtin:tiny"))


def test_grpc_models_and_health(doors) -> None:
    models = stub(doors).ListModels(pb.ListModelsRequest(), metadata=AUTH)
    assert [m.id for m in models.models] == ["tiny"] and models.models[0].max_model_len > 0
    channel = grpc.insecure_channel(f"{doors.host}:{doors.grpc_port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Completion"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.SERVING
        )


@pytest.mark.parametrize(
    ("req", "metadata", "code", "text"),
    [
        (request(top_p=1.5), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (request(max_tokens=0), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (request(temperature=-1.0), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.CompletionRequest(model="tiny"), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (  # an unknown model is not found, and the valid names are listed
            pb.CompletionRequest(model="other", prompt="x"),
            AUTH,
            grpc.StatusCode.NOT_FOUND,
            "valid names: ['tiny']",
        ),
        (request(prompt="word " * 5000), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (request(), (), grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
        (
            request(),
            (("authorization", "Bearer wrong"),),
            grpc.StatusCode.UNAUTHENTICATED,
            "unknown API key",
        ),
    ],
)
def test_grpc_errors_name_the_problem_and_the_server_keeps_serving(
    doors, req, metadata, code, text
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub(doors).Complete(req, metadata=metadata)
    assert err.value.code() == code and text in err.value.details()
    assert stub(doors).Complete(request(max_tokens=2), metadata=AUTH).finish_reason == "length"


def test_grpc_cancel_mid_stream_frees_pages(cluster, doors) -> None:
    call = stub(doors).Generate(request(max_tokens=3000, ignore_eos=True), metadata=AUTH)
    got = [next(call) for _ in range(3)]
    assert all(c.token_ids for c in got)
    call.cancel()
    cluster.assert_idle()
    assert stub(doors).Complete(request(max_tokens=2), metadata=AUTH).finish_reason == "length"


# -- HTTP (the official openai client) -------------------------------------------------------


def test_openai_completions_stream_and_not(doors, reference) -> None:
    client = openai_client(doors)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == reference.text and out.choices[0].finish_reason == "length"
    assert (
        out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    )
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_chat_stream_and_not(doors) -> None:
    client = openai_client(doors)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a block table?"},
    ]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == 10
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def post(doors, path: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{doors.host}:{doors.http_port}{path}", data=data, method="POST"
    )
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "key", "status", "param"),
    [
        ({"model": "tiny", "max_tokens": 2}, KEY, 400, "prompt"),
        ({**GOOD, "max_tokens": "two"}, KEY, 400, "max_tokens"),
        ({**GOOD, "max_tokens": 0}, KEY, 400, "max_tokens"),
        ({**GOOD, "temperature": -0.1}, KEY, 400, "temperature"),
        ({**GOOD, "top_p": 0}, KEY, 400, "top_p"),
        ({**GOOD, "model": "gpt-9"}, KEY, 404, "model"),  # not found, as OpenAI answers
        ({**GOOD, "prompt": "word " * 5000}, KEY, 400, "prompt"),
        ({**GOOD, "nonsense": 1}, KEY, 400, "nonsense"),
        ({**GOOD, "n": 0}, KEY, 400, "n"),
        ({**GOOD, "n": 65}, KEY, 400, "n"),
        ({**GOOD, "n": True}, KEY, 400, "n"),
        ({**GOOD, "logit_bias": {"x": 1}}, KEY, 400, "logit_bias"),
        ({**GOOD, "logit_bias": {"5": 101}}, KEY, 400, "logit_bias"),
        ({**GOOD, "logit_bias": {"99999": 1}}, KEY, 400, "logit_bias"),
        ({**GOOD, "logit_bias": {"7": 1, "07": 2}}, KEY, 400, "logit_bias"),
        (b"{not json", KEY, 400, "body"),
        ({**GOOD, "prompt": "x" * (2 << 20)}, KEY, 400, "body"),
        (GOOD, None, 401, None),
        (GOOD, "wrong", 401, None),
    ],
)
def test_http_errors_name_the_field_and_the_server_keeps_serving(
    doors, body, key, status, param
) -> None:
    code, payload, _ = post(doors, "/v1/completions", body, key)
    assert code == status and payload["error"]["param"] == param
    assert post(doors, "/v1/completions", GOOD)[0] == 200


def test_http_client_disconnect_mid_stream_frees_pages(cluster, doors) -> None:
    client = openai_client(doors)
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    cluster.assert_idle()


def test_overload_is_refused_with_a_retry_hint(cluster) -> None:
    config = RouterConfig(
        model_name="tiny", api_keys=(KEY,), max_inflight_per_region=1, adaptive_admission=False
    )
    _, doors = cluster.router(config)
    call = stub(doors).Generate(request(max_tokens=2000, ignore_eos=True), metadata=AUTH)
    next(call)  # one request in flight fills the region
    code, _payload, headers = post(doors, "/v1/completions", GOOD)
    assert code == 429 and float(headers["Retry-After"]) > 0
    with pytest.raises(grpc.RpcError) as err:
        stub(doors).Complete(request(), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata())["retry-after"]
    call.cancel()
    cluster.assert_idle()
    assert post(doors, "/v1/completions", GOOD)[0] == 200


def test_hedged_requests_answer_once_and_free_the_loser(cluster, reference) -> None:
    # Hedge after 1 ms: every request starts a second attempt; one answer wins.
    config = RouterConfig(
        model_name="tiny", api_keys=(KEY,), hedge_after_s=0.001, retry_budget_ratio=1.0
    )
    router, doors = cluster.router(config)
    for _ in range(3):
        whole = stub(doors).Complete(request(), metadata=AUTH)
        assert list(whole.token_ids) == reference.token_ids
    assert ray.get(router.stats.remote()).hedged >= 1
    cluster.assert_idle()


# -- placement ----------------------------------------------------------------------------------


def test_requests_stay_home_until_home_is_full_then_spill(ray_session) -> None:
    c = Cluster({"east": (1, 1), "west": (1, 1)})
    try:
        regions = (RegionSpec("east", {"west": 0.03}), RegionSpec("west", {"east": 0.03}))
        router, doors = c.router(
            RouterConfig(
                model_name="tiny",
                api_keys=(KEY,),
                regions=regions,
                max_inflight_per_region=2,
                adaptive_admission=False,
            )
        )
        for _ in range(4):  # one at a time: home always has room
            stub(doors).Complete(
                request(max_tokens=4), metadata=(*AUTH, ("x-pdserve-region", "east"))
            )
        assert ray.get(router.stats.remote()).placed == {"east": 4}
        # Four at once from the east: two fit at home, the others go west.
        results: list = []

        def call() -> None:
            results.append(
                stub(doors).Complete(
                    request(max_tokens=60, ignore_eos=True),
                    metadata=(*AUTH, ("x-pdserve-region", "east")),
                )
            )

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 4 and all(r.finish_reason == "length" for r in results)
        placed = ray.get(router.stats.remote()).placed
        assert placed["east"] >= 6 and placed["west"] >= 1
        c.assert_idle()
    finally:
        c.shutdown()


def _hit_rate(cluster: Cluster, doors, prompts: list[str]) -> float:
    def counts() -> tuple[int, int]:
        stats = [s for s in cluster.stats().values() if s.role == "prefill"]
        return sum(s.prefix_hits for s in stats), sum(s.prefix_queries for s in stats)

    hits, queries = counts()
    for prompt in prompts:
        stub(doors).Complete(request(prompt=prompt, max_tokens=2), metadata=AUTH)
        time.sleep(0.25)  # let the prefill instances report their new blocks
    return (counts()[0] - hits) / (counts()[1] - queries)


def test_cost_model_finds_cached_prefixes_better_than_round_robin(ray_session) -> None:
    # Three long prefixes over two prefill instances: round-robin lands each prefix on
    # both, so each is computed twice; the cost model follows the cache.
    rates = {}
    c = Cluster({"local": (2, 1)})
    try:
        for policy in ("round_robin", "cost_model"):  # a router each, prefixes of its own
            prefixes = [" ".join(f"{policy}{k} {i} x{k}{i}" for i in range(40)) for k in range(3)]
            prompts = [f"{prefixes[i % 3]} question {i}" for i in range(15)]
            _, doors = c.router(RouterConfig(model_name="tiny", api_keys=(KEY,), policy=policy))
            rates[policy] = _hit_rate(c, doors, prompts)
    finally:
        c.shutdown()
    assert rates["cost_model"] > rates["round_robin"] + 0.1, rates
