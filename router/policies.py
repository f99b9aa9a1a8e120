"""Routing policies: which prefill and decode instance of a region serve a request.

Each policy is a small class chosen by name from :data:`POLICIES`. ``place`` is
called once per request on the router's event loop; it must not block or
perform I/O, and it only reads the :class:`~pdserve.router.state.RegionTable`
it is given (and its own cursor, for round-robin).

- ``round_robin``: the baseline: take turns, blind to load and caches;
- ``least_loaded``: fewest queued prompt tokens / requests in flight;
- ``cost_model`` (default): estimated TTFT at each prefill instance (its
  queued prompt tokens plus this prompt, minus what its prefix cache already
  holds, times its recent seconds per token) and estimated TPOT at each decode
  instance (recent step time, grown by its in-flight requests); among decode
  instances with room, the fastest.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from pdserve.router.state import RegionTable


@dataclass(frozen=True)
class RoutingRequest:
    prompt_len: int
    max_tokens: int
    cached_blocks: np.ndarray  # per prefill instance of the region: leading blocks cached there
    block_size: int


@dataclass(frozen=True)
class Placement:
    prefill: int | None  # row in the region's prefill table (None: no prefill instance)
    decode: int  # row in the region's decode table
    est_ttft_s: float
    est_tpot_s: float
    cached_tokens: int


class RoutingPolicy(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def place(self, req: RoutingRequest, prefills: RegionTable, decodes: RegionTable) -> Placement:
        """Pick one row of each table (decodes is never empty; prefills may be)."""

    @staticmethod
    def estimate(
        req: RoutingRequest, prefills: RegionTable, decodes: RegionTable, p: int | None, d: int
    ) -> Placement:
        cached = 0 if p is None else int(req.cached_blocks[p]) * req.block_size
        if p is None:
            ttft = float((decodes.queued[d] + req.prompt_len) * decodes.per_token[d])
        else:
            ttft = float((prefills.queued[p] + req.prompt_len - cached) * prefills.per_token[p])
        tpot = float(decodes.decode_tpot()[d])
        return Placement(p, d, ttft, tpot, cached)


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def place(self, req: RoutingRequest, prefills: RegionTable, decodes: RegionTable) -> Placement:
        n = next(self._turn)
        p = n % len(prefills) if len(prefills) else None
        return self.estimate(req, prefills, decodes, p, n % len(decodes))


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def place(self, req: RoutingRequest, prefills: RegionTable, decodes: RegionTable) -> Placement:
        p = int(np.argmin(prefills.queued)) if len(prefills) else None
        d = int(np.argmin(decodes.inflight))
        return self.estimate(req, prefills, decodes, p, d)


class CostModel(RoutingPolicy):
    name = "cost_model"

    def place(self, req: RoutingRequest, prefills: RegionTable, decodes: RegionTable) -> Placement:
        p = None
        if len(prefills):
            work = prefills.queued + req.prompt_len - req.cached_blocks * req.block_size
            p = int(np.argmin(work * prefills.per_token))
        need = (req.prompt_len + req.max_tokens) / max(decodes.block_tokens, 1)
        tpot = decodes.decode_tpot()
        tpot = np.where(decodes.free_blocks >= need, tpot, tpot + 1e6)  # no room: last resort
        return self.estimate(req, prefills, decodes, p, int(np.argmin(tpot)))


POLICIES: dict[str, type[RoutingPolicy]] = {c.name: c for c in (RoundRobin, LeastLoaded, CostModel)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        from pdserve.core.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "policy", f"unknown routing policy {name!r}; known: {sorted(POLICIES)}"
        )
    return POLICIES[name]()
