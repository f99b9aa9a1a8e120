"""A whole serving cluster in virtual time: regions, instances, router, planner.

Events, in time order (:class:`~pdserve.sim.clock.EventQueue`; arrivals are
read from the workload arrays as time reaches them, never queued in bulk)::

    arrival  -> the router's own region and instance choice
                (:class:`~pdserve.router.placement.RegionChooser`: home unless its
                estimated TTFT + 2 x latency is beaten elsewhere; regions at their
                admission limit skip; the routing policy prices in each prefill
                instance's cached prefix from a real prefix index)
             -> decode prefills it itself (short or mostly cached prompt: the
                decode server's rule) or reserve pages on decode, then queue at
                prefill (retrying other decodes within the retry budget)
    step     -> Scheduler.update on that instance; first tokens, finishes;
                a finished prefill holds its pages and schedules a hand-off
    handoff  -> after the KV transfer time: decode activates the request,
                prefill releases its pages
    plan     -> every planner interval: per-region metrics -> Planner.decide;
                "on" mode adds an instance (ready after ``startup_s``) or
                drains one (no new requests; removed when idle)
    ready    -> a new instance joins the router's tables
                (plan and ready: :class:`~pdserve.sim.scaling.SimScaling`)
    send     -> an arrival a limit on requests in flight held (:mod:`~pdserve.sim.gate`)

With a :class:`~pdserve.sim.shards.ShardSpec` the cluster is one shard of a fleet
(``pdserve sim --workers``, :mod:`~pdserve.sim.sharded`): it holds the instances of
its cells and takes its cells' arrivals; its router sees other shards' regions as
they last reported (:class:`~pdserve.sim.shards.RemoteLoads`) and hands a request
it routes there to their shard (``exports``), which launches it (``import``);
:meth:`SimCluster.advance` runs it a window of virtual time at a time.

A request still in flight ``request_timeout_s`` after it was sent is aborted where
it is (:mod:`~pdserve.sim.timeouts`; its deadlines are a queue of their own).

A request the front door would refuse (its prompt and ``max_tokens`` past the
context limit) fails at arrival. What the router would learn from load reports
it reads here after every step of an instance (the live router hears every
~100 ms), the prefill instances' KV events included: the blocks their real
block pools cache and evict feed the router's
:class:`~pdserve.router.prefix_index.PrefixIndex`. Where no instance caches
prefixes, the prompt is not hashed (its index stays empty, so the choice is the
same). A prefix held by another prefill instance is not moved between instances
(``router.peer_prefill``): the chosen prefill recomputes what it lacks.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.planner import PlannerPolicy
from pdserve.cluster.proactive import make_planner
from pdserve.core.errors import InvalidArgumentError, OverloadedError
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.admission import Admission, RetryBudget
from pdserve.router.placement import Choice, CompletionInput, RegionChooser
from pdserve.router.policies import make_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.state import ClusterView
from pdserve.sim.build import ProfileBook, make_instance
from pdserve.sim.capacity import ProfileCapacity
from pdserve.sim.clock import EventQueue, VirtualClock
from pdserve.sim.gate import SendGate
from pdserve.sim.instance import TOKEN, SimInstance
from pdserve.sim.jitter import Jitter
from pdserve.sim.metrics import RegionWindow
from pdserve.sim.options import SimOptions, SimRun, long_lived_heap
from pdserve.sim.profile import MAX_SECONDS, Profile
from pdserve.sim.reserve import decode_order, prefills_locally, reserve
from pdserve.sim.results import Recorder, refusal
from pdserve.sim.scaling import SimScaling
from pdserve.sim.shards import (
    ROLES,
    Handoff,
    RegionLoad,
    RemoteLoads,
    ShardChooser,
    ShardReport,
    ShardSpec,
    instance_names,
    load_rows,
)
from pdserve.sim.timeouts import Deadlines
from pdserve.sim.workload import SimWorkload

PLANNER_WINDOWS = 4  # the planner reads the last 4 intervals, as the controller does


@dataclass
class _Track:
    """A request in flight: where it is and what it holds."""

    index: int
    region: str
    decode: SimInstance
    prefill: SimInstance | None
    prompt_len: int
    cached_on_decode: int = 0


def _no_hashes(config: ClusterConfig) -> dict[int, list[bytes]] | None:
    """The prompt's block hashes the router would compute, per decode block size: none
    (an empty list per size) where no instance caches prefixes, since nothing can match
    them; None where one does (the router hashes the prompt)."""
    caching = any(
        config.engine_config(role, g).cache.enable_prefix_caching
        for g in config.regions
        for role in ("prefill", "decode")
    )
    if caching:
        return None
    return {config.engine_config("decode", g).cache.block_size: [] for g in config.regions}


def _default_planner(config: ClusterConfig, book: ProfileBook) -> PlannerPolicy:
    """The planner the controller runs for ``config`` (a proactive one's capacity from the
    profiles)."""
    r = config.router
    capacity = ProfileCapacity(config, book) if config.planner.policy == "proactive" else None
    regions = {g.name: g for g in config.regions}
    return make_planner(config.planner, r.ttft_slo_s, r.tpot_slo_s, regions, capacity)


def _arrivals(work: SimWorkload, shard: ShardSpec | None) -> tuple[range | list[int], Any]:
    """The arrivals a cluster takes (workload indices: a shard's, else all) and their times."""
    if shard is None:
        return range(len(work)), work.arrival_s
    return shard.arrivals.tolist(), work.arrival_s[shard.arrivals]


class SimCluster:
    def __init__(
        self,
        config: ClusterConfig,
        book: ProfileBook,
        workload: SimWorkload,
        options: SimOptions | None = None,
        planner: PlannerPolicy | None = None,
        shard: ShardSpec | None = None,
    ) -> None:
        self.config, self.book, self.work = config, book, workload
        self.shard = shard
        self.local = None if shard is None else shard.regions  # a shard's regions
        self.options = options or SimOptions()
        self.clock, self.queue = VirtualClock(), EventQueue()
        self.view = ClusterView()
        self.policy = make_policy(config.router.policy)
        r = config.router
        self.admission = Admission(r.max_inflight_per_region, r.ttft_slo_s, r.adaptive_admission)
        self.retries = RetryBudget(r.retry_budget_ratio)
        self.planner = planner or _default_planner(config, book)
        self.regions = [g.name for g in config.regions]
        self.instances: dict[str, SimInstance] = {}
        self.profiles: dict[str, Profile] = {}
        self.all: list[SimInstance] = []
        self.inflight = dict.fromkeys(self.regions, 0)
        self.prefixes = PrefixIndex()
        # other shards' regions
        self.remote = RemoteLoads(self.view, self.inflight, self.local or frozenset())
        self.chooser = self._chooser()
        self._no_hashes = _no_hashes(config)
        self.starting: Counter[tuple[str, str]] = Counter()  # (region, role): asked, not ready
        span = PLANNER_WINDOWS * config.planner.interval_s  # as the controller asks the router
        self.windows = {g: RegionWindow(span) for g in self.regions}
        self.tracks: dict[str, _Track] = {}
        w = workload
        rec = Recorder(w.arrival_s, w.prompt_len, w.output_len, w.home, self.options.keep_itl)
        self.run_info = SimRun(rec, self.regions, self.all)
        self.gate = SendGate(self.options.max_concurrency, self.queue, self.clock, rec)
        self.deadlines = Deadlines(self.options.request_timeout_s)
        seed = self.options.noise_seed
        self.request_noise = Jitter(self.options.request_jitter, 0.0, f"requests/{seed}")
        self._serial, self.max_model_len = 0, 1 << 62
        self.own, self.own_arrival_s = _arrivals(workload, shard)
        self.next_arrival = 0  # the next of those to arrive
        self.launching = 0  # requests on their way to their region (a "launch" or "import")
        self.exports: list[Handoff] = []  # requests routed to other shards' regions
        self.idle_at: float | None = None  # a shard: since when it holds no work
        self._reported: dict[str, tuple[str, ...]] = {}  # a shard's regions' last members
        self.scaling = SimScaling(self)
        self._build()

    def _build(self) -> None:
        """The config's instances (a shard's: its cells'), named as one process names them."""
        names = instance_names(self.config)
        held = None if self.shard is None else self.shard.instance_ids
        for g in self.config.regions:
            for role in ROLES:
                for name in names[(g.name, role)]:
                    if held is None or name in held:
                        self.join(self.new_instance(g.name, role, name))
        self._serial = sum(len(v) for v in names.values())

    def _chooser(self) -> RegionChooser:
        """The router's region and instance chooser (a shard's reads other shards' loads)."""
        r = self.config.router
        args = (r, self.view, self.prefixes, self.policy, self.admission, self.inflight)
        if self.shard is None:
            return RegionChooser(*args)
        chooser = ShardChooser(*args)
        chooser.remote = self.remote
        return chooser

    @property
    def arrivals_left(self) -> bool:
        return self.next_arrival < len(self.own)

    # -- instances -------------------------------------------------------------------

    def new_instance(self, region: str, role: str, name: str | None = None) -> SimInstance:
        if name is None:  # one the planner adds (in a shard: named after its group)
            self._serial += 1
            suffix = "" if self.shard is None else self.shard.suffix(region)
            name = f"{region}-{role}-{self._serial}{suffix}"
        g = next(x for x in self.config.regions if x.name == region)
        inst, profile = make_instance(self.config, self.book, g, role, name, self.clock.now)
        self.profiles[inst.instance_id] = profile
        if self.options.noise_seed:  # seed 0: the draws the instance was built with
            inst.seed_noise(self.options.noise_seed)
        self.all.append(inst)
        if self.options.one_host or self.options.host_cores:
            inst.peers, inst.host_cores = self.all, self.options.host_cores
        return inst

    def join(self, inst: SimInstance) -> None:
        self.instances[inst.instance_id] = inst
        if inst.role == "decode":  # the router's limit: the least of its decode instances'
            self.max_model_len = min(self.max_model_len, inst.scheduler.max_model_len)
        self.view.add(inst.view)

    def refresh(self, inst: SimInstance) -> None:
        inst.view.report = inst.report()
        self.view.touch(inst.view)
        if inst.role == "prefill" and inst.kv.pool.enable_caching:  # its KV events
            ev = inst.kv.drain_events()
            if ev.added or ev.removed:
                self.prefixes.apply(inst.instance_id, ev.added, ev.removed, ev.lower, ev.device)

    def kick(self, inst: SimInstance) -> None:
        """Start the instance's next step once every event of this instant is in (an
        engine loop picks up everything queued when it schedules)."""
        if not inst.busy and not inst.kick_pending:
            inst.kick_pending = True
            self.queue.push(self.clock.now(), "kick", inst)

    def _on_kick(self, inst: SimInstance) -> None:
        inst.kick_pending = False
        if not inst.busy and inst.instance_id in self.instances:
            end = inst.start(self.clock.now(), self.options.fast)
            if end is not None:
                self.queue.push(end, "step", (inst, inst.generation))
        if self.options.host_cores:
            self._reshare()

    def _reshare(self) -> None:
        """On a shared host, re-time the steps in flight: a step started or ended."""
        for peer in self.all:
            if peer.reshare(self.clock.now()):
                self.queue.push(peer.pending_end, "step", (peer, peer.generation))

    def interrupt(self, inst: SimInstance) -> None:
        if inst.interrupt(self.clock.now()):
            self.queue.push(inst.pending_end, "step", (inst, inst.generation))

    # -- the loop --------------------------------------------------------------------

    def run(self) -> SimRun:
        self.start()
        with long_lived_heap():
            self._loop()
        return self.stop()

    def start(self) -> None:
        if self.options.planner and self.config.planner.mode != "off":
            self.queue.push(self.config.planner.interval_s, "plan")
        self.scaling.count("start")

    def stop(self) -> SimRun:
        self.run_info.end_s = self.clock.now() if self.idle_at is None else self.idle_at
        self.scaling.count("end")
        return self.run_info

    def advance(self, until: float) -> None:
        """A shard: run every event and arrival before virtual time ``until``."""
        self._loop(until)

    def _loop(self, until: float = math.inf) -> None:
        own, arrivals, n = self.own, self.own_arrival_s, len(self.own)
        handlers: dict[str, Callable[[Any], None]] = {
            "step": self._on_step,
            "handoff": self._on_handoff,
            "plan": self.scaling.on_plan,
            "ready": self.scaling.on_ready,
            "launch": self._launch_now,
            "import": self._import,
            "kick": self._on_kick,
            "send": self._arrive,
        }
        done, deadlines = self.run_info.recorder.done, self.deadlines
        while True:
            t_next, due = self.queue.peek_time(), deadlines.next_at(done)
            k = self.next_arrival
            if k < n and arrivals[k] <= min(t_next, due):
                if arrivals[k] >= until:
                    return
                self.clock.advance_to(float(arrivals[k]))
                self.next_arrival += 1
                i = own[k]
                if self.gate.admit(i):
                    self._arrive(i)
                continue
            if due < t_next:  # an event at the deadline itself (a finish) goes first
                if due >= until:
                    return
                self.clock.advance_to(due)
                deadlines.expire(self)
                continue
            if self.shard is not None:  # a shard runs on: other shards may send it work
                self._note_idle()
                if not len(self.queue) or t_next >= until:
                    return
            else:
                idle = (
                    k >= n
                    and not self.gate.in_flight
                    and not any(x.busy for x in self.instances.values())
                )
                if not len(self.queue) or idle:
                    break  # nothing left, or only the planner's events
            at, kind, payload = self.queue.pop()
            self.clock.advance_to(at)
            self.run_info.events += 1
            handlers[kind](payload)

    # -- arrivals and routing ------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        now = self.clock.now()
        home_index = int(self.work.home[i])
        home = self.regions[home_index]
        n, out = int(self.work.prompt_len[i]), int(self.work.output_len[i])
        self.windows[home].arrived(now, n)
        rec = self.run_info.recorder
        refused, choice = refusal(n, out, self.max_model_len), None  # as the front door would
        if not refused:  # the prompt is built only then: a refused one may be any length
            params = SamplingParams(max_tokens=out, ignore_eos=True)
            inp = CompletionInput(f"r{i}", self.work.prompt(i), params, home)
            try:  # every region at its limit, or none can serve
                choice = self.chooser.choose(
                    inp, hashes=None if self._no_hashes is None else dict(self._no_hashes)
                )
            except OverloadedError:
                refused = 1
        if choice is None:
            rec.region[i] = home_index
            rec.fail(i, refused, now)
            return
        region = choice.region
        self.retries.on_request()
        # each request's overhead drawn apart from the others' (no correlation)
        overhead = self.options.request_overhead_s * self.request_noise.factor(math.inf)
        lat = self.config.router.latency(home, region) + overhead
        if self.local is not None and region not in self.local:
            picked = None if choice.prefill is None else choice.prefill.instance_id
            # its region's shard launches it on the instances picked here
            self.exports.append(Handoff(i, region, now + lat, picked, choice.decode.instance_id))
            return
        rec.region[i] = self.regions.index(region)
        self.deadlines.sent(i, now)
        self.inflight[region] += 1
        if lat > 0:  # the router waits out the emulated distance before it launches
            self.launching += 1
            self.queue.push(now + lat, "launch", (i, inp, choice))
        else:
            self._launch((i, inp, choice))

    def _launch_now(self, payload: tuple[int, CompletionInput, Choice]) -> None:
        self.launching -= 1
        self._launch(payload)

    def _launch(self, payload: tuple[int, CompletionInput, Choice]) -> None:
        i, inp, choice = payload
        rid, prompt, region = inp.request_id, inp.prompt_token_ids, choice.region
        if self.run_info.recorder.done[i]:  # it timed out on its way (sim/timeouts.py)
            return
        decode = self.instances.get(choice.decode.instance_id)
        if decode is None:  # removed while the request crossed to its region
            decode = self.instances[decode_order(self.view, region)[0]]
        now = self.clock.now()
        probe = Request(rid, prompt, inp.params, (), now)  # its block hashes are computed once
        hashes = choice.hashes.get(decode.kv.block_size)
        if hashes and decode.kv.pool.enable_caching:
            probe.block_hashes = list(hashes)  # the router hashed the prompt already
        prefill = None if choice.prefill is None else self.instances.get(choice.prefill.instance_id)
        if prefill is None or prefills_locally(self.config, decode, probe):
            self.interrupt(decode)
            decode.scheduler.add_request(probe)
            self.tracks[rid] = _Track(i, region, decode, None, len(prompt))
            self._placed(decode)
            self.kick(decode)
            return
        reserved = reserve(self.instances, self.view, self.retries, region, decode, probe)
        if reserved is None:
            self.inflight[region] -= 1
            self.run_info.recorder.fail(i, 2, now)
            return
        decode, cached = reserved
        self.interrupt(prefill)
        request = Request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), (), now)
        request.hold_kv_on_finish = True
        if prefill.kv.block_size == decode.kv.block_size:
            request.block_hashes = list(probe.block_hashes)
        prefill.scheduler.add_request(request)
        self.tracks[rid] = _Track(i, region, decode, prefill, len(prompt), cached)
        prefill.view.pending_prompt_tokens += len(prompt)
        self._placed(prefill)
        self._placed(decode)
        self.kick(prefill)

    def _placed(self, inst: SimInstance) -> None:
        inst.view.inflight += 1
        self.refresh(inst)

    # -- steps and hand-offs ------------------------------------------------------------

    def _on_step(self, payload: tuple[SimInstance, int]) -> None:
        inst, generation = payload
        if generation != inst.generation or not inst.busy:
            return  # a fast-mode run that was cut: its new end has its own event
        per_token = self.options.keep_itl
        done = inst.complete(per_token)
        rec = self.run_info.recorder
        tracks, tokens_at = self.tracks, rec.tokens_at
        end, ends, gaps = done.end, done.step_ends, done.step_gaps
        for rid, count in done.tokens.items():
            track = tracks[rid]
            if tokens_at(track.index, count, end, ends, gaps):
                self._first_token(track, end)
        for request in done.finished:
            track = self.tracks[request.request_id]
            if inst.role == "prefill" and track.prefill is inst:
                self._handoff_after(track, inst)
            else:
                if not per_token:  # only first tokens were counted
                    rec.tokens[track.index] = request.num_output_tokens
                self._finished(request.request_id, done.end, refresh=False)
        self.refresh(inst)  # the decode instance of every request that finished here
        if inst.draining and inst.idle:
            self.scaling.remove(inst)
            if self.options.host_cores:
                self._reshare()
        else:
            self._on_kick(inst)  # the step just ended: schedule the next one now

    def _first_token(self, track: _Track, at: float) -> None:
        self.admission.observe(track.region, at - float(self.run_info.recorder.sent[track.index]))
        if track.prefill is not None:
            track.prefill.view.pending_prompt_tokens -= track.prompt_len

    def _handoff_after(self, track: _Track, prefill: SimInstance) -> None:
        profile = self.profiles[prefill.instance_id]
        sent = max(0, track.prompt_len - track.cached_on_decode) * profile.kv_bytes_per_token
        delay = profile.transfer(self.config.connector).time(sent)
        if delay > MAX_SECONDS:  # a model out of range would run for ever
            raise InvalidArgumentError(
                "connectors",
                f"{prefill.instance_id}: the hand-off of {sent} bytes takes {delay:.3g} s, past "
                f"the {MAX_SECONDS:g} s a simulated one may take: check the transfer model of "
                "the profile of its layout",
            )
        self.queue.push(self.clock.now() + delay, "handoff", f"r{track.index}")

    def _on_handoff(self, rid: str) -> None:
        track = self.tracks.get(rid)
        if track is None:
            return  # it timed out while its pages moved (sim/timeouts.py)
        assert track.prefill is not None
        prefill, decode = track.prefill, track.decode
        prefill.scheduler.release(rid)
        prefill.view.inflight -= 1
        self.refresh(prefill)
        if prefill.draining and prefill.idle:
            self.scaling.remove(prefill)
        self.interrupt(decode)
        request = decode.scheduler.activate(rid, TOKEN)
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            decode.scheduler.finish(rid, RequestStatus.FINISHED_LENGTH)
            self._finished(rid, self.clock.now())
        self.kick(decode)

    def _finished(self, rid: str, at: float, refresh: bool = True) -> None:
        track = self.tracks.pop(rid)
        rec = self.run_info.recorder
        rec.finish(track.index, at)
        self.inflight[track.region] -= 1
        track.decode.view.inflight -= 1
        if refresh:
            self.refresh(track.decode)
        i = track.index
        ttft = float(rec.first[i] - rec.sent[i])
        n = int(rec.tokens[i])
        tpot = (at - float(rec.first[i])) / (n - 1) if n > 1 else None
        self.windows[track.region].add(at, ttft, tpot, n)

    # -- one shard of a fleet (sim/sharded.py) ---------------------------------------------

    def quiet(self) -> bool:
        """No arrival to come, none on its way, none in flight (a shard's own work)."""
        return self.next_arrival >= len(self.own) and not self.launching and not self.tracks

    def _note_idle(self) -> None:
        if not self.quiet():
            self.idle_at = None
        elif self.idle_at is None:
            self.idle_at = self.clock.now()

    def region_loads(self) -> list[RegionLoad]:
        """Its regions' load now, as other shards' routers read it (their instances'
        views only when they changed since the last report)."""
        assert self.shard is not None
        out = []
        for region in sorted(self.shard.regions):
            views = [x.view for x in self.instances.values() if x.region == region]
            ids = tuple(v.instance_id for v in views)
            changed = self._reported.get(region) != ids
            self._reported[region] = ids
            rows = load_rows(views)
            load = RegionLoad(self.shard.index, region, views if changed else None, rows, 0)
            load.inflight = self.inflight[region]
            out.append(load)
        return out

    def receive(self, report: ShardReport) -> None:
        """Another shard's report: its regions as the router sees them from now on
        (another group of a region it holds stays out of sight: its router chooses
        within its own group)."""
        for v in self.remote.receive(report):
            if v.role == "decode":
                self.max_model_len = min(self.max_model_len, v.max_model_len)

    def take_imports(self, imports: list[Handoff]) -> None:
        """Requests other shards' routers sent to its regions: each launches at its time."""
        rec = self.run_info.recorder
        for h in imports:
            self.launching += 1
            self.idle_at = None
            rec.region[h.index] = self.regions.index(h.region)
            self.deadlines.sent(h.index, float(self.work.arrival_s[h.index]))
            self.inflight[h.region] += 1
            self.queue.push(max(h.at, self.clock.now()), "import", h)

    def take_exports(self) -> list[Handoff]:
        out, self.exports = self.exports, []
        return out

    def _import(self, h: Handoff) -> None:
        """A request another shard's router sent here, launched on the instances it
        picked (a decode instance gone since: another of the region's, as ``_launch``
        does; a prefill instance gone: the decode instance prefills it)."""
        self.launching -= 1
        i, rec = h.index, self.run_info.recorder
        if rec.done[i]:  # it timed out on its way
            return
        home = self.regions[int(self.work.home[i])]
        params = SamplingParams(max_tokens=int(self.work.output_len[i]), ignore_eos=True)
        inp = CompletionInput(f"r{i}", self.work.prompt(i), params, home)
        hashes = {} if self._no_hashes is None else dict(self._no_hashes)
        decode = (
            self.instances.get(h.decode) or self.instances[decode_order(self.view, h.region)[0]]
        )
        prefill = None if h.prefill is None else self.instances.get(h.prefill)
        picked = Choice(h.region, None if prefill is None else prefill.view, decode.view, hashes)
        self._launch((i, inp, picked))
