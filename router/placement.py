"""Where a request goes: its region, and a prefill and decode instance there.

    choose(request)
      home    <- the request's region, else the config's first
      for each region with a decode instance, home first, then the nearest first:
        skip it if its round trip alone costs as much as the best so far, or it
             has no room under its admission limit
        placement <- the policy's prefill/decode pick there (prefix hits priced in);
                     under a LoRA adapter, among the instances holding it only
        cost      <- placement's estimated TTFT + the round trip to that region
      the cheapest region wins; ties stay home
    peer_prefix(request, choice)
      another prefill of the region holds more of the prompt on its device, and
      moving its pages costs less than computing them: the decode instance may
      take them from it (pdserve.decode.peer)

Reads the router's :class:`~pdserve.router.state.ClusterView` and prefix index;
changes nothing but its record of decision times.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from pdserve.core.errors import InvalidArgumentError, OverloadedError, PdserveError
from pdserve.core.messages import PeerPrefix
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CachedBlocks, Placement, RoutingPolicy, RoutingRequest
from pdserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.router.state import ClusterView, InstanceView, RegionTable

# Up to this many instances holding a prompt's first block, every holder's cached prefix
# is walked (a few microseconds each); past it rows are looked up as a policy reads them.
FEW_HOLDERS = 16


@dataclass(frozen=True)
class CompletionInput:
    """A validated request as the front doors hand it to the router.

    ``request_id`` is the client's name for it, only echoed back; the router
    names every request and attempt itself, so no client can reach another's.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    region: str | None = None
    model: str = ""  # the deployment key of the model version serving it (router.models)
    served_as: str = ""  # that version as clients see it: name@version


@dataclass(frozen=True)
class Choice:
    """A region and the instances the policy picked there.

    The instances are held as views, not rows of the region's tables: a table
    may change while the request waits (an instance lost or added), a view
    does not. ``hashes`` caches the prompt's block hashes per block size, so a
    retry in the same request scores without rehashing.
    """

    region: str
    prefill: InstanceView | None
    decode: InstanceView
    hashes: dict[int, list[bytes]]


class RegionUnservedError(OverloadedError):
    """No region can take the request, and its home region lacks a role it needs
    (``roles``: none is registered, e.g. it is scaled to zero): the router may hold
    the request while the controller starts one."""

    def __init__(self, message: str, region: str, roles: tuple[str, ...], model: str = "") -> None:
        super().__init__(message, retry_after_s=1.0)
        self.region = region
        self.roles = roles
        self.model = model


class AdapterUnavailableError(PdserveError):
    """A request names a LoRA adapter the cluster serves, but no available instance of a
    role it needs holds it now (being loaded, or its holders are down)."""

    grpc_code = "UNAVAILABLE"
    http_status = 503


class RegionChooser:
    def __init__(
        self,
        config: RouterConfig,
        cluster: ClusterView,
        prefixes: PrefixIndex,
        policy: RoutingPolicy,
        admission: Admission,
        region_inflight: dict[str, int],
    ) -> None:
        self.config = config
        self.cluster = cluster
        self.prefixes = prefixes
        self.policy = policy
        self.admission = admission
        self.region_inflight = region_inflight
        self.decision_s: deque[float] = deque(maxlen=4096)  # recent decision times
        self._orders: dict[str, list[str]] = {}  # per home region: the regions to try

    def choose(
        self,
        inp: CompletionInput,
        skip: frozenset[str] = frozenset(),
        hashes: dict[int, list[bytes]] | None = None,
    ) -> Choice:
        """The region to serve in (none of ``skip``), and the policy's placement there.
        ``hashes``: the prompt's block hashes per block size where the caller has them
        (the rest are computed here)."""
        start = time.perf_counter()
        try:
            return self._choose(inp, skip, {} if hashes is None else hashes)
        finally:
            self.decision_s.append(time.perf_counter() - start)

    def _order(self, home: str) -> list[str]:
        """The regions to try for requests of ``home``: home first, then the nearest first
        (equally near ones in config order)."""
        order = self._orders.get(home)
        if order is None:
            names = [r.name for r in self.config.regions]
            key = lambda g: (g != home, self.config.latency(home, g))  # noqa: E731
            order = self._orders[home] = sorted(names, key=key)
        return order

    def _choose(
        self, inp: CompletionInput, skip: frozenset[str], hashes: dict[int, list[bytes]]
    ) -> Choice:
        home = inp.region or self.config.home_region
        regions = [r.name for r in self.config.regions]
        if home not in regions:
            raise InvalidArgumentError("region", f"unknown region; known: {regions}")
        best: tuple[float, str, Placement] | None = None
        lora = inp.params.lora
        if lora is not None:
            self._check_holders(regions, inp.model, lora)
        serving = set(self._candidates(regions, inp.model, lora)) - skip
        candidates = [r for r in self._order(home) if r in serving]
        for region in candidates:
            distance = 2 * self.config.latency(home, region)
            if best is not None and distance >= best[0]:
                continue  # a placement's cost is at least its round trip: it cannot win
            inflight = self.region_inflight[region]
            if not self.admission.admit(region, inflight, inp.params.priority):
                continue
            placement = self.score(inp, region, hashes)
            cost = placement.est_ttft_s + distance
            if region == home:
                cost -= 1e-9  # ties stay home
            if best is None or cost < best[0]:
                best = (cost, region, placement)
        if best is None:
            why = "at its limit" if home in candidates else self._unserved(home, inp.model)
            if home in skip:
                why = "full: its decode instances have no room for the request now"
            elif inp.params.priority < 0 and home in candidates:
                why = "at its limit for requests of negative priority"
            message = f"no region can take the request now (home {home!r} is {why})"
            unserved = home not in candidates and home not in skip
            lacking = self._lacking(home, inp.model) if unserved else ()
            if lacking:
                raise RegionUnservedError(message, home, lacking, inp.model)
            raise OverloadedError(message, retry_after_s=1.0)
        return self._resolve(best[1], best[2], hashes, inp)

    def _check_holders(self, regions: list[str], model: str, lora: str) -> None:
        """Refuse a request under an adapter that no available instance of a role it needs
        holds, in any region (it would fail there); placement sends it only to holders."""
        needed = ("decode", "prefill") if self.config.without_prefill == "refuse" else ("decode",)
        for role in needed:
            if not any(len(self.cluster.table(role, r, model, lora)) for r in regions):
                holders = sorted(
                    v.instance_id
                    for v in self.cluster.instances.values()
                    if lora in v.adapters and v.model == model
                )
                raise AdapterUnavailableError(
                    f"no available {role} instance holds LoRA adapter {lora!r} now "
                    f"(held by: {holders or 'none'}); load it with /v1/load_lora_adapter"
                )

    def _lacking(self, region: str, model: str) -> tuple[str, ...]:
        """The roles ``region`` needs and has no available instance of."""
        needed = ("decode", "prefill") if self.config.without_prefill == "refuse" else ("decode",)
        return tuple(role for role in needed if not len(self.cluster.table(role, region, model)))

    def place(self, inp: CompletionInput, region: str, hashes: dict[int, list[bytes]]) -> Choice:
        """The policy's instances in ``region`` now (OverloadedError: it has no decode)."""
        return self._resolve(region, self.score(inp, region, hashes), hashes, inp)

    def _resolve(
        self,
        region: str,
        placement: Placement,
        hashes: dict[int, list[bytes]],
        inp: CompletionInput,
    ) -> Choice:
        model, lora = inp.model, inp.params.lora
        prefills = self.cluster.table("prefill", region, model, lora).views
        decode = self.cluster.table("decode", region, model, lora).views[placement.decode]
        prefill = prefills[placement.prefill] if placement.prefill is not None else None
        return Choice(region, prefill, decode, hashes)

    def _unserved(self, region: str, model: str) -> str:
        """Why ``region`` cannot take a request: which role it lacks, and whether it has
        instances of that role that are unhealthy (a stalled or dead engine) or draining."""
        for role in ("decode", "prefill"):
            if len(self.cluster.table(role, region, model)):
                continue
            views = [
                v
                for v in self.cluster.instances.values()
                if v.role == role and v.region == region and v.model == model
            ]
            if not views:
                return f"without a {role} instance"
            sick = sum(not v.healthy for v in views)
            return f"without an available {role} instance ({sick} unhealthy, {len(views) - sick} draining)"
        return "without a decode and prefill instance"

    def _candidates(self, regions: list[str], model: str, lora: str | None) -> list[str]:
        """Regions with a decode instance of ``model`` (holding ``lora``); per
        ``without_prefill``, also a prefill one."""
        serving = [r for r in regions if len(self.cluster.table("decode", r, model, lora))]
        if self.config.without_prefill == "local":
            return serving
        full = [r for r in serving if len(self.cluster.table("prefill", r, model, lora))]
        return full if full or self.config.without_prefill == "refuse" else serving

    def score(self, inp: CompletionInput, region: str, hashes: dict[int, list[bytes]]) -> Placement:
        """The policy's placement in ``region``, with each prefill's cached prefix priced in."""
        lora = inp.params.lora  # only instances holding the request's adapter
        prefills = self.cluster.table("prefill", region, inp.model, lora)
        decodes = self.cluster.table("decode", region, inp.model, lora)
        if not len(decodes):
            raise OverloadedError(
                f"region {region!r} has no decode instance available", retry_after_s=1.0
            )
        bs = decodes.block_tokens
        if bs not in hashes:
            fingerprint = self.cluster.adapter_fingerprints.get((inp.model, lora or ""), "")
            hashes[bs] = prompt_block_hashes(
                inp.prompt_token_ids, bs, lora, fingerprint, inp.params.cache_salt
            )
        cached = self._cached(prefills, hashes[bs])
        req = RoutingRequest(len(inp.prompt_token_ids), inp.params.max_tokens, cached, bs)
        return self.policy.place(req, prefills, decodes)

    def _cached(self, prefills: RegionTable, hashes: list[bytes]) -> CachedBlocks:
        """Each prefill row's cached prefix of the prompt: walked for every holder when
        few instances hold the prompt's first block, else looked up row by row as the
        policy reads them (a prompt every instance holds part of would cost a walk of
        every holder)."""
        if hashes and self.prefixes.holder_count(hashes[0]) > FEW_HOLDERS:
            held = hashes[: self.prefixes.held_depth(hashes)]
            views = prefills.views
            return CachedBlocks(
                len(held), lambda row: self.prefixes.cached_blocks(views[row].instance_id, held)
            )
        counts = np.zeros(len(prefills))
        for instance, blocks in self.prefixes.cached_prefixes(hashes).items():
            row = prefills.index.get(instance)
            if row is not None:
                counts[row] = blocks
        return CachedBlocks.of(counts)

    def peer_prefix(self, choice: Choice) -> PeerPrefix | None:
        """A prefill instance of the region holding, on its device, more of the prompt than
        the chosen one, when moving those pages costs less than computing them again."""
        chosen, decode = choice.prefill, choice.decode
        hashes = choice.hashes.get(decode.block_size)
        if not self.config.peer_prefill or chosen is None or not hashes:
            return None
        own = self.prefixes.cached_blocks(chosen.instance_id, hashes)
        best, blocks = None, own
        # Deepest block first: a holder of block k can offer at most k + 1 blocks, so the
        # search ends at the first level no deeper than the best found; each holder is
        # priced once (lower down it could offer no more than it did).
        seen: set[str] = set()
        for k in range(self.prefixes.held_depth(hashes) - 1, blocks - 1, -1):
            if k + 1 <= blocks:
                break
            for instance in self.prefixes.holders(hashes[k]) - seen:
                seen.add(instance)
                view = self.cluster.instances.get(instance)
                if view is None or view is chosen or not view.available:
                    continue
                if view.region != choice.region or view.model != decode.model:  # paired only
                    continue
                on_device = self.prefixes.device_blocks(instance, hashes[: k + 1])
                if on_device > blocks:
                    best, blocks = view, on_device
        gain = (blocks - own) * decode.block_size
        if best is None or gain < self.config.peer_prefill_min_tokens:
            return None
        move_s = blocks * decode.block_size * self.config.peer_kv_s_per_token
        if move_s >= gain * chosen.prefill_s_per_token:
            return None
        return PeerPrefix(best.instance_id, blocks)
