"""Start prefill and decode instances, and pair them for KV transfer.

Pairing is the compatibility handshake (:func:`~pdserve.transfer.handshake.check_compatible`)
followed by the plumbing: every prefill rank connects to the decode ranks its
routes reach, and each leader learns the other's actor handle.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.cluster.instance_actor import InstanceActor
from pdserve.cluster.instance_spec import InstanceSpec, Role
from pdserve.core.config import DisaggregationConfig, EngineConfig
from pdserve.core.model_config import ModelConfig
from pdserve.parallel.instance import RankGroup, RankResources, release
from pdserve.transfer.handshake import check_compatible


@dataclass
class Instance:
    """A started instance: its id, role and ranks (``group.leader`` serves requests)."""

    instance_id: str
    role: Role
    group: RankGroup

    @property
    def leader(self) -> Any:
        return self.group.leader

    def shutdown(self) -> None:
        """Stop gracefully: the engine, the followers, then the actors."""
        self.group.shutdown()

    def kill(self) -> None:
        """Stop at once (an unhealthy instance): kill every rank, free its placement group."""
        release(self.group.all_workers, self.group.placement_group)


def start_instance(
    role: Role,
    model: ModelConfig,
    engine: EngineConfig,
    connector: str = "auto",
    resources: RankResources | None = None,
    disaggregation: DisaggregationConfig | None = None,
    instance_id: str | None = None,
) -> Instance:
    instance_id = instance_id or f"{role}-{uuid.uuid4().hex[:6]}"
    spec = InstanceSpec(instance_id, role, connector, disaggregation or DisaggregationConfig())
    group = RankGroup.start(
        model, engine, resources, InstanceActor, (spec,), name=f"pdserve-{instance_id}"
    )
    return Instance(instance_id, role, group)


def pair(prefill: Instance, decode: Instance, timeout_s: float = 120.0) -> None:
    """Handshake, then connect every prefill rank to the decode ranks it sends to."""
    for instance in (prefill, decode):  # an elastic instance may have lost ranks since
        instance.group.refresh()
    p_spec, d_spec = ray.get(
        [prefill.leader.kv_spec.remote(), decode.leader.kv_spec.remote()], timeout=timeout_s
    )
    check_compatible(p_spec, d_spec)
    endpoints = ray.get([w.kv_endpoint.remote() for w in decode.group.workers], timeout=timeout_s)
    ray.get(
        [w.pair_ranks.remote(d_spec.layout, endpoints) for w in prefill.group.workers],
        timeout=timeout_s,
    )
    ray.get(
        [
            prefill.leader.register_decode.remote(decode.instance_id, decode.leader),
            decode.leader.register_prefill.remote(
                prefill.instance_id, prefill.leader, p_spec.layout
            ),
        ],
        timeout=timeout_s,
    )


def pair_peers(a: Instance, b: Instance, timeout_s: float = 120.0) -> None:
    """Two prefill instances: each may pull prompt prefixes from the other's cache."""
    for instance in (a, b):
        instance.group.refresh()
    a_spec, b_spec = ray.get(
        [a.leader.kv_spec.remote(), b.leader.kv_spec.remote()], timeout=timeout_s
    )
    check_compatible(a_spec, b_spec)
    a_ends, b_ends = (
        ray.get([w.kv_endpoint.remote() for w in i.group.workers], timeout=timeout_s)
        for i in (a, b)
    )
    ray.get(
        [w.pair_ranks.remote(b_spec.layout, b_ends) for w in a.group.workers]
        + [w.pair_ranks.remote(a_spec.layout, a_ends) for w in b.group.workers],
        timeout=timeout_s,
    )
    ray.get(
        [
            a.leader.register_peer.remote(b.instance_id, b.leader, b_spec.layout),
            b.leader.register_peer.remote(a.instance_id, a.leader, a_spec.layout),
        ],
        timeout=timeout_s,
    )


def pair_in_region(instance: Instance, prefills: list[Instance], decodes: list[Instance]) -> None:
    """Pair a new instance with the region's others: prefill->decode, and prefill peers."""
    if instance.role == "decode":
        for prefill in prefills:
            pair(prefill, instance)
        return
    for decode in decodes:
        pair(instance, decode)
    for peer in prefills:
        if peer is not instance:
            pair_peers(instance, peer)


CALL_TIMEOUT_S = 5.0  # best-effort control calls (stats, forget_peer)


def first_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def best_effort(refs: list[Any]) -> list[Any]:
    """Results of control calls, None for each that failed or took over CALL_TIMEOUT_S."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=CALL_TIMEOUT_S))
        except Exception:
            out.append(None)
    return out
