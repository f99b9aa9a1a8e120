"""One rank of a multi-rank instance, hosted by a Ray actor.

Every rank holds its model shard and KV cache. Rank 0 is the leader: it owns
the :class:`~pdserve.engine.engine.EngineCore` (scheduler, detokenizer) and each
step broadcasts the plan as one msgpack message; the other ranks run a
follower loop in a thread, executing every plan they receive until the leader
sends a stop. Start-up, in order, driven by :mod:`pdserve.parallel.instance`::

    leader.rendezvous()         -> address of a TCP store the leader listens on
    every rank .join(address)   -> process groups, shard loaded; returns KV capacity
    every rank .allocate_kv(n)  -> n = the smallest capacity; followers start looping
                                   (the leader's counts its draft model's KV too)
    leader.start_engine()       -> EngineCore over a GroupExecutor
    leader.attach_peers(actors) -> elastic EP armed where the layout allows it
                                   (a dead follower is regrouped around:
                                   ``pdserve.parallel.elastic``)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pdserve.core.errors import InstanceFailedError
from pdserve.core.request import RequestOutput
from pdserve.core.step import StepPlan, StepResult
from pdserve.core.tokenizer import Tokenizer
from pdserve.distributed.context import CommStats
from pdserve.engine.engine import EngineCore
from pdserve.engine.executor import Executor
from pdserve.models.moe import expert_load, expert_rows
from pdserve.parallel.afd import afd_role, stage_executor
from pdserve.parallel.afd_groups import afd_groups
from pdserve.parallel.draft_runner import DraftRunner
from pdserve.parallel.elastic import ElasticLeader, ElasticRank
from pdserve.parallel.executor import StepTimes, time_plans
from pdserve.parallel.expert_slots import (
    decode_rebalance,
    encode_rebalance,
    initial_placement,
    is_rebalance,
    moe_layers,
    rebalance,
)
from pdserve.parallel.groups import (
    InstanceGroups,
    abort_groups,
    destroy_groups,
    init_groups,
    leader_store,
    receive_plan,
    send_plan,
    store_address,
)
from pdserve.parallel.lora_control import apply_lora, encode_lora, is_lora
from pdserve.parallel.model_runner import KVAllocator, ModelRunner, resolve_device
from pdserve.parallel.pipeline import StageExecutor, StepHooks
from pdserve.parallel.rank_spec import EngineInfo, GenerateItem, RankSpec

logger = logging.getLogger(__name__)


class GroupExecutor(Executor):
    """The leader's executor: broadcast the plan, run rank 0's stage, collect tokens."""

    def __init__(
        self,
        stage: StageExecutor,
        groups: InstanceGroups,
        num_blocks: int,
        drafter: DraftRunner | None = None,
    ) -> None:
        """``drafter``: the draft model on this (the leader) rank, if the engine has one."""
        self.stage = stage
        self.groups = groups
        self._num_blocks = num_blocks
        self.drafter = drafter
        # Held while a step's plan is sent and run; control messages on the plan
        # channel (expert re-placement) take it to fall between two steps.
        self.step_lock = threading.Lock()
        self.elastic: ElasticLeader | None = None  # set by attach_peers (elastic EP)
        self.step_times = StepTimes()

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    @property
    def tier_slots(self) -> tuple[int, int]:
        return self.stage.runner.tier_slots()

    @property
    def draft_proposer(self) -> DraftRunner | None:
        return self.drafter

    def tier_io(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
        return self.stage.runner.tier_io()

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        with self.step_lock:
            while True:
                try:
                    if self.groups.layout.world_size > 1:  # the other ranks run it too
                        send_plan(self.groups, plan.to_msgpack())
                    tokens, transfer_ok, loads_ok = self.stage.run(plan)
                    break
                except (RuntimeError, dist.DistError) as e:
                    if self.elastic is None or not self.elastic.recover(self.groups, e):
                        raise InstanceFailedError(
                            f"instance {self.groups.layout.describe()} lost a rank "
                            f"during step {plan.step_id}: {e}"
                        ) from e
                    self.groups = self.stage.groups  # the survivors' (parallel/elastic.py)
            if self.elastic is not None:
                self.elastic.ran()
        self.step_times.record(plan.num_tokens, time.perf_counter() - start)
        lps = self.stage.logprobs, self.stage.prompt_logprobs
        return StepResult.from_tokens(plan.step_id, tokens, transfer_ok, loads_ok, *lps)

    def adapter_fingerprints(self) -> dict[str, str]:
        return dict(self.stage.runner.adapter_fingerprints)

    def load_adapter(self, slot: int, name: str, folder: str) -> str:
        """Check on the leader, then load on every rank between two steps (lora_control.py);
        the fingerprint of the bytes read, which every rank checks its own read against."""
        adapter = self.stage.runner.read_adapter(name, folder)
        with self.step_lock:
            send_plan(self.groups, encode_lora(slot, name, folder, adapter.fingerprint))
            self.stage.runner.load_adapter(slot, name, adapter)
        return adapter.fingerprint

    def unload_adapter(self, slot: int, name: str) -> None:
        with self.step_lock:
            send_plan(self.groups, encode_lora(slot, name, None))
            self.stage.runner.unload_adapter(slot)

    def shutdown(self) -> None:
        with self.step_lock, contextlib.suppress(RuntimeError, dist.DistError):
            send_plan(self.groups, None)  # (the followers may be gone already)


class RankWorker(ElasticRank):
    """Ray actor body for one rank (wrapped with ``ray.remote`` by the instance)."""

    def __init__(self, spec: RankSpec) -> None:
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.device = resolve_device(spec.engine.device)
        self._store: dist.TCPStore | None = None
        self.groups: InstanceGroups | None = None
        self.runner: ModelRunner | None = None
        self.stage: StageExecutor | None = None
        self.drafter: DraftRunner | None = None  # leader: speculative_method draft
        self.engine: EngineCore | None = None
        self._loop: threading.Thread | None = None
        self.follower_error: str | None = None
        self._stopping = threading.Event()  # set at shutdown: background work ends
        self.rebalances = 0  # expert re-placements run (leader)
        self.redundant_experts = spec.engine.parallel.redundant_experts
        # Set by subclasses before ``join``: where the KV cache lives, and what
        # runs around each step (the KV transfer layer).
        self.kv_allocator: KVAllocator | None = None
        self.step_hooks: StepHooks | None = None

    # -- start-up -------------------------------------------------------------

    def rendezvous(self) -> str:
        """Leader only: listen on a free port; every rank joins through it."""
        self._store = leader_store(self.spec.layout.world_size, self.spec.collective_timeout_s)
        return store_address(self._store)

    def join(self, address: str) -> int:
        """Join the process groups, load this rank's shard; return its KV capacity."""
        spec = self.spec
        self.groups = init_groups(
            spec.layout,
            spec.rank,
            address,
            self.device,
            spec.collective_timeout_s,
            self._store,
            spec.shm_collectives,
            afd_groups if spec.layout.afd_experts else None,
        )
        coords = spec.layout.coords(spec.rank)
        self.runner = ModelRunner(
            spec.model,
            spec.engine,
            self.groups.ctx,
            spec.layout.stage_layers[coords.stage],
            afd_role(spec.layout, spec.rank),
        )
        self.stage = stage_executor(self.runner, self.groups, self.step_hooks)
        if spec.engine.parallel.redundant_experts:
            model, start = self.runner.model, self.runner.layer_range[0]
            initial_placement(model, start, spec.engine.parallel.redundant_experts, spec.model.path)
        if self.groups.is_leader:  # the draft model runs where the engine does
            runner = self.runner
            self.drafter = DraftRunner.for_engine(
                spec.model, spec.engine, runner.device, runner.dtype
            )
        return self.runner.max_num_blocks(self.drafter.bytes_per_block() if self.drafter else 0)

    def adapter_fingerprints(self) -> dict[str, str]:
        """This rank's start-up adapters' fingerprints, of the bytes it read."""
        assert self.runner is not None
        return dict(self.runner.adapter_fingerprints)

    def allocate_kv(self, num_blocks: int) -> None:
        assert self.runner is not None and self.groups is not None
        self.runner.allocate_kv(num_blocks, self.kv_allocator)
        if self.drafter is not None:
            self.drafter.allocate_kv(num_blocks)
        if not self.groups.is_leader:
            self._loop = threading.Thread(target=self._follow, name="pdserve-follower", daemon=True)
            self._loop.start()

    def start_engine(self) -> EngineInfo:
        """Leader only: the engine core over all ranks."""
        assert self.runner is not None and self.groups is not None and self.stage is not None
        model = self.spec.model
        has_tokenizer = (Path(model.path) / "tokenizer.json").is_file()
        tokenizer = Tokenizer.from_dir(model.path) if has_tokenizer else None
        executor = GroupExecutor(self.stage, self.groups, self.runner.num_blocks, self.drafter)
        self.engine = EngineCore(self.spec.engine, model, executor, tokenizer)
        self._start_rebalancing()
        return EngineInfo(
            self.runner.num_blocks, self.engine.max_model_len, self.engine.kv.block_size
        )

    def _start_rebalancing(self) -> None:
        """Leader: re-place the experts every ``rebalance_interval_s`` (EPLB), between steps."""
        parallel = self.spec.engine.parallel
        interval = parallel.rebalance_interval_s
        if not interval or not parallel.redundant_experts:
            return

        def run() -> None:
            while not self._stopping.wait(interval):
                try:
                    self.rebalance_experts()
                except Exception as e:  # the instance is going away (or lost a rank)
                    logger.warning("periodic expert re-placement stopped: %s", e)
                    return

        threading.Thread(target=run, name="pdserve-eplb", daemon=True).start()

    def _follow(self) -> None:
        assert self.groups is not None and self.stage is not None
        try:
            while (payload := receive_plan(self.groups)) is not None:
                if is_rebalance(payload):
                    self._place_experts(payload)
                elif is_lora(payload):
                    apply_lora(self.stage.runner, payload)
                else:
                    self.stage.run(StepPlan.from_msgpack(payload))
        except Exception as e:
            self.follower_error = f"{type(e).__name__}: {e}"
            logger.error("rank %d follower loop stopped: %s", self.spec.rank, e)
            # Leave the groups now, so that the leader notices through its own collectives
            # at once: a peer still waiting on this rank (a send needs its receive) would
            # otherwise wait out the collective timeout while this process keeps its sockets.
            try:
                abort_groups(self.groups, f"rank {self.spec.rank} stopped: {e}")
            except Exception:
                logger.exception("rank %d could not leave its groups", self.spec.rank)

    # -- leader API -------------------------------------------------------------

    def generate(self, items: list[GenerateItem]) -> list[RequestOutput]:
        assert self.engine is not None, "generate is served by the leader (rank 0)"
        return self.engine.generate([(i.request_id, i.prompt, i.params) for i in items])

    def check_idle(self) -> None:
        """Raise AssertionError unless no request and no KV block is held."""
        assert self.engine is not None
        self.engine.assert_idle()

    def time_plans(self, plans: list[StepPlan]) -> list[float]:
        """Leader only, on an idle instance (``pdserve profile``): run each plan through
        every rank as a served step runs; the seconds each took, timed here."""
        self.check_idle()  # the plans' pages are nobody's
        assert self.engine is not None
        return time_plans(self.engine.executor, plans)

    def load_lora_adapter(self, name: str, folder: str) -> tuple[str, str]:
        """Leader: serve a LoRA adapter on every rank; returns (name, content fingerprint)."""
        assert self.engine is not None, "load_lora_adapter is served by the leader (rank 0)"
        served = self.engine.load_adapter(name, folder)
        return served.name, served.fingerprint

    def unload_lora_adapter(self, name: str) -> None:
        assert self.engine is not None, "unload_lora_adapter is served by the leader (rank 0)"
        self.engine.unload_adapter(name)

    def rebalance_experts(self, loads: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
        """Leader: re-place every MoE layer's expert slots on every rank, between two steps.

        ``loads`` are tokens per expert per global layer to place by; None: what
        each stage's EP ranks routed since the last placement. Returns the
        leader's stage's layers whose placement changed (layer -> the expert of
        each slot, rank ``r`` holding a run of ``len / ep`` slots). A step being
        run finishes first; the next one runs on the new placement.
        """
        assert self.engine is not None, "rebalance_experts is served by the leader (rank 0)"
        executor = self.engine.executor
        assert isinstance(executor, GroupExecutor) and self.groups is not None
        message = encode_rebalance(loads)
        with executor.step_lock:
            send_plan(self.groups, message)
            self.rebalances += 1
            return self._place_experts(message)

    def expert_placement(self) -> tuple[int, dict[int, list[int]]]:
        """Re-placements run so far, and this rank's stage's slots per MoE layer."""
        assert self.runner is not None
        layers = moe_layers(self.runner.model, self.runner.layer_range[0])
        return self.rebalances, {layer: list(m.placement.slots) for layer, m in layers.items()}

    def _place_experts(self, message: bytes) -> dict[int, list[int]]:
        assert self.runner is not None
        parallel = self.spec.engine.parallel
        placements = rebalance(
            self.runner.model,
            self.runner.layer_range[0],
            self.redundant_experts,
            self.spec.model.path,
            decode_rebalance(message),
            parallel.rebalance_min_tokens,
        )
        return {layer: list(p.slots) for layer, p in placements.items()}

    # -- any rank ---------------------------------------------------------------

    def comm_stats(self) -> CommStats:
        """Communication time and bytes of this rank since it started."""
        assert self.groups is not None
        return self.groups.ctx.comm

    def step_times(self) -> StepTimes:
        """Leader: the time of the last steps the engine ran over every rank."""
        assert self.engine is not None, "step_times is served by the leader (rank 0)"
        executor = self.engine.executor
        assert isinstance(executor, GroupExecutor)
        return executor.step_times

    def ping(self) -> float:
        return time.monotonic()

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens this rank routed per expert since start, per global MoE layer."""
        assert self.runner is not None
        return expert_load(self.runner.model, self.runner.layer_range[0])

    def expert_rows(self) -> dict[int, int]:
        """Rows this rank's expert slots computed since start, per global MoE layer (EP)."""
        assert self.runner is not None
        return expert_rows(self.runner.model, self.runner.layer_range[0])

    def shutdown(self) -> None:
        self._stopping.set()
        if self.engine is not None:
            self.engine.shutdown()  # broadcasts stop to the followers
        if self._loop is not None:
            self._loop.join(timeout=self.spec.collective_timeout_s)
        if self.runner is not None:
            self.runner.close()
        destroy_groups(self.groups)
