"""The Ray actor class of an instance's ranks, light to import.

Ray loads an actor's class in every process that unpickles a handle to it. The router
and the controller hold handles to the ranks, so with the rank's own class each
imported the rank's code, torch and the model with it, only to hold handles: ~1.3
CPU-s and ~200 MiB a process. :class:`InstanceActor` is the class Ray sees instead. Its
``__init__`` builds the rank's :class:`~pdserve.cluster.worker.InstanceWorker` in the
actor's own process, and each of its methods, listed in :data:`CALLS` with the
concurrency group it runs on, calls the worker's method of that name.
``tests/cluster/test_instance_actor.py`` checks the list against the worker's methods,
and that importing this module imports no torch.

Code that runs inside a rank through ``__ray_call__`` gets this actor: the rank's
worker is its ``worker``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from pdserve.cluster.instance_spec import InstanceSpec
from pdserve.parallel.calls import CONTROL, HEALTH
from pdserve.parallel.rank_spec import RankSpec

# Every public method of InstanceWorker and the concurrency group it runs on (None:
# the data path, Ray's default group).
CALLS: dict[str, str | None] = {
    "abort": None,
    "adapter_fingerprints": None,
    "allocate_kv": None,
    "attach_peers": None,
    "cancel": None,
    "check_idle": CONTROL,
    "comm_stats": None,
    "commit": None,
    "decode_server": None,
    "drop": CONTROL,
    "elastic_status": None,
    "expert_load": None,
    "expert_placement": None,
    "expert_rows": None,
    "export": CONTROL,
    "flip_role": None,
    "forget_peer": None,
    "generate": None,
    "health": HEALTH,
    "join": None,
    "kv_accept": None,
    "kv_endpoint": None,
    "kv_spec": None,
    "load_lora_adapter": CONTROL,
    "lora_fingerprints": None,
    "on_recovered": None,
    "on_regrouped": None,
    "pair_ranks": None,
    "ping": HEALTH,
    "prefill": None,
    "prefill_server": None,
    "rebalance_experts": None,
    "receive_pages": None,
    "register_decode": None,
    "register_peer": None,
    "register_prefill": None,
    "regroup": None,
    "rendezvous": None,
    "repair_decode": None,
    "reserve": None,
    "role": CONTROL,
    "serving_peers": None,
    "shutdown": None,
    "start_engine": None,
    "stats": CONTROL,
    "step_times": None,
    "step_trace": CONTROL,
    "submit": None,
    "subscribe_router": None,
    "time_plans": None,
    "transfer_stats": None,
    "transfers_across_nodes": None,
    "unload_lora_adapter": CONTROL,
    "unpair_ranks": None,
    "wait": None,
    "wait_idle": None,
}


class InstanceActor:
    """One rank of a prefill or decode instance, as Ray sees it (see the module's text)."""

    def __init__(self, spec: RankSpec, instance: InstanceSpec) -> None:
        from pdserve.cluster.worker import InstanceWorker  # the rank's code: torch, the model

        self.worker = InstanceWorker(spec, instance)


def _forward(name: str, group: str | None) -> Callable[..., Any]:
    def call(self: InstanceActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, name)(*args, **kwargs)

    call.__name__ = name
    call.__qualname__ = f"InstanceActor.{name}"
    return call if group is None else ray.method(concurrency_group=group)(call)


for _name, _group in CALLS.items():
    setattr(InstanceActor, _name, _forward(_name, _group))
