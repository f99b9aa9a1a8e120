"""Attention-FFN disaggregation (``afd``): attention on some ranks, experts on others.

An afd instance of a MoE model has ``A`` attention ranks (``[0, A)``: the
attention split by heads, the KV cache, embeddings, norms and LM head; rank 0
leads) and ``F`` expert ranks (``[A, A + F)``: each MoE layer's router and a
``1/F`` share of its experts, :class:`~pdserve.models.afd_model.ExpertStack`).
Every rank receives the step's plan and cuts it into the same micro-batches
(``afd_micro_batches``, by sequences). Per MoE layer and micro-batch of ``T``
tokens, attention rank 0 sends rows ``split_evenly(T, F, j)`` of the
post-attention hidden states ``[t_j, hidden]`` to expert rank ``j``, which
routes them (top-k over the group's experts, the EP all-to-all when ``F > 1``)
and sends their combined output ``[t_j, hidden]`` back to every attention
rank; the residual never leaves the attention ranks.

Micro-batches ping-pong so neither group idles: while the experts run
micro-batch ``m`` of layer ``L``, the attention ranks run micro-batch
``m + 1`` of layer ``L`` (the transfers are ``isend``/``irecv``)::

    attention: [a0 L][a1 L]      [a0 L+1][a1 L+1]      ...
    experts:         [e0 L][e1 L]        [e0 L+1][e1 L+1]

A step with one sequence runs as one micro-batch (no overlap). Time a rank
waits for the other group is counted in its :class:`CommStats`.

An afd instance may be the prefill or the decode instance of a disaggregated
pair: the KV transfer moves attention state only, so it runs on the attention
ranks (their step hooks) and never reaches an expert rank; the other instance
may use any layout, with or without afd, and any expert placement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from pdserve.core.layout import Layout
from pdserve.core.step import StepPlan
from pdserve.distributed.context import split_evenly
from pdserve.models.afd_model import ExpertStack
from pdserve.models.moe_ep import route_and_combine
from pdserve.models.transformer import DecoderLayer, RemoteExperts
from pdserve.parallel.batch import PreparedBatch
from pdserve.parallel.groups import InstanceGroups
from pdserve.parallel.model_runner import ModelRunner
from pdserve.parallel.pipeline import StageExecutor, StepHooks, split_micro_batches


def afd_role(layout: Layout, rank: int) -> str:
    """ "attention", "experts", or "" (not an afd instance) for ``rank``."""
    if not layout.afd_experts:
        return ""
    return "experts" if layout.is_expert_rank(rank) else "attention"


def stage_executor(
    runner: ModelRunner, groups: InstanceGroups, hooks: StepHooks | None
) -> StageExecutor:
    """The executor of ``runner``'s rank: afd attention or experts, else a pipeline stage."""
    if not runner.afd_role:
        return StageExecutor(runner, groups, hooks)
    if runner.afd_role == "experts":
        return ExpertExecutor(runner, groups)  # no KV cache: the hooks have nothing to do
    return AttentionExecutor(runner, groups, hooks)


@dataclass
class _InFlight:
    """One micro-batch's trip to the experts: its transfers and the output buffer."""

    works: list[dist.Work | None] = field(default_factory=list)
    out: torch.Tensor | None = None  # [T, hidden], written by the irecvs
    keep: list[torch.Tensor] = field(default_factory=list)  # sent tensors stay alive


class AttentionExecutor(StageExecutor):
    """An attention rank: every layer's attention, the experts' output from the expert ranks.

    On a prefill or decode instance of a disaggregated pair the KV transfer
    hooks run here, as on any stage: ``on_layer`` right after a micro-batch's
    attention wrote that layer's KV (before its MoE output is back).
    """

    def __init__(
        self, runner: ModelRunner, groups: InstanceGroups, hooks: StepHooks | None = None
    ) -> None:
        super().__init__(runner, groups, hooks)
        self.experts = groups.layout.expert_ranks()
        self.parts = runner.config.parallel.afd_micro_batches

    def _forward(self, plan: StepPlan) -> tuple[dict[str, list[int]], bool]:
        hooks = self.hooks
        if hooks is not None:
            hooks.before_step(plan)
        micro = split_micro_batches(plan, self.parts)
        on_layer: list[Callable[[int], None]] | None = None
        if hooks is not None and plan.kv_sends:
            micro = [StepPlan(mb.step_id, mb.seqs, kv_sends=plan.kv_sends) for mb in micro]
            on_layer = [partial(hooks.on_layer, micro=mb) for mb in micro]
        batches = [self.runner.prepare(mb) for mb in micro]
        hidden = self._layers(batches, on_layer)
        tokens: dict[str, list[int]] = {}
        for batch, h in zip(batches, hidden, strict=True):
            if batch.sample_ids:
                self._sample(batch, h, tokens)  # the sampler is rank 0, the leader
        ok = hooks.after_step(plan) if hooks is not None else True
        # The expert ranks join the MIN over the ranks' flags (they sent nothing).
        return tokens, self._all_landed(ok) if plan.kv_sends else ok

    def _layers(
        self, batches: list[PreparedBatch], on_layer: list[Callable[[int], None]] | None
    ) -> list[torch.Tensor]:
        """Every layer over every micro-batch, ping-ponging with the expert ranks.

        ``on_layer[m](i)`` runs once micro-batch ``m`` wrote layer ``i``'s KV.
        """
        model = self.runner.model
        assert model.embed is not None and model.norm is not None
        hidden = [model.embed(b.input_ids) for b in batches]  # each [T_m, hidden]
        residual: list[torch.Tensor | None] = [None] * len(batches)
        ropes = [model.rotary.tables(b.positions, hidden[0].dtype) for b in batches]
        flying: list[_InFlight | None] = [None] * len(batches)
        for i, (layer, cache) in enumerate(zip(model.layers, self.runner.caches, strict=True)):
            assert isinstance(layer, DecoderLayer)
            for m, b in enumerate(batches):
                hidden[m] = self._landed(flying[m], hidden[m])
                flying[m] = None
                h, residual[m] = layer.attention_part(
                    ropes[m], hidden[m], residual[m], cache, b.meta, b.lora
                )
                if on_layer is not None:
                    on_layer[m](i)
                if isinstance(layer.mlp, RemoteExperts):
                    flying[m] = self._dispatch(h)
                else:
                    hidden[m] = layer.mlp(h, b.lora)
        hidden = [self._landed(f, h) for f, h in zip(flying, hidden, strict=True)]
        return [model.norm(h, r)[0] for h, r in zip(hidden, residual, strict=True)]

    def _dispatch(self, h: torch.Tensor) -> _InFlight:
        """Send ``h`` [T, hidden] to the expert ranks (from rank 0); post the receives."""
        t, f = h.shape[0], len(self.experts)
        trip = _InFlight(out=torch.empty_like(h))
        assert trip.out is not None
        if self.ctx.tp_rank == 0:
            send = h.contiguous()
            trip.keep.append(send)
            for j, dst in enumerate(self.experts):
                lo, hi = split_evenly(t, f, j)
                if hi > lo:
                    trip.works.append(dist.isend(send[lo:hi], dst=dst))
        for j, src in enumerate(self.experts):
            lo, hi = split_evenly(t, f, j)
            if hi > lo:
                trip.works.append(dist.irecv(trip.out[lo:hi], src=src))
        return trip

    def _landed(self, trip: _InFlight | None, hidden: torch.Tensor) -> torch.Tensor:
        """The experts' output of ``trip`` once it arrived (``hidden`` if none is due)."""
        if trip is None:
            return hidden
        assert trip.out is not None
        with self.ctx.comm.timed(trip.out.numel() * trip.out.element_size()):
            for work in trip.works:
                if work is not None:
                    work.wait()
        return trip.out


class ExpertExecutor(StageExecutor):
    """An expert rank: each MoE layer's experts for the rows the attention ranks send.

    It holds no KV cache, so no KV transfer reaches it (``transfer/routes.py``
    routes attention ranks only); on a step that sends pages it only joins the
    ranks' MIN over their "every page landed" flags.
    """

    def __init__(self, runner: ModelRunner, groups: InstanceGroups) -> None:
        super().__init__(runner, groups, None)
        assert isinstance(runner.model, ExpertStack)
        self.model = runner.model
        self.attention = list(range(groups.layout.tp))
        self.parts = runner.config.parallel.afd_micro_batches

    def _forward(self, plan: StepPlan) -> tuple[dict[str, list[int]], bool]:
        sizes = [mb.num_tokens for mb in split_micro_batches(plan, self.parts)]
        sent: list[tuple[dist.Work | None, torch.Tensor]] = []
        for i in range(len(self.model.layers)):
            for t in sizes:
                sent.extend(self._layer(i, t))
        with self.ctx.comm.timed(0):
            for work, _ in sent:
                if work is not None:
                    work.wait()
        return {}, self._all_landed(True) if plan.kv_sends else True

    def _without_forward(self, plan: StepPlan) -> bool:
        """Exports and tier work: nothing to do here but join the landed flags."""
        return self._all_landed(True) if plan.kv_sends else True

    def _layer(self, local_layer: int, t: int) -> list[tuple[dist.Work | None, torch.Tensor]]:
        """One micro-batch of ``t`` tokens through layer ``local_layer``'s experts."""
        ctx, moe = self.ctx, self.model.moe(local_layer)
        lo, hi = split_evenly(t, ctx.ep_size, ctx.ep_rank)
        x = torch.empty(
            (hi - lo, self.hidden_size), dtype=self.runner.dtype, device=self.runner.device
        )  # x: [t_j, hidden], rows lo..hi of the micro-batch
        if hi > lo:
            with ctx.comm.timed(x.numel() * x.element_size()):
                dist.recv(x, src=0)
        y = moe(x) if ctx.ep_size == 1 else route_and_combine(moe, x, lo)
        if hi == lo:
            return []
        return [(dist.isend(y, dst=a), y) for a in self.attention]
