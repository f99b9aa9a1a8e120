"""The Ray actor of one rank of a serving instance (prefill or decode role).

Every rank carries its share of the KV transfer layer (a
:class:`~pdserve.transfer.rank.RankTransfer`: a receiver whose endpoint
senders connect to, a sender with routes to paired decode ranks). The leader
(rank 0) also runs the role server: :class:`~pdserve.prefill.server.PrefillServer`
or :class:`~pdserve.decode.server.DecodeServer`, and serves that role's calls
(:mod:`pdserve.prefill.actor`, :mod:`pdserve.decode.actor`: an instance that
flips role keeps its actors, so one actor class carries both roles' calls and
each fails naming the role it needs). This module keeps what every rank does
(the transfer plumbing), the calls of either role (health, stats, drain), and
the role flip, which swaps the server and the engine's
:class:`~pdserve.engine.role.RolePolicy` together.

Calls reach a rank on three Ray concurrency groups (named in
:mod:`pdserve.parallel.calls`, declared by :mod:`pdserve.parallel.instance`; Ray sees
each call on :class:`~pdserve.cluster.instance_actor.InstanceActor`, which forwards it
here): the default group serves the data path
(``prefill`` holds a thread until the first token, ``wait`` until a request
ends); ``control`` serves short calls that go through the engine loop
(``stats``, ``drop``, ``check_idle``); ``health`` serves ``ping`` and
``health``, which never touch the loop, so a full data path or a stuck loop
never delays the controller's health check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import ray

from pdserve.cluster.instance_spec import InstanceSpec, InstanceStats, Role
from pdserve.core.errors import InstanceFailedError
from pdserve.core.layout import Layout
from pdserve.core.logs import setup_logging
from pdserve.core.messages import (
    LoadReport,
    StepRecord,
)
from pdserve.decode.actor import DecodeSurface
from pdserve.decode.elastic import republish
from pdserve.decode.server import DecodeServer
from pdserve.engine.role import COLOCATED
from pdserve.parallel.calls import CONTROL, HEALTH
from pdserve.parallel.model_runner import resolve_device
from pdserve.parallel.rank_spec import EngineInfo, RankSpec
from pdserve.parallel.worker import RankWorker
from pdserve.prefill.actor import PrefillSurface
from pdserve.prefill.server import PrefillServer
from pdserve.transfer import across_nodes, resolve_connector
from pdserve.transfer.handshake import KVSpec, PeerEndpoint, adapter_fingerprints, model_fingerprint
from pdserve.transfer.pairs import PairReceiver
from pdserve.transfer.rank import RankTransfer
from pdserve.transfer.wire import dtype_name


class InstanceWorker(RankWorker, PrefillSurface, DecodeSurface):
    def __init__(self, spec: RankSpec, instance: InstanceSpec) -> None:
        super().__init__(spec)
        setup_logging()
        self.instance = instance
        self.transfer = RankTransfer(
            instance.instance_id,
            spec.rank,
            spec.layout,
            spec.model.num_kv_heads,
            resolve_connector(instance.connector, resolve_device(spec.engine.device).type),
            across_nodes=across_nodes(instance.connector),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        self.step_hooks = self.transfer
        # Both roles receive pages (decode: prompts; prefill: a peer's prefix), so
        # the cache lives where the connector's receiver wants it.
        self.kv_allocator = self.transfer.receiver.allocate
        self.server: PrefillServer | DecodeServer | None = None

    # -- start-up ---------------------------------------------------------------------

    def allocate_kv(self, num_blocks: int) -> None:
        super().allocate_kv(num_blocks)
        assert self.runner is not None
        self.transfer.kv_cache = self.runner.kv_cache
        if self.transfer.receiver.kv_cache is None:
            self.transfer.receiver.kv_cache = self.runner.kv_cache

    def start_engine(self) -> EngineInfo:
        info = super().start_engine()
        self._start_server()
        return info

    # -- elastic EP (pdserve.parallel.elastic) ---------------------------------------------

    def on_regrouped(self) -> None:
        assert self.groups is not None
        self.transfer.renumber(self.groups.rank, self.groups.layout)

    def on_recovered(self, ranks: list[Any]) -> None:
        """Decode leader: the survivors' layout and endpoints to the paired prefill instances."""
        if isinstance(self.server, DecodeServer):
            republish(self.server, self.transfer.layout, ranks, self.spec.collective_timeout_s)

    def _start_server(self) -> None:
        assert self.engine is not None
        if self.instance.role == "prefill":
            self.server = PrefillServer(
                self.instance.instance_id,
                self.engine,
                self.spec.layout,
                self.transfer.receiver.needs_arrival_marks,
            )
        else:
            self.server = DecodeServer(
                self.instance.instance_id,
                self.engine,
                self.spec.layout,
                self.transfer.receiver.needs_arrival_marks,
                self.instance.disaggregation,
            )

    # -- transfer plumbing (every rank) --------------------------------------------------

    def kv_spec(self) -> KVSpec:
        assert self.runner is not None
        m = self.spec.model
        return KVSpec(
            self.instance.instance_id,
            model_fingerprint(m.path),
            m.path,
            dtype_name(self.runner.dtype),
            self.spec.engine.cache.block_size,
            m.num_layers,
            m.num_kv_heads,
            m.head_dim,
            self.transfer.layout,  # the survivors' after an elastic regroup
            self.spec.engine.quantization,
            self.lora_fingerprints(),
        )

    def lora_fingerprints(self) -> tuple[tuple[str, str], ...]:
        """Leader: (name, content fingerprint) of each LoRA adapter the engine holds now."""
        if self.engine is None:
            return adapter_fingerprints(self.spec.engine.lora_adapters)
        return self.engine.adapters.fingerprints()

    @ray.method(concurrency_group=CONTROL)
    def load_lora_adapter(self, name: str, folder: str) -> tuple[str, str]:  # type: ignore[override]
        """Leader: serve a LoRA adapter on every rank, between two steps of the engine loop."""
        assert self.server is not None
        served = self.server.loop.call(lambda e: e.load_adapter(name, folder)).result()
        return served.name, served.fingerprint

    @ray.method(concurrency_group=CONTROL)
    def unload_lora_adapter(self, name: str) -> None:  # type: ignore[override]
        """Leader: stop serving an adapter (refused while requests use it)."""
        assert self.server is not None
        self.server.loop.call(lambda e: e.unload_adapter(name)).result()

    def kv_endpoint(self) -> PeerEndpoint:
        context = ray.get_runtime_context()
        return self.transfer.endpoint(context.current_actor, context.get_node_id())

    def pair_ranks(self, decode_layout: Layout, endpoints: list[PeerEndpoint]) -> None:
        self.transfer.pair(decode_layout, endpoints)

    def receive_pages(self, header: bytes, keys: np.ndarray, values: np.ndarray) -> None:
        """Object-store connector (or ``auto``'s across nodes): one message of pages (K
        part, V part) for this rank."""
        self.transfer.receive_message(header, keys, values)

    def kv_accept(self, pair_id: str) -> None:
        """Point-to-point and nccl connectors: join a sender's pair group."""
        receiver = self.transfer.receiver
        assert isinstance(receiver, PairReceiver), "not a pair connector's rank"
        receiver.accept(pair_id)

    def transfer_stats(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's own connector's counters: (sent, received)."""
        return self.transfer.sender.stats.as_dict(), self.transfer.receiver.stats.as_dict()

    def transfers_across_nodes(self) -> tuple[dict[str, Any], ...]:
        """Counters of ``auto``'s across-nodes connector, each with its direction (none
        until a peer on another node needed it)."""
        return tuple(
            {**stats.as_dict(), "direction": direction}
            for direction, stats in self.transfer.stats()[2:]
        )

    # -- prefill role: pairing every rank (the leader's calls: prefill/actor.py) ------------

    def repair_decode(
        self, decode_id: str, decode_layout: Layout, endpoints: list[PeerEndpoint]
    ) -> None:
        """Leader: a paired decode instance regrouped (elastic EP); every rank re-plans its
        routes to it from its new layout and its survivors' endpoints."""
        assert decode_id in self.prefill_server().decodes, f"not paired with {decode_id}"
        refs = [w.pair_ranks.remote(decode_layout, endpoints) for w in self.serving_peers()]
        ray.get(refs, timeout=self.spec.collective_timeout_s)

    # -- any role (leader) ------------------------------------------------------------------------

    def subscribe_router(self, router: Any) -> LoadReport:
        """Push load reports and KV events to ``router`` (its ``report`` method)."""
        assert self.server is not None
        return self.server.reports.subscribe(lambda report: router.report.remote(report))

    @ray.method(concurrency_group=CONTROL)
    def stats(self) -> InstanceStats:
        assert self.server is not None
        server = self.server

        def read(engine: Any) -> InstanceStats:
            sent, received = self.transfer_stats()
            return InstanceStats(
                self.instance.instance_id,
                self.instance.role,
                server.stats.as_dict(),
                sent,
                received,
                engine.kv.num_free_blocks,
                engine.kv.num_blocks,
                engine.kv.stats.queries,
                engine.kv.stats.hits,
                engine.tier_counters(),
                engine.spec_counters(),
                self.transfers_across_nodes(),
                self.transfer.node_id,
                ray.util.get_node_ip_address(),
            )

        return server.loop.call(read).result()

    @ray.method(concurrency_group=CONTROL)
    def step_trace(self, keep: int) -> list[StepRecord]:
        """Leader: the engine steps recorded since the last call, then record the next
        ``keep`` (0 stops): what each took and what it computed (``pdserve
        sim-validate`` sets the simulator's step model against them)."""
        assert self.server is not None
        loop = self.server.loop
        return loop.call(lambda _engine: loop.step_trace(keep)).result()

    # ray.method's stub types the decorated method as a remote-method handle; at
    # run time it is this function, so the override matches RankWorker's.
    @ray.method(concurrency_group=CONTROL)
    def check_idle(self) -> None:  # type: ignore[override]
        assert self.server is not None
        self.server.loop.call(lambda engine: engine.assert_idle()).result()

    @ray.method(concurrency_group=HEALTH)
    def health(self, stall_after_s: float) -> str | None:
        """Leader: why this instance cannot serve (its engine loop died or stalled), or None."""
        if self.server is None:
            return "no engine loop running"
        return self.server.loop.problem(stall_after_s)

    @ray.method(concurrency_group=HEALTH)
    def ping(self) -> float:  # type: ignore[override]  # ray.method's stub, see check_idle
        """Any rank: answers unless the leader's engine loop has stopped."""
        if self.server is not None and self.server.loop.fatal is not None:
            raise InstanceFailedError(
                f"{self.instance.instance_id}: engine loop stopped: {self.server.loop.fatal}"
            )
        return super().ping()

    # -- drain, unpair, role flip ------------------------------------------------------------------

    def wait_idle(self, timeout_s: float) -> bool:
        """Leader: block until no request, reservation or held page is left."""
        assert self.server is not None
        return self.server.loop.wait_idle(timeout_s)

    def unpair_ranks(self, decode_id: str) -> None:
        """Every rank: stop sending to a decode instance that is going away."""
        self.transfer.unpair(decode_id)

    def forget_peer(self, instance_id: str) -> None:
        """Leader: drop a paired instance of the other role."""
        if isinstance(self.server, PrefillServer):
            self.server.forget_decode(instance_id)
            self.server.forget_peer(instance_id)
        elif isinstance(self.server, DecodeServer):
            self.server.forget_prefill(instance_id)

    def flip_role(self, role: Role) -> None:
        """Every rank: take the other role, keeping the weights (the instance must be idle).

        The KV cache is reallocated where the receiver wants it; the leader
        starts the other role's server on the same engine, with an empty prefix
        cache (the pages were reallocated).
        """
        if role == self.instance.role:
            return
        assert self.runner is not None
        if self.server is not None:
            if not self.server.loop.wait_idle(0.0):
                raise InstanceFailedError(
                    f"{self.instance.instance_id} is not idle; drain it first"
                )
            self.server.loop.stop()
            self.server = None
        for decode_id in list(self.transfer.routes):
            self.transfer.unpair(decode_id)
        self.instance = dataclasses.replace(self.instance, role=role)
        self.runner.allocate_kv(self.runner.num_blocks, self.kv_allocator)
        self.transfer.kv_cache = self.runner.kv_cache
        self.transfer.receiver.kv_cache = self.runner.kv_cache
        if self.engine is not None:
            self.engine.kv.reset_prefix_cache()
            self.engine.use_role(COLOCATED)
            self._start_server()

    @ray.method(concurrency_group=CONTROL)
    def role(self) -> str:
        return self.instance.role

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.loop.stop()
        self.transfer.close()
        super().shutdown()
