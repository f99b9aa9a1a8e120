"""Runtime LoRA loads over real HTTP on a local cluster (a prefill and a decode instance).

load -> use (tokens equal transformers with the adapter merged) -> /v1/models and
gRPC ListModels list it -> unload -> 404; another adapter under the same name gives
its own tokens; bad adapters and taken names are refused and the cluster serves on;
a decode instance started after a load (scale-up) loads the adapter and serves it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import ray

from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from tests.lora_adapters import build_lora_case

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lora_case(reference_models, tmp_path_factory):
    return build_lora_case(reference_models, tmp_path_factory, NEW_TOKENS)


class Door:
    def __init__(self, running: Any) -> None:
        self.c = running
        self.url = f"http://{running.endpoints.host}:{running.endpoints.http_port}/v1"

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"{self.url}/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def models(self) -> set[str]:
        with urllib.request.urlopen(f"{self.url}/models", timeout=30) as r:
            return {m["id"] for m in json.load(r)["data"]}

    def grpc_models(self) -> set[str]:
        return {m.id for m in self.c.stub.ListModels(pb.ListModelsRequest(), timeout=30).models}

    def generate(self, model: str, prompt: list[int]) -> list[int]:
        request = pb.CompletionRequest(model=model, prompt_token_ids=pb.TokenIds(ids=prompt))
        request.sampling.CopyFrom(
            pb.SamplingOptions(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        )
        return [t for chunk in self.c.stub.Generate(request, timeout=120) for t in chunk.token_ids]


@pytest.fixture(scope="module")
def door(ray_session, lora_case):
    from tests.e2e.local_cluster import Running

    base = lora_case[0]
    c = Running(model=str(base), engine=", max_loras: 2")
    yield Door(c)
    c.stop()


def test_load_use_list_unload_over_http(door, lora_case) -> None:
    _, adapters, prompts, tokens = lora_case
    status, answer = door.post("load_lora_adapter", {"lora_name": "x", "lora_path": adapters["qv"]})
    assert status == 200 and len(answer["loaded_on"]) == 2 and not answer["failed"], answer
    assert "x" in door.models() and "x" in door.grpc_models()
    for i, prompt in enumerate(prompts[:2]):
        assert door.generate("x", prompt) == tokens["qv"][i]
    status, answer = door.post("completions", {"model": "x", "prompt": prompts[0], "max_tokens": 2})
    assert status == 200 and answer["model"] == "x", answer

    status, answer = door.post("unload_lora_adapter", {"lora_name": "x"})
    assert status == 200 and len(answer["unloaded_from"]) == 2, answer
    assert "x" not in door.models() and "x" not in door.grpc_models()
    status, answer = door.post("completions", {"model": "x", "prompt": prompts[0], "max_tokens": 2})
    assert status == 404 and "valid names" in answer["error"]["message"], answer

    # Another adapter under the same name: its own tokens, nothing cached under "x" reused.
    status, _ = door.post("load_lora_adapter", {"lora_name": "x", "lora_path": adapters["all"]})
    assert status == 200
    assert door.generate("x", prompts[0]) == tokens["all"][0]
    assert door.post("unload_lora_adapter", {"lora_name": "x"})[0] == 200
    door.c.assert_idle()


def test_refusals_name_the_reason_and_the_cluster_serves_on(door, lora_case, tmp_path) -> None:
    _, adapters, prompts, tokens = lora_case
    status, answer = door.post("load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path)})
    assert status == 400 and "adapter 'b': folder" in answer["error"]["message"], answer
    assert "b" not in door.models()
    assert door.post("load_lora_adapter", {"lora_name": "a", "lora_path": adapters["qv"]})[0] == 200
    status, answer = door.post(
        "load_lora_adapter", {"lora_name": "a", "lora_path": adapters["all"]}
    )
    assert status == 409 and "already loaded" in answer["error"]["message"], answer
    assert (
        door.post("load_lora_adapter", {"lora_name": "b", "lora_path": adapters["all"]})[0] == 200
    )
    status, answer = door.post(
        "load_lora_adapter", {"lora_name": "c", "lora_path": adapters["mixed"]}
    )
    assert status == 409 and "max_loras=2" in answer["error"]["message"], answer
    status, answer = door.post("unload_lora_adapter", {"lora_name": "nope"})
    assert status == 404, answer
    assert door.generate("b", prompts[1]) == tokens["all"][1]
    assert door.generate("", prompts[1]) == tokens[None][1]  # the base model
    for name in ("a", "b"):
        assert door.post("unload_lora_adapter", {"lora_name": name})[0] == 200
    door.c.assert_idle()


def test_an_instance_started_after_a_load_gets_the_adapter(door, lora_case) -> None:
    _, adapters, prompts, tokens = lora_case
    c = door.c
    router = ray.get(c.controller.router_handle.remote())
    status, answer = door.post(
        "load_lora_adapter", {"lora_name": "late", "lora_path": adapters["qv"]}
    )
    assert status == 200 and len(answer["loaded_on"]) == 2, answer
    before = ray.get(router.adapters.remote())
    served = {held["late"] for held in before.values()}
    assert len(served) == 1, before

    ray.get(c.controller.scale.remote("east", None, 2))  # a second decode instance
    after = ray.get(router.adapters.remote())  # (once its runtime loads are answered)
    [new] = sorted(set(after) - set(before))
    assert after[new] == {"late": served.pop()}, after
    fingerprints = [dict(ray.get(h.lora_fingerprints.remote())) for h in c.leaders("decode")]
    assert len(fingerprints) == 2 and all(f["late"] == after[new]["late"] for f in fingerprints)

    # Only the new instance holds it on the decode side now: its requests go there.
    decodes = {i.instance_id for i in c.status().instances if i.role == "decode"}
    [old] = [i for i in answer["loaded_on"] if i in decodes]
    status, answer = door.post("unload_lora_adapter", {"lora_name": "late", "instances": [old]})
    assert status == 200 and answer["unloaded_from"] == [old], answer
    for i, prompt in enumerate(prompts[:2]):
        assert door.generate("late", prompt) == tokens["qv"][i]
    assert door.generate("", prompts[0]) == tokens[None][0]

    # Unloaded everywhere: forgotten, so an instance started now holds none.
    assert door.post("unload_lora_adapter", {"lora_name": "late"})[0] == 200
    ray.get(c.controller.scale.remote("east", None, 1))
    ray.get(c.controller.scale.remote("east", None, 2))
    assert all(not held for held in ray.get(router.adapters.remote()).values())
    ray.get(c.controller.scale.remote("east", None, 1))
    door.c.assert_idle()
