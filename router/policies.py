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
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from pdserve.router.state import RegionTable


class CachedBlocks:
    """The prompt's leading blocks each prefill row of a region holds: known for every
    row up front (``counts``: when few instances hold the prompt, walking them is
    cheap), or looked up when a policy reads the row (when many do: a policy then
    reads the rows it considers, not every holder). ``depth`` bounds every row's count
    (the blocks some instance holds)."""

    def __init__(self, depth: int, lookup: Callable[[int], int]) -> None:
        self.depth = depth
        self.counts: np.ndarray | None = None
        self._lookup = lookup
        self._rows: dict[int, int] = {}

    @classmethod
    def of(cls, counts: Sequence[int] | np.ndarray) -> CachedBlocks:
        """Counts known up front, one per row."""
        known = np.asarray(counts, dtype=np.float64)
        cached = cls(int(known.max(initial=0)), lambda row: int(known[row]))
        cached.counts = known
        return cached

    def __getitem__(self, row: int) -> int:
        n = self._rows.get(row)
        if n is None:
            n = self._rows[row] = self._lookup(row)
        return n


@dataclass(frozen=True)
class RoutingRequest:
    prompt_len: int
    max_tokens: int
    cached_blocks: CachedBlocks  # per prefill row of the region: leading blocks cached there
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
        req: RoutingRequest,
        prefills: RegionTable,
        decodes: RegionTable,
        p: int | None,
        d: int,
        tpot: np.ndarray | None = None,  # decodes.decode_tpot(), where the caller has it
    ) -> Placement:
        cached = 0 if p is None else req.cached_blocks[p] * req.block_size
        if p is None:
            ttft = float((decodes.queued[d] + req.prompt_len) * decodes.per_token[d])
        else:
            ttft = float((prefills.queued[p] + req.prompt_len - cached) * prefills.per_token[p])
        tpots = decodes.decode_tpot() if tpot is None else tpot
        return Placement(p, d, ttft, float(tpots[d]), cached)


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
        p = self.fastest_prefill(req, prefills) if len(prefills) else None
        need = (req.prompt_len + req.max_tokens) / max(decodes.block_tokens, 1)
        tpot = decodes.decode_tpot()
        ranked = np.where(decodes.free_blocks >= need, tpot, tpot + 1e6)  # no room: last resort
        return self.estimate(req, prefills, decodes, p, int(np.argmin(ranked)), tpot)

    @staticmethod
    def fastest_prefill(req: RoutingRequest, prefills: RegionTable) -> int:
        """The row of least estimated time to first token: queued tokens plus the prompt,
        less what the row has cached, times its seconds per token (the lowest row of
        equal ones). Counts known up front price every row at once; counts looked up
        are read in the order of each row's lowest possible price (every block some
        instance holds cached there), and the search stops at a row whose lowest
        price is no better than the best found, so its cost follows the few rows that
        can win, not the number of instances that hold the prompt."""
        bs, cached = req.block_size, req.cached_blocks
        base = prefills.queued + req.prompt_len
        per_token = prefills.per_token
        if cached.counts is not None:  # every row's count known: price them all at once
            return int(np.argmin((base - cached.counts * bs) * per_token))
        floor = (base - cached.depth * bs) * per_token  # no row costs less
        best, best_cost = -1, math.inf

        def cost(row: int) -> float:
            return float((base[row] - cached[row] * bs) * per_token[row])

        for row in by_floor(floor):
            if floor[row] >= best_cost:
                break
            c = cost(row)
            if c < best_cost or (c == best_cost and row < best):
                best, best_cost = row, c
        if best < 0:  # prices that are not numbers: the first row
            return 0
        # an unpriced row can at most tie the best, and wins a tie with a lower row
        for row in np.flatnonzero(floor[:best] == best_cost).tolist():
            if cost(row) == best_cost:
                return row
        return best


FIRST_ROWS = 8  # rows ordered before the rest: the search mostly ends among them


def by_floor(floor: np.ndarray) -> Iterator[int]:
    """Rows in ascending order of ``floor``: the :data:`FIRST_ROWS` lowest sorted first
    (a partition and a sort of eight), the rest sorted only if the search reaches them."""
    if len(floor) <= FIRST_ROWS:
        yield from np.argsort(floor, kind="stable").tolist()
        return
    parted = np.argpartition(floor, FIRST_ROWS)  # the first FIRST_ROWS lowest, unordered
    for part in (parted[:FIRST_ROWS], parted[FIRST_ROWS:]):
        yield from part[np.argsort(floor[part], kind="stable")].tolist()


POLICIES: dict[str, type[RoutingPolicy]] = {c.name: c for c in (RoundRobin, LeastLoaded, CostModel)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        from pdserve.core.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "policy", f"unknown routing policy {name!r}; known: {sorted(POLICIES)}"
        )
    return POLICIES[name]()
