"""Adapter-aware placement: a request under a LoRA adapter goes only to instances holding it."""

from __future__ import annotations

import pytest

from pdserve.core.messages import LoadReport
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.placement import AdapterUnavailableError, CompletionInput
from pdserve.router.prefix_index import prompt_block_hashes
from pdserve.router.router import InstanceInfo, Router

PROMPT = list(range(1, 70))


def _router(policy: str, without_prefill: str = "local") -> Router:
    config = RouterConfig(
        model_name="tiny",
        auth_disabled=True,
        policy=policy,
        lora_adapters=("sql",),
        without_prefill=without_prefill,
    )
    router = Router(config, None, None, vocab_size=100)
    holds = {"p0": (("sql", "f1"),), "d0": (("sql", "f1"),), "p1": (), "d1": ()}
    for name, adapters in holds.items():
        role = "prefill" if name[0] == "p" else "decode"
        paired = ("d0", "d1") if role == "prefill" else ()
        router.register(InstanceInfo(name, role, "local", None, 16, 4096, paired, "", adapters))
    return router


def _choose(router: Router, lora: str | None) -> tuple[str | None, str]:
    inp = CompletionInput("c", PROMPT, SamplingParams(max_tokens=4, lora=lora))
    choice = router.chooser.choose(inp)
    return (choice.prefill.instance_id if choice.prefill else None), choice.decode.instance_id


def test_an_adapters_requests_go_only_to_its_holders() -> None:
    router = _router("round_robin")
    base = {_choose(router, None) for _ in range(8)}
    assert {p for p, _ in base} == {"p0", "p1"} and {d for _, d in base} == {"d0", "d1"}
    assert {_choose(router, "sql") for _ in range(8)} == {("p0", "d0")}


def test_holders_win_even_when_busier_and_the_prefix_hashes_carry_the_content() -> None:
    router = _router("cost_model")
    for name in ("p0", "d0"):  # the holders are loaded; the others idle
        role = "prefill" if name[0] == "p" else "decode"
        router.on_report(LoadReport(name, role, 9, 30, 5000, 2, 1000, 0.2, 100.0))
    assert _choose(router, None) == ("p1", "d1")
    assert _choose(router, "sql") == ("p0", "d0")
    inp = CompletionInput("c", PROMPT, SamplingParams(lora="sql"))
    hashes = router.chooser.choose(inp).hashes[16]
    assert hashes == prompt_block_hashes(PROMPT, 16, "sql", "f1")
    assert hashes != prompt_block_hashes(PROMPT, 16, "sql")


def test_other_content_under_the_name_is_no_holder() -> None:
    router = _router("round_robin")
    router.cluster.set_adapter("d1", "sql", "f2")  # another adapter under the same name
    assert {_choose(router, "sql") for _ in range(6)} == {("p0", "d0")}


def test_a_load_on_more_instances_widens_the_choice() -> None:
    router = _router("round_robin")
    router.cluster.set_adapter("d1", "sql", "f1")
    router.cluster.set_adapter("p1", "sql", "f1")
    chosen = {_choose(router, "sql") for _ in range(8)}
    assert {p for p, _ in chosen} == {"p0", "p1"} and {d for _, d in chosen} == {"d0", "d1"}


def test_a_request_no_instance_can_serve_is_refused_not_sent() -> None:
    router = _router("round_robin", without_prefill="refuse")
    router.catalog.add_adapter("tiny", "poems")  # served by name, held by no instance yet
    with pytest.raises(AdapterUnavailableError, match="no available decode instance") as info:
        _choose(router, "poems")
    assert info.value.http_status == 503
    router.cluster.set_adapter("d1", "poems", "f9")  # a decode holds it, no prefill does
    with pytest.raises(AdapterUnavailableError, match="prefill instance holds LoRA adapter"):
        _choose(router, "poems")
    router.cluster.set_adapter("p1", "poems", "f9")
    assert _choose(router, "poems") == ("p1", "d1")
    router.cluster.set_adapter("d1", "poems", None)  # unloaded from its only decode holder
    with pytest.raises(AdapterUnavailableError, match="held by: \\['p1'\\]"):
        _choose(router, "poems")


def test_without_a_prefill_holder_the_decode_holder_prefills_itself() -> None:
    router = _router("round_robin")  # without_prefill: local
    router.cluster.set_adapter("d1", "poems", "f9")
    assert _choose(router, "poems") == (None, "d1")
