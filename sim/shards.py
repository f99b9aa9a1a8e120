"""A fleet cut into shards (``pdserve sim --workers N``): which instances and arrivals
each shard simulates, and the other shards' regions as a shard's router sees them.

A shard holds cells. A cell is a whole region or, where the workers outnumber the
regions, one of a region's instance groups (a region gets groups in proportion to
its instances, each with prefill and decode instances of its own). Every arrival
belongs to the cell of its home region: to one of its groups by a low-discrepancy
draw weighted by the groups' sizes, so each group sees the region's arrival
process thinned in proportion. The router's instance choice for a request of a
split region is made within its group; instances keep the names the one-process
run gives them, so their noise draws are the same.

Shards advance together in windows of virtual time (:class:`ShardSpec.window_s`, the
shortest latency between regions of different shards: an arrival routed to another
shard's region launches there a latency later, so it is handed over before it
launches, at the same virtual time as in one process). At each window's end a shard reports its regions'
load (:class:`RegionLoad`) and the requests its router sent to other shards'
regions; during the next window its router scores another shard's region from
that region's last report (:class:`RemoteLoads`, applied when first scored).
"""

from __future__ import annotations

import math
import pickle
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from pdserve.cluster.config import ClusterConfig
from pdserve.core.messages import LoadReport
from pdserve.router.placement import CompletionInput, RegionChooser
from pdserve.router.policies import Placement
from pdserve.router.state import ClusterView, InstanceView
from pdserve.sim.workload import SimWorkload

GOLDEN = 0.6180339887498949  # the low-discrepancy step that spreads arrivals over groups
ROLES = ("prefill", "decode")
# Regions of different shards with no latency between them: a request routed from one
# to the other waits for the next window of this length (the one-process run has no wait).
ZERO_LATENCY_WINDOW_S = 0.005


@dataclass(frozen=True)
class Cell:
    """A region, or one of its ``groups`` instance groups, and its instances' names."""

    region: str
    group: int
    groups: int
    instance_ids: frozenset[str]


@dataclass(frozen=True)
class ShardSpec:
    """One shard: its cells, its arrivals (workload indices, in time order), and the
    length of the virtual-time windows the shards advance in."""

    index: int
    cells: tuple[Cell, ...]
    arrivals: np.ndarray  # [n] int64
    window_s: float

    @property
    def regions(self) -> frozenset[str]:
        return frozenset(c.region for c in self.cells)

    @property
    def instance_ids(self) -> frozenset[str]:
        return frozenset().union(*(c.instance_ids for c in self.cells))

    def suffix(self, region: str) -> str:
        """What names this shard's added instances of ``region`` apart from other groups'."""
        cell = next(c for c in self.cells if c.region == region)
        return f"-g{cell.group}" if cell.groups > 1 else ""


@dataclass(frozen=True)
class Handoff:
    """A request a shard's router sent to another shard's region: launched there at
    ``at`` on the instances it picked (``prefill`` None: the decode instance prefills)."""

    index: int
    region: str
    at: float
    prefill: str | None
    decode: str


@dataclass
class RegionLoad:
    """One shard's report of one of its regions (or region groups) at a window's end:
    its instances' views when they changed (joined, left), then per instance, in their
    order, its load report's numbers and the router's own counts; and the region's
    requests in flight."""

    source: int  # the shard
    region: str
    views: list[InstanceView] | None
    rows: list[tuple[float, ...] | None]  # None: the instance has not reported yet
    inflight: int


def instance_names(config: ClusterConfig) -> dict[tuple[str, str], list[str]]:
    """Per (region, role) the names of its instances as the one-process run numbers them."""
    names: dict[tuple[str, str], list[str]] = {}
    serial = 0
    for g in config.regions:
        for role in ROLES:
            names[(g.name, role)] = []
            for _ in range(g.role(role).count):
                serial += 1
                names[(g.name, role)].append(f"{g.name}-{role}-{serial}")
    return names


def region_groups(config: ClusterConfig, workers: int) -> dict[str, int]:
    """Instance groups per region: one each while the workers are at most the regions;
    else the workers shared in proportion to the regions' instances (largest remainder),
    no group without an instance of each role."""
    sizes = {g.name: g.prefill.count + g.decode.count for g in config.regions}
    cap = {g.name: max(1, min(g.prefill.count, g.decode.count)) for g in config.regions}
    if workers <= len(sizes):
        return dict.fromkeys(sizes, 1)
    total = sum(sizes.values()) or 1
    share = {r: workers * s / total for r, s in sizes.items()}
    groups = {r: max(1, min(cap[r], int(share[r]))) for r in sizes}
    for r in sorted(sizes, key=lambda r: share[r] - int(share[r]), reverse=True):
        if sum(groups.values()) >= workers:
            break
        groups[r] = min(cap[r], groups[r] + 1)
    return groups


def group_of(position: np.ndarray, groups: int, weights: np.ndarray) -> np.ndarray:
    """The group of each arrival of a region, by its ``position`` among them: a
    low-discrepancy draw weighted by the groups' sizes."""
    if groups == 1:
        return np.zeros(len(position), dtype=np.int64)
    bounds = np.cumsum(weights)[:-1] / weights.sum()
    return np.searchsorted(bounds, np.modf((position + 1) * GOLDEN)[0], side="right")


def _cells(config: ClusterConfig, workers: int) -> list[Cell]:
    names, groups = instance_names(config), region_groups(config, workers)
    cells = []
    for g in config.regions:
        k = groups[g.name]
        parts = [np.array_split(np.array(names[(g.name, r)], dtype=object), k) for r in ROLES]
        for j in range(k):
            ids = frozenset(str(x) for p in parts for x in p[j])
            cells.append(Cell(g.name, j, k, ids))
    return cells


def cell_arrivals(config: ClusterConfig, work: SimWorkload, cells: list[Cell]) -> list[np.ndarray]:
    """Each cell's arrivals: its region's (by home), split over the region's groups."""
    out: list[np.ndarray] = []
    regions = [g.name for g in config.regions]
    for region in dict.fromkeys(c.region for c in cells):
        mine = [c for c in cells if c.region == region]
        idx = np.flatnonzero(work.home == regions.index(region))
        weights = np.array([len(c.instance_ids) for c in mine], dtype=np.float64)
        which = group_of(np.arange(len(idx)), len(mine), weights)
        out.extend(idx[which == j] for j in range(len(mine)))
    return out


def window_s(config: ClusterConfig, shard_of: dict[str, set[int]]) -> float:
    """The shortest latency between two regions of which one has instances outside the
    other's shard (inf where no request can cross shards; ``ZERO_LATENCY_WINDOW_S``
    where such regions are no distance apart)."""
    r = config.router
    best = math.inf
    for a, sa in shard_of.items():
        for b, sb in shard_of.items():
            if a != b and not (sa == sb and len(sa) == 1):
                best = min(best, r.latency(a, b))
    return best if best > 0 else ZERO_LATENCY_WINDOW_S


def plan_shards(config: ClusterConfig, work: SimWorkload, workers: int) -> list[ShardSpec]:
    """The fleet's cells over ``workers`` shards (most arrivals first, each to the shard
    with the fewest arrivals so far); shards without a cell are left out."""
    cells = _cells(config, workers)
    arrivals = cell_arrivals(config, work, cells)
    load = [0] * workers
    held: list[list[int]] = [[] for _ in range(workers)]
    for c in sorted(range(len(cells)), key=lambda c: (-len(arrivals[c]), c)):
        s = min(range(workers), key=lambda s: (load[s], s))
        held[s].append(c)
        load[s] += len(arrivals[c])
    shard_of: dict[str, set[int]] = defaultdict(set)
    for s, cs in enumerate(held):
        for c in cs:
            shard_of[cells[c].region].add(s)
    window = window_s(config, shard_of)
    specs: list[ShardSpec] = []
    for cs in (h for h in held if h):
        mine = sorted(cs)
        idx = np.sort(np.concatenate([arrivals[c] for c in mine]), kind="stable")
        specs.append(ShardSpec(len(specs), tuple(cells[c] for c in mine), idx, window))
    return specs


@dataclass(frozen=True)
class ShardReport:
    """A shard's loads at a window's end as the coordinator passes them on: each
    region's requests in flight, whether its instances changed, and the
    :class:`RegionLoad` list pickled (a receiver unpickles it only when its router
    scores one of those regions, or at once when instances changed)."""

    source: int
    inflight: dict[str, int]
    changed: bool
    blob: bytes

    @staticmethod
    def of(source: int, loads: list[RegionLoad]) -> ShardReport:
        changed = any(x.views is not None for x in loads)
        inflight = {x.region: x.inflight for x in loads}
        return ShardReport(source, inflight, changed, pickle.dumps(loads))


class RemoteLoads:
    """Other shards' regions in a shard's router view (never a group of one of its own
    regions, ``mine``): their instances' views, kept as their last
    :class:`RegionLoad` left them; a region's load numbers are applied when the router
    first scores it after a report (most windows, it never does)."""

    def __init__(self, view: ClusterView, inflight: dict[str, int], mine: frozenset[str]) -> None:
        self.view, self.inflight, self.mine = view, inflight, mine
        self.members: dict[tuple[int, str], list[InstanceView]] = {}
        self.latest: dict[tuple[int, str], RegionLoad] = {}
        self.counts: dict[tuple[int, str], int] = {}  # requests in flight per shard and region
        self.unread: dict[int, bytes] = {}  # per shard: its last report, not unpickled yet
        self.stale: set[str] = set()

    def receive(self, report: ShardReport) -> list[InstanceView]:
        """Take a shard's report; the views that joined the router's view."""
        regions = [r for r in report.inflight if r not in self.mine]
        for region in regions:
            self.counts[(report.source, region)] = report.inflight[region]
            self.inflight[region] = sum(n for (_, r), n in self.counts.items() if r == region)
        self.stale.update(regions)
        self.unread[report.source] = report.blob
        return self._unpickle(report.source) if report.changed else []

    def _unpickle(self, source: int) -> list[InstanceView]:
        blob = self.unread.pop(source, None)
        joined: list[InstanceView] = []
        for load in [] if blob is None else pickle.loads(blob):
            if load.region in self.mine:
                continue
            key = (load.source, load.region)
            if load.views is not None:
                for v in self.members.get(key, []):
                    self.view.remove(v.instance_id)
                for v in load.views:
                    self.view.add(v)
                self.members[key] = load.views
                joined.extend(load.views)
            self.latest[key] = load
        return joined

    def bring(self, region: str) -> None:
        """Apply ``region``'s last reported load numbers to its views."""
        if region not in self.stale:
            return
        self.stale.discard(region)
        for source, r in list(self.counts):
            if r == region:
                self._unpickle(source)
        for key, load in self.latest.items():
            if key[1] == region:
                self._apply(self.members[key], load.rows)

    def _apply(self, views: list[InstanceView], rows: list[tuple[float, ...] | None]) -> None:
        for v, row in zip(views, rows, strict=True):
            if row is None:
                v.report = None
                self.view.touch(v)
                continue
            w, run, wpt, free, num, step_s, step_tok, inflight, pending, draining = row
            n = (int(w), int(run), int(wpt), int(free), int(num))
            v.report = LoadReport(v.instance_id, v.role, *n, step_s, step_tok)
            v.inflight, v.pending_prompt_tokens = int(inflight), int(pending)
            v.draining = bool(draining)
            self.view.touch(v)


def load_rows(views: list[InstanceView]) -> list[tuple[float, ...] | None]:
    """Each view's load numbers, in the order :meth:`RemoteLoads.bring` reads them."""
    rows: list[tuple[float, ...] | None] = []
    for v in views:
        r = v.report
        if r is None:
            rows.append(None)
            continue
        rows.append(
            (
                r.waiting,
                r.running,
                r.waiting_prompt_tokens,
                r.free_blocks,
                r.num_blocks,
                r.step_seconds,
                r.step_tokens,
                v.inflight,
                v.pending_prompt_tokens,
                v.draining,
            )
        )
    return rows


class ShardChooser(RegionChooser):
    """The router's chooser in a shard: another shard's region is brought up to its last
    report before it is scored."""

    remote: RemoteLoads

    def score(self, inp: CompletionInput, region: str, hashes: dict[int, list[bytes]]) -> Placement:
        self.remote.bring(region)
        return super().score(inp, region, hashes)
