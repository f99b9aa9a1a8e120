"""Multi-LoRA: pdserve's greedy tokens under each PEFT adapter equal transformers' with it merged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.core.adapters import UnknownAdapterError
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.request import Request
from pdserve.router.prefix_index import prompt_block_hashes
from tests.lora_adapters import build_lora_case

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lora_case(reference_models, tmp_path_factory):
    """(base folder, adapters {name: folder}, prompts, tokens {None or name: per prompt})."""
    return build_lora_case(reference_models, tmp_path_factory, NEW_TOKENS)


@pytest.fixture(scope="module")
def lora_llm(lora_case):
    base, adapters, _, _ = lora_case
    return LLM(str(base), dtype="float32", lora_adapters=adapters, max_num_batched_tokens=64)


def _greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, lora=lora)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_matches_merged_transformers(lora_case, lora_llm) -> None:
    _, adapters, prompts, tokens = lora_case
    for name in [None, *adapters]:
        assert _tokens(lora_llm.generate(prompts, _greedy(name))) == tokens[name], name
        if name is not None:  # the adapter changes the output: the check has teeth
            assert tokens[name] != tokens[None]
    lora_llm.engine.assert_idle()


def test_mixed_batch_equals_each_alone(lora_case, lora_llm) -> None:
    _, adapters, prompts, tokens = lora_case
    names = [None, *adapters]
    work = [(p, n) for i, p in enumerate(prompts) for n in names[i % 4 :] + names[: i % 4]]
    outputs = lora_llm.generate([p for p, _ in work], [_greedy(n) for _, n in work])
    for (prompt, name), got in zip(work, _tokens(outputs), strict=True):
        assert got == tokens[name][prompts.index(prompt)], name
    lora_llm.engine.assert_idle()


def test_prefix_cache_does_not_mix_adapters(lora_case, lora_llm) -> None:
    _, _, prompts, _ = lora_case
    prompt = prompts[3][::-1]  # 150 tokens no earlier test sent: nine full blocks
    kv = lora_llm.engine.kv
    first = {}
    for name in ("qv", "all", None):
        before = kv.stats.hits
        first[name] = _tokens(lora_llm.generate([prompt], _greedy(name)))
        assert kv.stats.hits == before, name  # no other adapter's blocks were taken
    for name in ("qv", None):
        before = kv.stats.hits
        assert _tokens(lora_llm.generate([prompt], _greedy(name))) == first[name]
        assert kv.stats.hits > before  # its own blocks are reused

    hashes = {}
    for name in ("qv", "all", None):
        request = Request("probe", prompt, _greedy(name))
        kv.update_block_hashes(request)
        fingerprint = dict(lora_llm.engine.adapters.fingerprints()).get(name or "", "")
        assert request.block_hashes == prompt_block_hashes(prompt, kv.block_size, name, fingerprint)
        hashes[name] = request.block_hashes
    assert not set(hashes["qv"]) & set(hashes["all"])
    assert not set(hashes["qv"]) & set(hashes[None])


def test_unknown_adapter_is_refused_and_the_engine_goes_on(lora_case, lora_llm) -> None:
    _, adapters, prompts, tokens = lora_case
    with pytest.raises(UnknownAdapterError, match="nope") as info:
        lora_llm.generate(prompts[:1], _greedy("nope"))
    assert info.value.http_status == 404
    assert all(name in str(info.value) for name in adapters)
    assert _tokens(lora_llm.generate(prompts[:1], _greedy("qv"))) == tokens["qv"][:1]


def _edited(src: str, dst: Path, config: dict | None = None, shrink: str | None = None) -> str:
    shutil.copytree(src, dst)
    if config:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if shrink:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        key = next(k for k in tensors if shrink in k)
        tensors[key] = tensors[key][:, :-1].contiguous()
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    return str(dst)


@pytest.mark.parametrize(
    ("edit", "field", "reason"),
    [
        (dict(config={"r": 4}), "r", "max_lora_rank=2"),
        (dict(config={"target_modules": ["q_proj", "lm_head"]}), "target_modules", "lm_head"),
        (dict(shrink="layers.1.self_attn.q_proj.lora_A"), "layers.1.q_proj", "do not fit"),
        (dict(config={"use_dora": True}), "use_dora", "not supported"),
    ],
    ids=["rank", "targets", "shape", "dora"],
)
def test_bad_adapter_is_refused_at_start(lora_case, tmp_path, edit, field, reason) -> None:
    base, adapters, _, _ = lora_case
    folder = _edited(adapters["qv"], tmp_path / "bad", **edit)
    max_rank = 2 if field == "r" else 64
    with pytest.raises(InvalidArgumentError) as info:
        LLM(str(base), lora_adapters={"bad": folder}, max_lora_rank=max_rank)
    message = str(info.value)
    assert "'bad'" in message and field in message and reason in message, message


def test_tensor_parallel_adapters_match(ray_session, lora_case) -> None:
    base, adapters, prompts, tokens = lora_case
    llm = LLM(
        str(base),
        dtype="float32",
        lora_adapters=adapters,
        tensor_parallel_size=2,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
    )
    try:
        names = [None, *adapters]
        work = [(p, n) for p in prompts for n in names]
        outputs = llm.generate([p for p, _ in work], [_greedy(n) for _, n in work])
        for (prompt, name), got in zip(work, _tokens(outputs), strict=True):
            assert got == tokens[name][prompts.index(prompt)], name
        llm.check_idle()
    finally:
        llm.shutdown()


def test_a_disaggregated_pair_serves_adapters_and_refuses_a_mismatch(
    ray_session, lora_case
) -> None:
    from pdserve.core.config import DisaggregationConfig
    from pdserve.transfer.handshake import IncompatibleInstancesError

    base, adapters, prompts, tokens = lora_case
    remote = DisaggregationConfig(local_prefill_max_tokens=2, local_prefill_cached_fraction=1.0)
    llm = LLM(
        str(base),
        dtype="float32",
        lora_adapters=adapters,
        disaggregated=True,
        num_cpus_per_rank=0.5,
        disaggregation=remote,
    )
    try:
        for name in [None, *adapters]:
            assert _tokens(llm.generate(prompts, _greedy(name))) == tokens[name], name
        llm.check_idle()
    finally:
        llm.shutdown()
    # The same name over other content on one side is refused (a name only one
    # side holds is not: adapters load at runtime instance by instance).
    with pytest.raises(IncompatibleInstancesError, match="lora adapter 'qv'"):
        LLM(
            str(base),
            dtype="float32",
            disaggregated=True,
            num_cpus_per_rank=0.5,
            prefill=dict(lora_adapters={"qv": adapters["qv"]}),
            decode=dict(lora_adapters={"qv": adapters["all"]}),
        )


def test_a_cluster_serves_adapters_over_http(ray_session, lora_case) -> None:
    import json as _json
    import urllib.error
    import urllib.request

    from tests.e2e.local_cluster import Running

    base, adapters, prompts, tokens = lora_case
    listed = ", ".join(f"{name}: {folder}" for name, folder in adapters.items())
    c = Running(model=str(base), engine=f", lora_adapters: {{{listed}}}")
    url = f"http://{c.endpoints.host}:{c.endpoints.http_port}/v1"

    def post(model: str) -> dict:
        body = {"model": model, "prompt": prompts[0], "max_tokens": NEW_TOKENS}
        request = urllib.request.Request(
            f"{url}/completions", _json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return _json.load(r)

    def generate(model: str) -> list[int]:
        from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb

        request = pb.CompletionRequest(model=model, prompt_token_ids=pb.TokenIds(ids=prompts[0]))
        request.sampling.CopyFrom(
            pb.SamplingOptions(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        )
        return [t for chunk in c.stub.Generate(request, timeout=60) for t in chunk.token_ids]

    try:
        with urllib.request.urlopen(f"{url}/models", timeout=30) as r:
            ids = {m["id"] for m in _json.load(r)["data"]}
        assert set(adapters) <= ids and len(ids) == len(adapters) + 1
        for name in adapters:  # over gRPC, whose chunks carry token ids
            assert generate(name) == tokens[name][0], name
        assert post(next(iter(adapters)))["model"] == next(iter(adapters))
        with pytest.raises(urllib.error.HTTPError) as info:
            post("no-such-adapter")
        assert info.value.code == 404 and "valid names" in info.value.read().decode()
        c.assert_idle()
    finally:
        c.stop()


def test_a_rank_that_reads_other_bytes_than_the_leader_refuses_the_adapter(
    lora_case, tmp_path
) -> None:
    """A runtime load's fingerprint is of the bytes the ranks read, and a follower whose
    read differs from the leader's (the folder changed in between) refuses to load it."""
    from pdserve.core.adapters import adapter_fingerprint
    from pdserve.parallel.lora_control import apply_lora, encode_lora

    base, adapters, _, _ = lora_case
    llm = LLM(str(base), dtype="float32", max_num_batched_tokens=64)
    try:
        folder = tmp_path / "qv"
        shutil.copytree(adapters["qv"], folder)
        served = llm.engine.load_adapter("qv", str(folder))
        assert served.fingerprint == adapter_fingerprint(folder)
        runner = llm.engine.executor.runner  # type: ignore[attr-defined]
        stale = encode_lora(1, "qv-again", str(folder), "0" * 24)  # the leader read other bytes
        with pytest.raises(InvalidArgumentError, match="read other bytes") as err:
            apply_lora(runner, stale)
        assert err.value.field == "lora_path"
        apply_lora(runner, encode_lora(1, "qv-again", str(folder), served.fingerprint))
        assert runner.adapter_slots[1] == "qv-again"
    finally:
        llm.shutdown()


def test_start_up_adapters_are_fingerprinted_from_what_the_ranks_read(lora_llm, lora_case) -> None:
    from pdserve.core.adapters import adapter_fingerprint
    from pdserve.parallel.instance import _check_same_adapters

    _, adapters, _, _ = lora_case
    runner = lora_llm.engine.executor.runner
    assert runner.adapter_fingerprints == {n: adapter_fingerprint(f) for n, f in adapters.items()}
    assert dict(lora_llm.engine.adapters.fingerprints()) == runner.adapter_fingerprints
    same = dict(runner.adapter_fingerprints)
    _check_same_adapters([same, dict(same)])  # two ranks that read the same bytes
    other = {**same, "qv": "0" * 24}  # a rank that read the folder after it changed
    with pytest.raises(InvalidArgumentError, match="rank 1 read other bytes than rank 0"):
        _check_same_adapters([same, other])
