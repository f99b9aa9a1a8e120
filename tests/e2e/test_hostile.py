"""Hostile input against a real cluster: every class gets a clear 4xx / INVALID_ARGUMENT,
and afterwards every instance still answers and no KV page is held."""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.core.messages import DecodeRequest, PrefillRequest
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from tests.e2e.raw_http import get, raw_post, raw_post_any
from tests.e2e.tiny_cluster import AUTH, KEY, Cluster, stub

GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = Cluster({"local": (1, 2)})
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def doors(cluster):
    return cluster._bootstrap[1]


def body(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


NESTED = b'{"model": "tiny", "prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
# JSON text that decodes to strings no UTF-8 encoder accepts (lone surrogates).
SURROGATE = '"x\\ud800"'

HTTP_CASES = [
    ("/v1/completions", body().replace(b'"hi"', SURROGATE.encode()), "prompt"),
    ("/v1/completions", body(request_id="r").replace(b'"r"', SURROGATE.encode()), "request_id"),
    ("/v1/completions", body(request_id="line\nforged INFO line"), "request_id"),
    ("/v1/completions", body(request_id="x" * 129), "request_id"),
    ("/v1/completions", body(region="mars"), "region"),
    ("/v1/completions", body(region="r").replace(b'"r"', SURROGATE.encode()), "region"),
    ("/v1/completions", body(prompt=""), "prompt"),
    (
        "/v1/completions",
        body().replace(b'"max_tokens": 2', b'"temperature": Infinity'),
        "temperature",
    ),
    ("/v1/completions", body(top_k=2**70), "top_k"),
    ("/v1/completions", body(stop_token_ids=[10**6]), "stop_token_ids"),
    ("/v1/completions", body(stop=["ab"] * 100_000), "stop"),
    ("/v1/completions", body(max_tokens=10**6), "max_tokens"),
    ("/v1/completions", body(prompt=[1] * 5000), "prompt"),  # past the 4,096-token context
    ("/v1/completions", body(stream=True, stream_options="yes"), "stream_options"),
    (
        "/v1/completions",
        body(stream=True, stream_options={"include_usage": "x"}),
        "stream_options.include_usage",
    ),
    ("/v1/completions", json.dumps({"prompt": "hi"}).encode(), "model"),
    ("/v1/completions", NESTED, "body"),
    (
        "/v1/chat/completions",
        json.dumps(CHAT).encode().replace(b'"hi"', SURROGATE.encode()),
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": [{"role": "root", "content": "x"}]}).encode(),
        "messages[0].role",
    ),
]


@pytest.mark.parametrize(("path", "data", "param"), HTTP_CASES)
def test_http_refuses_with_the_field(doors, path, data, param) -> None:
    code, payload = raw_post(doors, path, data)
    assert code == 400, payload
    assert payload["error"]["param"] == param, payload


def test_a_non_ascii_key_is_refused_not_a_500(doors) -> None:
    req = urllib.request.Request(
        f"http://{doors.host}:{doors.http_port}/v1/completions", data=body(), method="POST"
    )
    req.add_header("Authorization", "Bearer kéy-ü")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 401


def grpc_raw(doors, data: bytes) -> grpc.RpcError:
    channel = grpc.insecure_channel(f"{doors.host}:{doors.grpc_port}")
    call = channel.unary_unary("/pdserve.v1.Completion/Complete")  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as err:
        call(data, metadata=AUTH)
    return err.value


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff\xff",  # not protobuf at all
        _field(1, b"tiny") + _field(2, b"hi") + _field(6, b"x\xed\xa0\x80"),  # bad UTF-8 id
        _field(1, b"tiny") + _field(2, b"\xc3\x28"),  # bad UTF-8 prompt
    ],
)
def test_grpc_malformed_bytes_are_invalid_argument(doors, data) -> None:
    error = grpc_raw(doors, data)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()


def sampling(**options) -> pb.SamplingOptions:
    return pb.SamplingOptions(**{"max_tokens": 2, "temperature": 0.0, **options})


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (
            pb.CompletionRequest(model="tiny", prompt="hi", request_id="a\nb", sampling=sampling()),
            "request_id",
        ),
        (
            pb.CompletionRequest(model="tiny", prompt="hi", region="mars", sampling=sampling()),
            "region",
        ),
        (
            pb.CompletionRequest(
                model="tiny", prompt="hi", sampling=sampling(temperature=float("inf"))
            ),
            "temperature",
        ),
        (
            pb.CompletionRequest(
                model="tiny", prompt="hi", sampling=sampling(stop_token_ids=[10**6])
            ),
            "stop_token_ids",
        ),
        (
            pb.CompletionRequest(model="tiny", prompt="hi", sampling=sampling(max_tokens=10**6)),
            "max_tokens",
        ),
        (pb.CompletionRequest(model="tiny", prompt="", sampling=sampling()), "prompt"),
    ],
)
def test_grpc_refuses_with_the_field(doors, req, field) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub(doors).Complete(req, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()


def test_client_ids_are_echoed_never_shared(doors) -> None:
    req = pb.CompletionRequest(model="tiny", prompt="hi", request_id="mine", sampling=sampling())
    first = stub(doors).Complete(req, metadata=AUTH)
    # The same id again, and an id shaped like another request's retry: both are just names.
    again = stub(doors).Complete(req, metadata=AUTH)
    forged = pb.CompletionRequest(
        model="tiny", prompt="hi", request_id="mine#1", sampling=sampling()
    )
    assert stub(doors).Complete(forged, metadata=AUTH).request_id == "mine#1"
    assert first.request_id == again.request_id == "mine"
    assert list(first.token_ids) == list(again.token_ids)


def test_afterwards_every_instance_answers_and_no_page_is_held(cluster, doors) -> None:
    code, text = get(doors, "/metrics")
    assert code == 200 and 'region="mars"' not in text
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for region in cluster.regions.values():
        for i, instance in enumerate(region.decode):
            ray.get(
                instance.leader.submit.remote(DecodeRequest(f"probe-d{i}", [1, 2, 3], params), None)
            )
            (out,) = ray.get(instance.leader.wait.remote([f"probe-d{i}"], 30.0))
            assert len(out.outputs[0].token_ids) == 3
        for i, instance in enumerate(region.prefill):
            first = ray.get(
                instance.leader.prefill.remote(PrefillRequest(f"probe-p{i}", [1, 2, 3], params))
            )
            assert first.token_id >= 0
    assert raw_post(doors, "/v1/completions", body())[0] == 200
    cluster.assert_idle()


def test_health_and_readiness(doors) -> None:
    assert get(doors, "/health") == (200, '{"status": "ok"}')
    code, text = get(doors, "/ready")
    assert code == 200 and json.loads(text)["instances"] == {"prefill": 1, "decode": 2}


# -- fuzzing: generated JSON and protobuf, valid-shaped and not --------------------------------
# `make fuzz` sets PDSERVE_FUZZ_EXAMPLES for a long run; `make test` runs a short one.

FUZZ_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
# Any character, lone surrogates included (they survive JSON as \ud800 escapes).
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "region",
    "request_id",
    "n",
    "min_tokens",
    "ignore_eos",
    "user",
    "logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
]
SMALL = st.integers(min_value=-2, max_value=6)
VALUES = {
    "model": st.just("tiny") | JSON,
    "prompt": st.just("hi") | ANY_TEXT | st.lists(st.integers(-5, 2000), max_size=6) | JSON,
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "bot", "assistant", "tool"]) | JSON,
                "content": ANY_TEXT | JSON,
            },
            optional={"tool_calls": JSON, "tool_call_id": ANY_TEXT},
        ),
        max_size=3,
    )
    | JSON,
    "max_tokens": SMALL | JSON,
    "stream": st.booleans() | JSON,
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.sampled_from(["f", "g"]) | JSON}, optional={"parameters": JSON}
                ),
            }
        ),
        max_size=2,
    )
    | JSON,
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]
    )
    | JSON,
}
FUZZ_BODY = st.fixed_dictionaries(
    {"model": VALUES["model"], "max_tokens": VALUES["max_tokens"]},
    optional={f: VALUES.get(f, JSON) for f in FIELDS if f not in ("model", "max_tokens")},
)


def _bounded(payload: dict) -> dict:
    """Keep generated work small: a valid request must not ask for many tokens or choices."""
    if isinstance(payload.get("max_tokens"), int) and payload["max_tokens"] > 6:
        payload["max_tokens"] = 6
    if isinstance(payload.get("n"), int) and payload["n"] > 3:
        payload["n"] = 3
    payload.pop("max_completion_tokens", None)
    return payload


@FUZZ
@given(payload=FUZZ_BODY, chat=st.booleans())
def test_fuzz_http(doors, payload, chat) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    data = json.dumps(_bounded(payload)).encode()
    code, _ = raw_post_any(doors, path, data)
    assert code == 200 or 400 <= code < 500, (code, data[:300])


@FUZZ
@given(data=st.binary(max_size=200))
def test_fuzz_grpc_bytes(doors, data) -> None:
    channel = grpc.insecure_channel(f"{doors.host}:{doors.grpc_port}")
    call = channel.unary_unary("/pdserve.v1.Completion/Complete")
    try:
        call(data, metadata=AUTH, timeout=30)
    except grpc.RpcError as e:
        assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), e.details()


PB_SAMPLING = st.builds(
    pb.SamplingOptions,
    max_tokens=st.integers(0, 6),
    temperature=st.floats(width=32),
    top_p=st.floats(width=32),
    top_k=st.integers(-(2**31), 2**31 - 1),
    stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=3),
)
PB_REQUEST = st.builds(
    pb.CompletionRequest,
    model=st.sampled_from(["tiny", "", "other"]),
    prompt=st.text(max_size=30),
    sampling=PB_SAMPLING,
    region=st.sampled_from(["", "local", "mars"]) | st.text(max_size=5),
    request_id=st.text(max_size=10),
)


@FUZZ
@given(req=PB_REQUEST)
def test_fuzz_grpc_messages(doors, req) -> None:
    try:
        stub(doors).Complete(req, metadata=AUTH, timeout=30)
    except grpc.RpcError as e:
        assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), e.details()


# The Batch API under fuzzing: a router of its own over the same instances, with a
# 1-MiB quota in a folder of the test's; every answer a 2xx or 4xx, the key's files
# never past the quota, /health answering after each example.
BATCH_QUOTA = 1 << 20
BATCH_FUZZ = settings(FUZZ, max_examples=max(1, FUZZ_EXAMPLES // 3))  # a few calls each


@pytest.fixture(scope="module")
def batch_doors(cluster, tmp_path_factory):
    config = RouterConfig(
        model_name="tiny",
        api_keys=(KEY,),
        batch_dir=str(tmp_path_factory.mktemp("batches")),
        batch_quota_mb=BATCH_QUOTA >> 20,
        batch_max_files=20,
    )
    actor, endpoints = cluster.router(config)
    yield endpoints
    ray.kill(actor)
    cluster.routers.remove(actor)


def _multipart(parts: list[tuple[str, str | None, bytes]]) -> bytes:
    """A multipart/form-data body (boundary ``b``) of (name, filename, data) parts."""
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--b\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + b"--b--\r\n"


def _batch_call(doors, method: str, path: str, data: bytes | None = None, multipart=False):
    req = urllib.request.Request(
        f"http://{doors.host}:{doors.http_port}{path}", data=data, method=method
    )
    req.add_header("Authorization", f"Bearer {KEY}")
    kind = "multipart/form-data; boundary=b" if multipart else "application/json"
    req.add_header("Content-Type", kind)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _settled(doors) -> None:
    """/health answers, and this key's files hold no more than its quota."""
    assert get(doors, "/health")[0] == 200
    code, files = _batch_call(doors, "GET", "/v1/files")
    assert code == 200 and sum(f["bytes"] for f in files["data"]) <= BATCH_QUOTA, files


REQUEST_LINE = st.fixed_dictionaries(
    {
        "custom_id": st.text(min_size=1, max_size=8),
        "method": st.just("POST"),
        "url": st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        "body": st.just(GOOD) | st.just(CHAT) | FUZZ_BODY,
    },
    optional={"extra": JSON},
)  # a line of the right shape, or near it
BATCH_LINE = (
    REQUEST_LINE.map(lambda d: json.dumps(d).encode())
    | JSON.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=60).filter(lambda b: b"\n" not in b)
)
UPLOAD_PARTS = st.lists(
    st.tuples(
        st.sampled_from(["purpose", "file", "other"]),
        st.none() | st.sampled_from(["in.jsonl", "x"]),
        st.sampled_from([b"batch", b"fine-tune", b""])
        | st.lists(BATCH_LINE, max_size=6).map(lambda lines: b"\n".join(lines) + b"\n"),
    ),
    max_size=4,
)


@BATCH_FUZZ
@given(parts=UPLOAD_PARTS, big=st.booleans())
def test_fuzz_batch_uploads(batch_doors, parts, big) -> None:
    if big:  # valid lines, enough of them to come near the quota
        lines = [
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {**GOOD, "user": "x" * 400},
                }
            )
            for i in range(1500)
        ]  # ~700 KB
        parts = [("purpose", None, b"batch"), ("file", "in.jsonl", "\n".join(lines).encode())]
    code, answer = _batch_call(batch_doors, "POST", "/v1/files", _multipart(parts), True)
    assert code == 200 or 400 <= code < 500, (code, answer)
    _settled(batch_doors)
    if code == 200:
        assert _batch_call(batch_doors, "DELETE", f"/v1/files/{answer['id']}")[0] == 200


BATCH_BODY = st.fixed_dictionaries(
    {},
    optional={
        "input_file_id": st.just("UPLOADED") | JSON,
        "endpoint": st.sampled_from(["/v1/completions", "/v1/chat/completions"]) | JSON,
        "completion_window": st.just("24h") | JSON,
        "metadata": JSON,
    },
)


@BATCH_FUZZ
@given(body=BATCH_BODY | JSON)
def test_fuzz_batches(batch_doors, body) -> None:
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": GOOD})
    upload = _multipart([("purpose", None, b"batch"), ("file", "in.jsonl", line.encode())])
    code, uploaded = _batch_call(batch_doors, "POST", "/v1/files", upload, True)
    assert code == 200, uploaded
    if isinstance(body, dict) and body.get("input_file_id") == "UPLOADED":
        body = {**body, "input_file_id": uploaded["id"]}
    code, batch = _batch_call(batch_doors, "POST", "/v1/batches", json.dumps(body).encode())
    assert code == 200 or 400 <= code < 500, (code, batch)
    if code == 200:
        code, batch = _batch_call(batch_doors, "POST", f"/v1/batches/{batch['id']}/cancel")
        assert code == 200 and batch["status"] in ("cancelled", "completed"), batch
        assert _batch_call(batch_doors, "DELETE", f"/v1/files/{batch['output_file_id']}")[0] == 200
    _settled(batch_doors)
    assert _batch_call(batch_doors, "DELETE", f"/v1/files/{uploaded['id']}")[0] == 200


def test_a_crashed_router_restarts_and_serves_again(ray_session, tmp_path) -> None:
    """The router actor is restarted after its process dies and listens again on its
    port; a batch it could not resume at start-up is failed with the reason."""
    import socket

    from pdserve.cluster.topology import start_router
    from pdserve.models.builtin import resolve_model

    with socket.socket() as s:  # a free port, the same one after the restart
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = {
        "id": "batch_left",
        "object": "batch",
        "endpoint": "/v1/completions",
        "input_file_id": "file-in",
        "output_file_id": "file-out",
        "status": "in_progress",
        "errors": None,
        "created_at": 1,
        "owner": "0" * 64,
    }
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "batch_left.json").write_text(json.dumps(record))
    config = RouterConfig(
        model_name="tiny", api_keys=(KEY,), http_port=port, batch_dir=str(tmp_path), max_restarts=1
    )
    actor, endpoints = start_router(config, str(resolve_model("builtin:tiny")))
    try:
        assert get(endpoints, "/health")[0] == 200
        actor.__ray_call__.remote(lambda self: os._exit(1))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                if get(endpoints, "/health")[0] == 200:
                    break
            except OSError:
                continue
        assert get(endpoints, "/health")[0] == 200
        failed = json.loads((tmp_path / "batches" / "batch_left.json").read_text())
        assert failed["status"] == "failed", failed  # its input is gone: it says so
        assert "file-in" in failed["errors"]["data"][0]["message"], failed
    finally:
        ray.kill(actor)


def test_after_fuzzing_the_cluster_answers_with_no_page_held(cluster, doors) -> None:
    assert raw_post(doors, "/v1/completions", body())[0] == 200
    cluster.assert_idle()


# -- no request waits on what cannot happen ------------------------------------------------------


def test_a_region_without_prefill_serves_long_prompts_on_decode(ray_session) -> None:
    from pdserve import LLM, SamplingParams

    solo = Cluster({"local": (0, 1)})  # no prefill instance; decode prefills only <= 4 tokens
    try:
        prompt = "a long prompt that no prefill instance will ever see, " * 3
        start = time.monotonic()
        out = stub(solo._bootstrap[1]).Complete(
            pb.CompletionRequest(model="tiny", prompt=prompt, sampling=sampling(max_tokens=6)),
            metadata=AUTH,
            timeout=60,
        )
        took = time.monotonic() - start
        want = LLM("builtin:tiny").generate(prompt, SamplingParams(max_tokens=6, temperature=0))
        assert list(out.token_ids) == want[0].outputs[0].token_ids
        assert took < 20, f"{took:.1f} s: it waited for a transfer nobody would send"
        solo.assert_idle()
    finally:
        solo.shutdown()


UPTIME_REQUESTS = int(os.environ.get("PDSERVE_UPTIME_REQUESTS", "240"))


def test_every_table_returns_to_rest_after_mixed_traffic_with_cancels(cluster, doors) -> None:
    """Streams cancelled at every phase, unary calls, bad ones: nothing stays behind."""
    rng = random.Random(7)
    client = stub(doors)

    def one(i: int) -> None:
        req = pb.CompletionRequest(
            model="tiny",
            prompt=f"request {i} " * rng.randint(1, 12),
            sampling=sampling(max_tokens=rng.randint(1, 12), ignore_eos=True),
        )
        kind = i % 4
        try:
            if kind == 0:
                client.Complete(req, metadata=AUTH, timeout=60)
            elif kind == 3 and i % 8 == 3:  # a refused one now and then
                client.Complete(pb.CompletionRequest(model="tiny", prompt=""), metadata=AUTH)
            else:
                call = client.Generate(req, metadata=AUTH, timeout=60)
                for _ in range(kind - 1):  # cancel before any token, after one, after two
                    next(call, None)
                call.cancel()
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT), e

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(UPTIME_REQUESTS)))
    router = cluster._bootstrap[0]
    deadline = time.monotonic() + 20
    while any(ray.get(router.tables.remote()).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(router.tables.remote()) == dict.fromkeys(
        ("attempts", "tasks", "region_inflight", "instance_inflight", "pending_prompt_tokens"), 0
    )
    cluster.assert_idle()


def test_a_failed_kv_transfer_is_recomputed_and_the_prefill_stays(cluster, doors) -> None:
    from pdserve import LLM, SamplingParams

    def break_next_flush(actor) -> None:  # runs inside the prefill rank's actor
        from pdserve.core.errors import TransferError

        sender = actor.worker.transfer.sender
        original = sender.flush
        broken = [True]

        def flush() -> None:
            if broken.pop() if broken else False:
                raise TransferError("this test broke the transfer")
            original()

        sender.flush = flush

    (prefill,) = cluster.regions["local"].prefill
    ray.get(prefill.leader.__ray_call__.remote(break_next_flush))
    prompt = "a prompt long enough to be prefilled on the prefill instance " * 2
    out = stub(doors).Complete(
        pb.CompletionRequest(model="tiny", prompt=prompt, sampling=sampling(max_tokens=5)),
        metadata=AUTH,
        timeout=60,
    )
    want = LLM("builtin:tiny").generate(prompt, SamplingParams(max_tokens=5, temperature=0))
    assert list(out.token_ids) == want[0].outputs[0].token_ids
    assert ray.get(cluster._bootstrap[0].stats.remote()).migrations >= 1
    _, text = get(doors, "/ready")
    assert (
        json.loads(text)["instances"]["prefill"] == 1
    )  # a transfer failure is not a lost instance
    cluster.assert_idle()
