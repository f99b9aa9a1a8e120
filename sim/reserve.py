"""Where a simulated request's pages go on decode, as the live path decides it.

The decode server's rule keeps short and mostly cached prompts on the decode
instance; any other prompt reserves pages on a decode instance before it queues at
prefill: the router's choice first, then (within the retry budget) the region's
other decode instances by the router's estimated TPOT.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pdserve.cluster.config import ClusterConfig
from pdserve.core.request import Request
from pdserve.router.admission import RetryBudget
from pdserve.router.state import ClusterView
from pdserve.sim.instance import SimInstance


def prefills_locally(config: ClusterConfig, decode: SimInstance, probe: Request) -> bool:
    """The decode server's rule: short prompts, and mostly cached ones, stay local."""
    kv = decode.kv
    return config.disaggregation.prefills_locally(
        probe.num_tokens, lambda: len(kv.find_cached_prefix(probe)) * kv.block_size
    )


def decode_order(view: ClusterView, region: str) -> list[str]:
    """The region's decode instances, by the router's estimated TPOT."""
    table = view.table("decode", region)
    return [table.views[j].instance_id for j in np.argsort(table.decode_tpot())]


def reserve(
    instances: dict[str, SimInstance],
    view: ClusterView,
    retries: RetryBudget,
    region: str,
    first: SimInstance,
    probe: Request,
) -> tuple[SimInstance, int] | None:
    """Reserve pages for ``probe`` on ``first``, then (within the retry budget) on the
    fastest others: the instance and its cached tokens, or None."""
    for attempt, decode in enumerate(_order(instances, view, region, first)):
        if attempt and not retries.try_spend():
            return None
        # A reservation takes blocks but leaves the batch as it is: a run goes on.
        decode.hold_run_blocks()
        if decode.kv.block_size != first.kv.block_size:
            probe.block_hashes = []
        cached = decode.scheduler.reserve(probe)
        if cached is not None:  # the router's view of it is refreshed once placed
            return decode, cached
    return None


def _order(
    instances: dict[str, SimInstance], view: ClusterView, region: str, first: SimInstance
) -> Iterator[SimInstance]:
    """``first``, then the region's other decode instances by TPOT (sorted if needed)."""
    yield first
    yield from (instances[i] for i in decode_order(view, region) if i != first.instance_id)
