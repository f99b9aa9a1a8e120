"""A decode instance that lost an expert-parallel rank re-pairs with its prefill instances.

After an elastic decode instance regrouped on its survivors
(:mod:`pdserve.parallel.elastic`), every survivor carries a new rank number and
the instance a smaller layout. Its leader, still inside the step that failed,
publishes both to every paired prefill instance: the survivors' endpoints
(each naming its new rank) and the new layout. Each prefill rank re-plans its
routes from them (:meth:`~pdserve.transfer.rank.RankTransfer.pair`), so no
page is sent to the lost rank any more, and hand-offs committed from then on
expect one arrival mark per route into each survivor.

Pages already in flight need nothing more: attention is replicated on these
layouts, so each survivor's copy of a request's pages is whole whatever the
lost rank got, and the re-pairing waits for every prefill rank, so the next
step's transfers already follow the new routes. A prefill instance that cannot
be reached keeps its old routes; a transfer that fails on them fails its
request on the prefill side as any failed transfer does.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from pdserve.core.layout import Layout
from pdserve.decode.server import DecodeServer

logger = logging.getLogger(__name__)


def republish(server: DecodeServer, layout: Layout, ranks: list[Any], timeout_s: float) -> None:
    """Give every paired prefill instance this instance's ``layout`` and the endpoints of
    ``ranks`` (the survivors' actors, in their new rank order); returns when all re-planned.

    Runs on the decode engine loop's thread (inside the step being recovered).
    """
    endpoints = ray.get([r.kv_endpoint.remote() for r in ranks], timeout=timeout_s)
    assert [e.rank for e in endpoints] == list(range(len(ranks))), "survivors not renumbered"
    server.layout = server.pulls.layout = layout
    prefills = dict(server.prefills)
    refs = {
        pid: leader.repair_decode.remote(server.instance_id, layout, endpoints)
        for pid, (leader, _) in prefills.items()
    }
    for pid, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception:
            logger.exception("prefill %s did not re-plan its routes to %s", pid, server.instance_id)
    logger.warning(
        "decode %s: %d prefill instance(s) now send to its %d surviving ranks",
        server.instance_id,
        len(refs),
        len(endpoints),
    )
