"""Adapter-aware placement: a request under a LoRA adapter goes only to instances holding it,
and an instance started after a runtime load holds it once its own load is answered."""

from __future__ import annotations

import asyncio
from typing import Any

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


class _Remote:
    def __init__(self, call: Any) -> None:
        self.remote = call


class _Leader:
    """An instance's leader as the router calls it: each call waits for the test's answer."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, asyncio.Future[Any]]] = []
        self.load_lora_adapter = _Remote(lambda name, folder: self._call("load", name))
        self.unload_lora_adapter = _Remote(lambda name: self._call("unload", name))

    def _call(self, kind: str, name: str) -> asyncio.Future[Any]:
        answer = asyncio.get_running_loop().create_future()
        self.calls.append((kind, name, answer))
        return answer

    async def answer(self, kind: str, result: Any) -> None:
        """Answer the next call (which must be ``kind``) with ``result`` (an exception: raise it)."""
        while not any(not f.done() for _, _, f in self.calls):
            await asyncio.sleep(0)
        [(k, _, f)] = [c for c in self.calls if not c[2].done()]
        assert k == kind, self.calls
        f.set_exception(result) if isinstance(result, BaseException) else f.set_result(result)


def _join(router: Router, name: str) -> _Leader:
    leader = _Leader()
    role = "prefill" if name[0] == "p" else "decode"
    router.register(InstanceInfo(name, role, "local", leader, 16, 4096, (), ""))
    return leader


def test_an_instance_started_after_a_load_holds_the_adapter_once_its_load_is_answered() -> None:
    async def run() -> None:
        config = RouterConfig(model_name="tiny", auth_disabled=True, policy="round_robin")
        router = Router(config, None, None, vocab_size=100)
        first = {name: _join(router, name) for name in ("p0", "d0")}
        load = asyncio.ensure_future(router.lora.load("poems", "/adapters/poems"))
        for leader in first.values():
            await leader.answer("load", ("poems", "f9"))
        assert sorted((await load)["loaded_on"]) == ["d0", "p0"]

        late = _join(router, "d1")  # started after the load: it loads the adapter too
        while not late.calls:
            await asyncio.sleep(0)
        assert [(k, n) for k, n, _ in late.calls] == [("load", "poems")]
        assert {_choose(router, "poems")[1] for _ in range(4)} == {"d0"}  # not answered yet
        await late.answer("load", ("poems", "f9"))
        await router.lora.replayed()
        assert {_choose(router, "poems")[1] for _ in range(4)} == {"d0", "d1"}

        changed = _join(router, "d2")  # the folder holds other content now: taken off again
        await changed.answer("load", ("poems", "f0"))
        await changed.answer("unload", None)
        failed = _join(router, "d3")  # did not answer: logged and counted, serves the base
        await failed.answer("load", TimeoutError())
        await router.lora.replayed()
        assert {_choose(router, "poems")[1] for _ in range(6)} == {"d0", "d1"}
        assert {_choose(router, None)[1] for _ in range(8)} == {"d0", "d1", "d2", "d3"}
        registry = router.obs.metrics.registry
        assert registry.get_sample_value("pdserve_lora_replay_failures_total") == 2

        pending = _join(router, "d4")  # its load is under way when the adapter is unloaded
        unload = asyncio.ensure_future(router.lora.unload("poems"))
        for leader in (*first.values(), late):
            await leader.answer("unload", None)
        assert sorted((await unload)["unloaded_from"]) == ["d0", "d1", "p0"]
        await pending.answer("load", ("poems", "f9"))
        await pending.answer("unload", None)  # no longer served: taken off again
        await router.lora.replayed()
        assert not any(v.adapters for v in router.cluster.instances.values())
        assert registry.get_sample_value("pdserve_lora_replay_failures_total") == 2
        assert not _join(router, "d5").calls  # unloaded: instances started now load nothing

    asyncio.run(run())


def test_adapter_names_are_scoped_per_model_version() -> None:
    from pdserve.router.state import ClusterView, InstanceView

    cluster = ClusterView()
    for iid, model in (("a1", "base-a"), ("b1", "base-b")):
        cluster.add(InstanceView(iid, "decode", "r", None, 16, 4096, model=model))
    cluster.set_adapter("a1", "sql", "content-of-a")
    cluster.set_adapter("b1", "sql", "content-of-b")  # another model's own adapter "sql"
    assert [v.instance_id for v in cluster.table("decode", "r", "base-a", "sql").views] == ["a1"]
    assert [v.instance_id for v in cluster.table("decode", "r", "base-b", "sql").views] == ["b1"]
    cluster.set_adapter("a1", "sql", None)  # unloaded from model a: b's stays served
    assert len(cluster.table("decode", "r", "base-b", "sql")) == 1
    assert ("base-a", "sql") not in cluster.adapter_fingerprints
