"""Router pieces without a cluster: prefix index, policies, admission, stream order."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from pdserve.core.messages import LoadReport
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.admission import Admission, RetryBudget
from pdserve.router.config import RouterConfig
from pdserve.router.placement import FEW_HOLDERS, CompletionInput
from pdserve.router.policies import FIRST_ROWS, CachedBlocks, RoutingRequest, by_floor, make_policy
from pdserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.router.router import InstanceInfo, Router
from pdserve.router.state import InstanceView, RegionTable
from pdserve.router.stream import RequestStream


def view(
    i: str, role: str, waiting_tokens: int = 0, free: int = 1000, step: float = 0.02
) -> InstanceView:
    v = InstanceView(i, role, "r", None, 16, 4096)
    v.report = LoadReport(i, role, 0, 1, waiting_tokens, free, 1000, step, 100.0)
    return v


def test_prefix_index_follows_kv_events() -> None:
    hashes = prompt_block_hashes(list(range(100)), 16)
    assert len(hashes) == 6
    index = PrefixIndex()
    index.apply("p0", hashes[:4], [])
    index.apply("p1", hashes[:2], [])
    assert index.cached_blocks("p0", hashes) == 4 and index.cached_blocks("p1", hashes) == 2
    index.apply("p0", [], [hashes[1]])  # a block in the middle evicted: the prefix stops there
    assert index.cached_blocks("p0", hashes) == 1
    index.forget("p1")
    assert index.cached_blocks("p1", hashes) == 0 and index.size("p1") == 0


def test_cost_model_follows_the_cache_unless_the_queue_outweighs_it() -> None:
    prefills = RegionTable([view("p0", "prefill"), view("p1", "prefill")])
    decodes = RegionTable([view("d0", "decode")])
    policy = make_policy("cost_model")
    cached = CachedBlocks.of([0, 20])  # p1 holds 20 blocks (320 tokens) of this 400-token prompt
    assert policy.place(RoutingRequest(400, 16, cached, 16), prefills, decodes).prefill == 1
    busy = RegionTable([view("p0", "prefill"), view("p1", "prefill", waiting_tokens=5000)])
    assert policy.place(RoutingRequest(400, 16, cached, 16), busy, decodes).prefill == 0


def test_cost_model_prices_few_rows_and_chooses_as_pricing_every_row_would() -> None:
    """The search that stops at rows which cannot win picks the row an exhaustive argmin
    over every row's price picks (the lowest of equal ones), on tables with many equal
    loads and prefixes (ties); when loads differ it reads a few rows of tens."""
    rng = np.random.default_rng(7)
    policy = make_policy("cost_model")
    decodes = RegionTable([view("d0", "decode")])
    most_read = 0  # rows read for tables of 20 rows or more whose loads differ
    for trial in range(300):
        n = int(rng.integers(1, 60))
        ties = trial % 3 == 0  # few distinct values: many equal prices
        waiting = rng.integers(0, 3 if ties else 4000, n) * (2000 if ties else 1)
        steps = rng.choice([0.01, 0.02], n) if ties else rng.uniform(0.005, 0.05, n)
        blocks = rng.integers(0, 3 if ties else 26, n) * (12 if ties else 1)
        prefills = RegionTable(
            [view(f"p{i}", "prefill", int(waiting[i]), step=float(steps[i])) for i in range(n)]
        )
        read: list[int] = []
        known = CachedBlocks.of(blocks)
        cached = CachedBlocks(
            known.depth, lambda row, read=read, known=known: (read.append(row), known[row])[1]
        )
        prompt = 400
        want = int(np.argmin((prefills.queued + prompt - blocks * 16) * prefills.per_token))
        assert (
            policy.place(RoutingRequest(prompt, 16, cached, 16), prefills, decodes).prefill == want
        )
        if not ties and n >= 20:
            most_read = max(most_read, len(set(read)))
    assert 0 < most_read <= 8  # seen: 5 (waiting up to 4,000 tokens, 25 blocks cached)


def test_cost_model_avoids_a_decode_without_room() -> None:
    decodes = RegionTable([view("d0", "decode", free=2), view("d1", "decode", free=900, step=0.05)])
    placement = make_policy("cost_model").place(
        RoutingRequest(400, 64, CachedBlocks.of([]), 16), RegionTable([]), decodes
    )
    assert placement.decode == 1 and placement.prefill is None


def test_cost_model_spreads_a_burst_onto_an_instance_that_has_not_stepped_yet() -> None:
    busy = view("d0", "decode", step=0.003)  # measured: fast steps
    fresh = InstanceView("d1", "decode", "r", None, 16, 4096)  # just started: no report yet
    policy, chosen = make_policy("cost_model"), []
    for _ in range(6):  # arrivals faster than the next load report
        decodes = RegionTable([busy, fresh])
        d = policy.place(
            RoutingRequest(64, 600, CachedBlocks.of([]), 16), RegionTable([]), decodes
        ).decode
        (busy, fresh)[d].inflight += 1
        chosen.append(d)
    assert sorted(chosen) == [0, 0, 0, 1, 1, 1], chosen


def test_round_robin_takes_turns_and_least_loaded_picks_the_idlest() -> None:
    prefills = RegionTable([view("p0", "prefill", 300), view("p1", "prefill", 10)])
    decodes = RegionTable([view("d0", "decode"), view("d1", "decode")])
    req = RoutingRequest(100, 16, CachedBlocks.of([0, 0]), 16)
    rr = make_policy("round_robin")
    assert [rr.place(req, prefills, decodes).prefill for _ in range(4)] == [0, 1, 0, 1]
    assert make_policy("least_loaded").place(req, prefills, decodes).prefill == 1


def test_admission_backs_off_while_ttft_misses_the_slo_and_recovers() -> None:
    adm = Admission(ceiling=100, ttft_slo_s=1.0, adaptive=True)
    for _ in range(32):
        adm.observe("r", 5.0)
    assert adm.limit("r") == 70
    assert not adm.admit("r", 70) and adm.rejected == 1
    for _ in range(32 * 5):
        adm.observe("r", 0.1)
    assert adm.limit("r") == 75


def test_retry_budget_is_bounded() -> None:
    budget = RetryBudget(ratio=0.1, minimum=2)
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()
    for _ in range(10):
        budget.on_request()
    assert budget.try_spend() and not budget.try_spend()
    assert budget.denied == 2


def test_stream_releases_tokens_in_order_whatever_arrives_first() -> None:
    async def run() -> list:
        stream = RequestStream("r", [1, 2, 3], SamplingParams(max_tokens=4), None)
        stream.add(1, [11, 12])  # decode's tokens overtake the prefill's first token
        assert stream.tokens == []
        stream.add(0, [10])
        stream.add(3, [13], "length")
        return [d async for d in stream.deltas()]

    deltas = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == [10, 11, 12, 13]
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 4


def test_an_instance_lost_while_a_request_waits_is_not_used() -> None:
    """The placement is chosen, then (while the request waits out the latency to its
    region) that region's only decode instance is lost: the attempt goes elsewhere."""
    from pdserve.core.messages import Reservation
    from pdserve.router.config import RegionSpec, RouterConfig
    from pdserve.router.placement import CompletionInput
    from pdserve.router.router import InstanceInfo, Router
    from tests.fakes import FakeActor

    def decode(name: str) -> FakeActor:
        def reserve(request, prefill_id, sink) -> Reservation:  # type: ignore[no-untyped-def]
            return Reservation(request.request_id, name, [], 0, 30.0, local=True)

        return FakeActor(reserve=reserve, abort=lambda rid: True)

    regions = (RegionSpec("east", {"west": 0.02}), RegionSpec("west", {"east": 0.02}))
    router = Router(RouterConfig(regions=regions, auth_disabled=True), None, None)
    handles = {"d-east": decode("d-east"), "d-west": decode("d-west")}
    for name, handle in handles.items():
        router.register(InstanceInfo(name, "decode", name[2:], handle, 16, 4096))
    inp = CompletionInput("c", list(range(40)), SamplingParams(max_tokens=4), "west")
    choice = router.chooser.choose(inp)
    assert choice.decode.instance_id == "d-west"
    router.instance_lost("d-west")  # meanwhile

    async def launch() -> str:
        stream = RequestStream("c.1", inp.prompt_token_ids, inp.params, None)
        attempt = await router.attempts.launch(stream, inp, choice, 0)
        assert attempt.decode is not None
        return attempt.decode.instance_id

    assert asyncio.run(launch()) == "d-east"
    assert not handles["d-west"].called("reserve")


def test_a_full_region_spills_to_another_before_refusing() -> None:
    from pdserve.core.errors import OverloadedError
    from pdserve.core.messages import Reservation
    from pdserve.router.config import RegionSpec, RouterConfig
    from pdserve.router.placement import CompletionInput
    from pdserve.router.router import InstanceInfo, Router
    from tests.fakes import FakeActor

    def reserve_full(request, prefill_id, sink) -> Reservation:  # type: ignore[no-untyped-def]
        raise OverloadedError("no room", retry_after_s=0.5)

    def reserve_ok(request, prefill_id, sink) -> Reservation:  # type: ignore[no-untyped-def]
        return Reservation(request.request_id, "d-east", [], 0, 30.0, local=True)

    regions = (RegionSpec("west", {"east": 0.02}), RegionSpec("east", {"west": 0.02}))
    router = Router(
        RouterConfig(regions=regions, auth_disabled=True, retry_budget_ratio=1.0), None, None
    )
    router.register(
        InstanceInfo("d-west", "decode", "west", FakeActor(reserve=reserve_full), 16, 4096)
    )
    router.register(
        InstanceInfo("d-east", "decode", "east", FakeActor(reserve=reserve_ok), 16, 4096)
    )
    inp = CompletionInput("c", list(range(40)), SamplingParams(max_tokens=4), "west")

    async def launch() -> str:
        stream = RequestStream("c.1", inp.prompt_token_ids, inp.params, None)
        attempt = await router.attempts.launch(stream, inp, router.chooser.choose(inp), 0)
        assert attempt.decode is not None
        return attempt.decode.instance_id

    assert asyncio.run(launch()) == "d-east"


def test_a_full_lone_region_is_refused_naming_why() -> None:
    import pytest

    from pdserve.core.errors import OverloadedError
    from pdserve.core.messages import Reservation
    from pdserve.router.config import RegionSpec, RouterConfig
    from pdserve.router.placement import CompletionInput
    from pdserve.router.router import InstanceInfo, Router
    from tests.fakes import FakeActor

    def reserve_full(request, prefill_id, sink) -> Reservation:  # type: ignore[no-untyped-def]
        raise OverloadedError("no room", retry_after_s=0.5)

    config = RouterConfig(regions=(RegionSpec("local"),), auth_disabled=True)
    router = Router(config, None, None)
    router.register(InstanceInfo("d", "decode", "local", FakeActor(reserve=reserve_full), 16, 4096))
    inp = CompletionInput("c", list(range(40)), SamplingParams(max_tokens=4), "local")

    async def launch() -> None:
        stream = RequestStream("c.1", inp.prompt_token_ids, inp.params, None)
        await router.attempts.launch(stream, inp, router.chooser.choose(inp), 0)

    with pytest.raises(OverloadedError, match="'local' is full: its decode instances have no room"):
        asyncio.run(launch())


def test_an_error_raised_in_an_instance_reaches_the_client_without_its_traceback() -> None:
    from ray.exceptions import RayTaskError

    from pdserve.core.errors import OverloadedError
    from pdserve.router.reservation import cause_of

    raised = OverloadedError("decode d has no room for 1024 prompt tokens now (3 free pages)")
    trace = 'Traceback (most recent call last):\n  File "decode/server.py", line 188\n'
    remote = RayTaskError("InstanceWorker.reserve", trace, raised).as_instanceof_cause()
    assert isinstance(remote, OverloadedError) and "server.py" in str(remote)  # as Ray gives it
    assert cause_of(remote) is raised
    assert str(cause_of(remote)) == str(raised)


def test_adaptive_admission_never_rises_above_a_small_ceiling() -> None:
    admission = Admission(ceiling=2, ttft_slo_s=0.1, adaptive=True)
    for _ in range(4 * 32):  # windows whose TTFT misses the SLO cut the limit
        admission.observe("r", 5.0)
    assert admission.limit("r") <= 2
    assert admission.admit("r", 1) and not admission.admit("r", 2)


def test_negative_priorities_get_a_share_of_the_cap_and_are_refused_first() -> None:
    adm = Admission(ceiling=10, ttft_slo_s=1.0, adaptive=False, low_priority_share=0.4)
    assert adm.limit("r") == 10 and adm.limit("r", priority=-1) == 4
    assert adm.admit("r", 3, priority=-5) and not adm.admit("r", 4, priority=-5)
    assert adm.admit("r", 9) and adm.admit("r", 9, priority=3) and not adm.admit("r", 10)
    assert (adm.rejected, adm.rejected_low_priority) == (2, 1)


def test_under_overload_negative_priorities_get_a_capped_max_tokens_first() -> None:
    from pdserve.router.config import RegionSpec, RouterConfig
    from pdserve.router.placement import CompletionInput
    from pdserve.router.router import Router

    config = RouterConfig(
        regions=(RegionSpec("r"),),
        auth_disabled=True,
        max_inflight_per_region=40,
        adaptive_admission=False,
        low_priority_share=0.5,
        low_priority_degrade_at=0.5,
        low_priority_max_tokens=8,
    )
    router = Router(config, None, None)
    batch = CompletionInput("b", [1, 2, 3], SamplingParams(max_tokens=100, priority=-1))
    online = CompletionInput("o", [1, 2, 3], SamplingParams(max_tokens=100))
    router.region_inflight["r"] = 9  # under half of the low-priority cap of 20
    assert router._degrade(batch) == (batch, None)
    router.region_inflight["r"] = 10
    degraded, capped = router._degrade(batch)
    assert capped == 8 and degraded.params.max_tokens == 8 and degraded.params.priority == -1
    assert router._degrade(online) == (online, None), "online traffic is never capped"
    assert not router.admission.admit("r", 20, priority=-1) and router.admission.admit("r", 20)


def test_requests_naming_unknown_regions_leave_no_entry_in_any_table() -> None:
    import pytest

    from pdserve.core.errors import InvalidArgumentError
    from pdserve.router.config import RegionSpec, RouterConfig
    from pdserve.router.placement import CompletionInput
    from pdserve.router.router import Router

    config = RouterConfig(regions=(RegionSpec("r"),), auth_disabled=True)
    router = Router(config, None, None)

    async def send(region: str) -> None:
        params = SamplingParams(max_tokens=100, priority=-1)  # the degrade path reads its home
        async for _ in router.stream(CompletionInput("c", [1, 2, 3], params, region)):
            pass

    for i in range(2000):
        with pytest.raises(InvalidArgumentError, match="unknown region"):
            asyncio.run(send(f"made-up-{i}"))

    def names(obj: object, depth: int = 0) -> set[str]:  # every key of every table it holds
        found: set[str] = set()
        for value in vars(obj).values() if hasattr(obj, "__dict__") and depth < 2 else ():
            if isinstance(value, dict):
                found |= {str(k) for k in value} | {
                    str(p) for k in value if isinstance(k, tuple) for p in k
                }
            elif hasattr(value, "__dict__") and value.__class__.__module__.startswith("pdserve"):
                found |= names(value, depth + 1)
        return found

    assert not [n for n in names(router) if "made-up" in n]


def test_a_prompt_many_instances_hold_is_placed_as_pricing_every_holder_would() -> None:
    """Past FEW_HOLDERS holders the router looks rows up as the policy reads them; the
    prefill it picks is the one an exhaustive pricing of every holder's prefix picks."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 2000) for _ in range(512)]
    hashes = prompt_block_hashes(prompt, 16)
    for trial in range(20):
        router = Router(RouterConfig(auth_disabled=True), None, None)  # type: ignore[arg-type]
        router.register(InstanceInfo("d0", "decode", "local", None, 16, 4096))
        names = [f"p{i}" for i in range(FEW_HOLDERS + 8 + trial)]
        for name in names:
            router.register(InstanceInfo(name, "prefill", "local", None, 16, 4096))
            held = hashes[: rng.randrange(1, len(hashes))]
            waiting = rng.randrange(0, 3) * 300 if trial % 2 else rng.randrange(4000)
            router.on_report(
                LoadReport(name, "prefill", 0, 1, waiting, 900, 1000, 0.02, 100.0, held)
            )
        choice = router.chooser.choose(CompletionInput("c", prompt, SamplingParams(max_tokens=8)))
        table = router.cluster.table("prefill", "local", "", None)
        counts = router.prefixes.cached_prefixes(hashes)
        cached = np.array([counts.get(v.instance_id, 0) for v in table.views])
        want = table.views[int(np.argmin((table.queued + 512 - cached * 16) * table.per_token))]
        assert choice.prefill is want, (trial, choice.prefill, want)


def test_the_search_reads_rows_in_ascending_floor_each_once() -> None:
    rng = np.random.default_rng(0)
    for n in (1, FIRST_ROWS - 1, FIRST_ROWS, FIRST_ROWS + 1, 50, 500):
        floor = rng.integers(0, 7, n).astype(np.float64)  # many ties
        floor[rng.integers(0, n)] = np.nan  # a price that is not a number comes last
        rows = list(by_floor(floor))
        assert sorted(rows) == list(range(n))
        seen = floor[rows]
        numbers = seen[~np.isnan(seen)]
        assert np.all(np.diff(numbers) >= 0) and np.isnan(seen[-1]), (n, seen)
