"""The router names a peer whose device holds more of a prompt than the chosen prefill.

A real :class:`~pdserve.router.router.Router` with fake instance handles: the
prefill instances report KV events as instances do, and the decode instance's
``reserve`` records the request the router sent it.
"""

from __future__ import annotations

import asyncio

from pdserve.core.messages import (
    FirstToken,
    LoadReport,
    PeerPrefix,
    PrefillRequest,
    Reservation,
    ReserveRequest,
)
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.placement import CompletionInput
from pdserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.router.router import InstanceInfo, Router
from pdserve.router.stream import RequestStream
from tests.fakes import FakeActor

PROMPT = list(range(1000, 1000 + 400))  # 25 blocks of 16
HASHES = prompt_block_hashes(PROMPT, 16)


def report(instance: str, waiting_tokens: int, **events: list[bytes]) -> LoadReport:
    return LoadReport(instance, "prefill", 0, 0, waiting_tokens, 900, 1000, 0.04, 200.0, **events)


def make_router(
    local: bool = True, **config: object
) -> tuple[Router, list[ReserveRequest], list[PrefillRequest]]:
    """A router over d0 (prefilling locally when ``local``), p0 and p1."""
    sent: list[ReserveRequest] = []
    prefilled: list[PrefillRequest] = []

    def reserve(request: ReserveRequest, prefill_id: str, sink: object) -> Reservation:
        sent.append(request)
        return Reservation(request.request_id, "d0", [0] * 26, 0, 30.0, local=local)

    def prefill(request: PrefillRequest) -> FirstToken:
        prefilled.append(request)
        return FirstToken(request.request_id, 7, True, "length")

    router = Router(RouterConfig(auth_disabled=True, **config), None, None)  # type: ignore[arg-type]
    decode = FakeActor(reserve=reserve, abort=lambda rid: True, cancel=lambda rid: None)
    router.register(InstanceInfo("d0", "decode", "local", decode, 16, 4096))
    for name in ("p0", "p1"):
        handle = FakeActor(prefill=prefill, drop=lambda rid: True)
        router.register(InstanceInfo(name, "prefill", "local", handle, 16, 4096, ("d0",)))
    router.on_report(report("p0", 0))
    # p1 prefilled this prompt before and holds 24 blocks, but has a long queue now.
    router.on_report(report("p1", 50_000, kv_added=HASHES[:24]))
    return router, sent, prefilled


def launch(router: Router) -> None:
    inp = CompletionInput("c", PROMPT, SamplingParams(max_tokens=1))

    async def run() -> None:
        stream = RequestStream("c.1", PROMPT, inp.params, None)
        await router.attempts.launch(stream, inp, router.chooser.choose(inp), 0)
        await asyncio.sleep(0.05)  # the first token's task

    asyncio.run(run())


def test_a_busy_peer_holding_the_prefix_is_named_to_the_decode_instance() -> None:
    router, sent, prefilled = make_router()
    choice = router.chooser.choose(CompletionInput("c", PROMPT, SamplingParams(max_tokens=4)))
    assert choice.prefill is not None and choice.prefill.instance_id == "p0", "p1 is too busy"
    launch(router)
    assert sent[0].peer == PeerPrefix("p1", 24) and prefilled == []


def test_when_the_decode_instance_declines_the_chosen_prefill_pulls_from_the_peer() -> None:
    router, sent, prefilled = make_router(local=False)
    launch(router)
    assert sent[0].peer == prefilled[0].peer == PeerPrefix("p1", 24)


def test_no_peer_when_its_blocks_left_the_device_or_moving_them_costs_more() -> None:
    router, sent, _ = make_router()
    router.on_report(report("p1", 50_000, kv_lower=HASHES[10:24]))  # now in host memory
    launch(router)
    assert sent[-1].peer == PeerPrefix("p1", 10), "only the part still on its device"
    router.on_report(report("p1", 50_000, kv_lower=HASHES[:10]))
    launch(router)
    assert sent[-1].peer is None
    router.on_report(report("p1", 50_000, kv_device=HASHES[:24]))  # loaded back
    launch(router)
    assert sent[-1].peer == PeerPrefix("p1", 24)
    slow, sent, _ = make_router(peer_kv_s_per_token=1.0)
    launch(slow)
    off, sent_off, _ = make_router(peer_prefill=False)
    launch(off)
    assert sent[-1].peer is None and sent_off[-1].peer is None


def test_the_index_keeps_each_instances_tier_per_block() -> None:
    index = PrefixIndex()
    index.apply("p", HASHES[:6], [])
    index.apply("p", [], [], lower=HASHES[2:6])
    assert index.cached_blocks("p", HASHES) == 6 and index.device_blocks("p", HASHES) == 2
    index.apply("p", [], [HASHES[4]], device=HASHES[2:3])
    assert index.cached_blocks("p", HASHES) == 4 and index.device_blocks("p", HASHES) == 3
    index.apply("p", [], [], lower=HASHES[20:])  # not held: no effect
    index.forget("p")
    assert index.device_blocks("p", HASHES) == 0 and index.size("p") == 0


def test_the_peer_is_the_one_whose_device_holds_the_most_of_the_prompt() -> None:
    """Of several busy peers, the one with the longest prefix on its device is named,
    whichever holds the deepest block: p1 holds 24 blocks but only 10 on its device,
    p2 holds 18 there, p3 holds 24 there but drains, p4 holds another prompt."""
    router, sent, _ = make_router()
    other = prompt_block_hashes(list(range(5000, 5400)), 16)
    peers = {"p2": HASHES[:18], "p3": HASHES[:24], "p4": other}
    for name, held in peers.items():
        router.register(InstanceInfo(name, "prefill", "local", FakeActor(), 16, 4096, ("d0",)))
        router.on_report(report(name, 50_000, kv_added=held))
    router.on_report(report("p1", 50_000, kv_lower=HASHES[10:24]))
    router.cluster.instances["p3"].draining = True
    launch(router)
    assert sent[-1].peer == PeerPrefix("p2", 18)
    router.cluster.instances["p3"].draining = False
    launch(router)
    assert sent[-1].peer == PeerPrefix("p3", 24)
