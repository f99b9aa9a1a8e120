"""LoRA adapters loaded and unloaded while an engine serves: on one rank and on TP=2 Ray ranks.

Tokens under a runtime-loaded adapter must equal transformers' with the adapter
merged; an adapter replaced under the same name must give the new adapter's
tokens (no KV computed under the old one is reused).
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.adapters import AdapterConflictError, UnknownAdapterError
from pdserve.core.errors import InvalidArgumentError
from tests.lora_adapters import build_lora_case
from tests.parallel.test_lora import _edited

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lora_case(reference_models, tmp_path_factory):
    return build_lora_case(reference_models, tmp_path_factory, NEW_TOKENS)


def _greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, lora=lora)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def bare_llm(lora_case):
    """One rank, no adapter at start, room for two."""
    base = lora_case[0]
    llm = LLM(str(base), dtype="float32", max_loras=2, max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


def _load_use_replace(llm: LLM, lora_case) -> None:
    """Load "x" = qv, serve it, unload, refuse it, load "x" = all, serve all's tokens."""
    _, adapters, prompts, tokens = lora_case
    with pytest.raises(UnknownAdapterError):
        llm.generate(prompts[:1], _greedy("x"))
    llm.load_lora_adapter("x", adapters["qv"])
    assert _tokens(llm.generate(prompts, _greedy("x"))) == tokens["qv"]
    assert _tokens(llm.generate(prompts, _greedy("x"))) == tokens["qv"]  # prefix cache warm
    assert _tokens(llm.generate(prompts, _greedy(None))) == tokens[None]
    llm.unload_lora_adapter("x")
    with pytest.raises(UnknownAdapterError, match="'x'") as info:
        llm.generate(prompts[:1], _greedy("x"))
    assert info.value.http_status == 404
    llm.load_lora_adapter("x", adapters["all"])  # another adapter under the same name
    assert _tokens(llm.generate(prompts, _greedy("x"))) == tokens["all"]
    llm.unload_lora_adapter("x")


def test_load_unload_and_replace_on_one_rank(lora_case, bare_llm) -> None:
    _load_use_replace(bare_llm, lora_case)
    bare_llm.check_idle()


def test_a_replaced_adapter_reuses_no_cached_block(lora_case, bare_llm) -> None:
    _, adapters, prompts, _ = lora_case
    prompt = prompts[2][::-1]  # a prompt no other test sent: several full blocks
    kv = bare_llm.engine.kv
    bare_llm.load_lora_adapter("y", adapters["qv"])
    first = _tokens(bare_llm.generate([prompt], _greedy("y")))
    before = kv.stats.hits
    assert _tokens(bare_llm.generate([prompt], _greedy("y"))) == first
    assert kv.stats.hits > before  # its own blocks are reused
    bare_llm.unload_lora_adapter("y")
    bare_llm.load_lora_adapter("y", adapters["mixed"])
    before = kv.stats.hits
    other = _tokens(bare_llm.generate([prompt], _greedy("y")))
    assert kv.stats.hits == before  # nothing computed under the old "y" was taken
    assert other != first
    bare_llm.unload_lora_adapter("y")
    bare_llm.load_lora_adapter("y", adapters["qv"])  # the same content again: same KV
    before = kv.stats.hits
    assert _tokens(bare_llm.generate([prompt], _greedy("y"))) == first
    assert kv.stats.hits > before
    bare_llm.unload_lora_adapter("y")
    bare_llm.check_idle()


def test_unload_is_refused_while_requests_use_it(lora_case, bare_llm) -> None:
    _, adapters, prompts, tokens = lora_case
    engine = bare_llm.engine
    bare_llm.load_lora_adapter("busy", adapters["qv"])
    engine.add_request("r1", prompts[0], _greedy("busy"))
    engine.add_request("r2", prompts[1], _greedy("busy"))
    engine.add_request("r3", prompts[1], _greedy(None))
    with pytest.raises(AdapterConflictError, match="used by 2 running or queued") as info:
        bare_llm.unload_lora_adapter("busy")
    assert info.value.http_status == 409
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["r1"].outputs[0].token_ids == tokens["qv"][0]
    bare_llm.unload_lora_adapter("busy")
    bare_llm.check_idle()


def test_capacity_taken_names_and_unknown_names_are_refused(lora_case, bare_llm) -> None:
    _, adapters, prompts, tokens = lora_case
    bare_llm.load_lora_adapter("a", adapters["qv"])
    with pytest.raises(AdapterConflictError, match="already loaded"):
        bare_llm.load_lora_adapter("a", adapters["all"])
    bare_llm.load_lora_adapter("b", adapters["all"])
    with pytest.raises(AdapterConflictError, match="max_loras=2") as info:
        bare_llm.load_lora_adapter("c", adapters["mixed"])
    assert info.value.field == "lora_name"
    with pytest.raises(UnknownAdapterError, match="'c'"):
        bare_llm.unload_lora_adapter("c")
    with pytest.raises(InvalidArgumentError, match="lora_name"):
        bare_llm.load_lora_adapter("", adapters["qv"])
    assert _tokens(bare_llm.generate(prompts[:1], _greedy("b"))) == tokens["all"][:1]
    bare_llm.unload_lora_adapter("a")
    bare_llm.unload_lora_adapter("b")


@pytest.mark.parametrize(
    ("edit", "field", "reason"),
    [
        (dict(config={"r": 128}), "r", "max_lora_rank=64"),
        (dict(config={"target_modules": ["q_proj", "lm_head"]}), "target_modules", "lm_head"),
        (dict(shrink="layers.1.self_attn.q_proj.lora_A"), "layers.1.q_proj", "do not fit"),
        (dict(config={"use_dora": True}), "use_dora", "not supported"),
        (dict(), "folder", "no adapter_config.json"),
    ],
    ids=["rank", "targets", "shape", "dora", "missing"],
)
def test_a_bad_adapter_is_refused_at_runtime_and_the_engine_serves_on(
    lora_case, bare_llm, tmp_path, edit, field, reason
) -> None:
    _, adapters, prompts, tokens = lora_case
    if field == "folder":
        folder = str(tmp_path / "nowhere")
    else:
        folder = _edited(adapters["qv"], tmp_path / "bad", **edit)
    with pytest.raises(InvalidArgumentError) as info:
        bare_llm.load_lora_adapter("bad", folder)
    message = str(info.value)
    assert "'bad'" in message and field in message and reason in message, message
    with pytest.raises(UnknownAdapterError):
        bare_llm.generate(prompts[:1], _greedy("bad"))
    assert _tokens(bare_llm.generate(prompts[:1], _greedy(None))) == tokens[None][:1]
    bare_llm.check_idle()


def test_tensor_parallel_ranks_load_and_unload_together(ray_session, lora_case, tmp_path) -> None:
    base, adapters, prompts, tokens = lora_case
    llm = LLM(
        str(base),
        dtype="float32",
        tensor_parallel_size=2,
        num_cpus_per_rank=0.5,
        max_num_batched_tokens=64,
        max_loras=2,
        lora_adapters={"mixed": adapters["mixed"]},
    )
    try:
        _load_use_replace(llm, lora_case)
        bad = _edited(adapters["qv"], tmp_path / "bad", config={"use_dora": True})
        with pytest.raises(InvalidArgumentError, match="use_dora"):
            llm.load_lora_adapter("bad", bad)
        # A mixed batch over a start-up and a runtime adapter, on both ranks.
        llm.load_lora_adapter("x", adapters["qv"])
        names = [None, "mixed", "x"]
        work = [(p, n) for p in prompts for n in names]
        outputs = llm.generate([p for p, _ in work], [_greedy(n) for _, n in work])
        expected = {None: tokens[None], "mixed": tokens["mixed"], "x": tokens["qv"]}
        for (prompt, name), got in zip(work, _tokens(outputs), strict=True):
            assert got == expected[name][prompts.index(prompt)], name
        llm.check_idle()
    finally:
        llm.shutdown()


def test_a_disaggregated_pair_loads_on_both_roles(ray_session, lora_case) -> None:
    from pdserve.core.config import DisaggregationConfig

    base, adapters, prompts, tokens = lora_case
    remote = DisaggregationConfig(local_prefill_max_tokens=2, local_prefill_cached_fraction=1.0)
    llm = LLM(
        str(base),
        dtype="float32",
        disaggregated=True,
        num_cpus_per_rank=0.5,
        disaggregation=remote,
        max_loras=1,
    )
    try:
        llm.load_lora_adapter("x", adapters["mixed"])
        assert _tokens(llm.generate(prompts, _greedy("x"))) == tokens["mixed"]
        with pytest.raises(AdapterConflictError, match="max_loras=1"):
            llm.load_lora_adapter("y", adapters["qv"])
        llm.unload_lora_adapter("x")
        with pytest.raises(UnknownAdapterError):
            llm.generate(prompts[:1], _greedy("x"))
        llm.check_idle()
    finally:
        llm.shutdown()
