"""Several Ray nodes on this machine for a benchmark that crosses nodes.

:func:`local_nodes` starts a Ray cluster with ``ray.cluster_utils.Cluster`` (as
Ray's own tests do): a head holding ``head_cpus`` CPUs (and ``head_labels``) and one
more node per
entry of ``nodes`` (its CPUs and labels), each its own raylet and object store,
then connects this process to the head. Objects sent to an actor on another node
move between object stores as they would between machines (over loopback here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ray


@contextlib.contextmanager
def local_nodes(
    nodes: list[tuple[int, dict[str, str]]],
    head_cpus: int = 1,
    head_labels: dict[str, str] | None = None,
) -> Iterator[list[str]]:
    """The node id of each of ``nodes`` ((CPUs, labels) each), this process connected to
    the head; everything is shut down on leaving."""
    from ray.cluster_utils import Cluster

    head = {"num_cpus": head_cpus, "include_dashboard": False, "labels": head_labels or {}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        added = [cluster.add_node(num_cpus=cpus, labels=labels) for cpus, labels in nodes]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield [node.node_id for node in added]
    finally:
        ray.shutdown()
        cluster.shutdown()


__all__ = ["local_nodes"]
