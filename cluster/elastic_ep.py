"""Elastic-EP instances as the controller sees them (``pdserve.parallel.elastic``).

An MoE instance that lost an expert-parallel follower rank and regrouped on the
survivors stays healthy: its leader answers health checks as before, so the
controller keeps it. What changes is the set of ranks serving: every read of
the instances' expert counters first asks each leader for its members, drops
the lost ranks from the instance's :class:`~pdserve.parallel.instance.RankGroup`
(so no later call waits on a dead actor) and reports the ranks lost
(``pdserve_ep_rank_failures_total``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:  # the rank side brings torch; the controller reads its statuses only
    from pdserve.cluster.instances import Instance
    from pdserve.parallel.elastic_status import ElasticStatus

logger = logging.getLogger(__name__)


def refresh_members(instances: list[Instance], timeout_s: float) -> dict[str, ElasticStatus]:
    """Instance id -> its elastic status, for the elastic instances that answered in time;
    each one's group keeps only the ranks serving."""
    refs: dict[str, Any] = {i.instance_id: i.leader.elastic_status.remote() for i in instances}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out: dict[str, ElasticStatus] = {}
    for instance in instances:
        ref = refs[instance.instance_id]
        if ref not in done:
            continue
        try:
            status = ray.get(ref, timeout=0)
        except Exception:  # the leader died: the health check deals with it
            continue
        if status is None:
            continue
        if len(status.members) != len(instance.group.workers):
            logger.warning(
                "%s serves on ranks %s after losing %d",
                instance.instance_id,
                list(status.members),
                len(instance.group.all_workers) - len(status.members),
            )
        instance.group.set_members(status.members)
        out[instance.instance_id] = status
    return out
