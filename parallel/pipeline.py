"""One rank's part of a step: its pipeline stage over micro-batches.

A step's batch is cut into up to ``pp`` micro-batches so the stages work at the
same time: while stage 1 runs micro-batch 0, stage 0 already runs micro-batch 1::

    stage 0:  [mb0][mb1][mb2]
    stage 1:       [mb0][mb1][mb2]  -> tokens to the leader

Between stages each rank sends ``[2, T, hidden]`` (hidden states and residual)
to the rank with the same index in the next stage. Index 0 of the last stage
samples and sends the token ids to the leader (global rank 0), unless it is
the leader itself.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

from pdserve.core.step import StepPlan, TokenLogprobs
from pdserve.parallel.batch import PreparedBatch
from pdserve.parallel.groups import InstanceGroups
from pdserve.parallel.model_runner import ModelRunner
from pdserve.parallel.sampler import prompt_logprobs


def split_micro_batches(plan: StepPlan, parts: int) -> list[StepPlan]:
    """Cut ``plan`` into at most ``parts`` contiguous pieces of similar token counts."""
    if parts <= 1 or len(plan.seqs) <= 1:
        return [plan]
    parts = min(parts, len(plan.seqs))
    target = plan.num_tokens / parts
    pieces: list[StepPlan] = []
    current: list = []
    tokens = 0
    for i, seq in enumerate(plan.seqs):
        current.append(seq)
        tokens += seq.num_tokens
        left_seqs = len(plan.seqs) - i - 1
        left_parts = parts - len(pieces) - 1
        if left_parts > 0 and (tokens >= target * (len(pieces) + 1) or left_seqs == left_parts):
            pieces.append(StepPlan(plan.step_id, current))
            current = []
    if current:
        pieces.append(StepPlan(plan.step_id, current))
    return pieces


class StepHooks(Protocol):
    """What a step lets other parts do on a rank (the KV transfer layer uses them).

    ``before_step`` runs before any layer (e.g. wait for KV that must have
    arrived); ``on_layer`` runs after each local layer of each micro-batch
    (``micro`` is that micro-batch's plan); ``after_step`` runs when the rank's
    layers are done, before the step counts as finished. A plan with pages to
    send and no sequence (cached pages a peer asked for) runs ``export``, then
    ``after_step``, and no forward.
    """

    def before_step(self, plan: StepPlan) -> None: ...

    def on_layer(self, local_layer: int, micro: StepPlan) -> None: ...

    def export(self, plan: StepPlan) -> None: ...

    def after_step(self, plan: StepPlan) -> bool:
        """True unless something this rank sent for the plan failed to land."""
        ...


class StageExecutor:
    """Runs plans on one rank of a multi-rank instance."""

    def __init__(
        self, runner: ModelRunner, groups: InstanceGroups, hooks: StepHooks | None = None
    ) -> None:
        self.runner = runner
        self.groups = groups
        self.ctx = groups.ctx
        self.hidden_size = runner.model_config.hidden_size
        self.hooks = hooks
        # Seconds this rank spent running plans (its ``ctx.comm`` says how much of
        # it went to waiting for peers): the rank's busy time.
        self.run_seconds = 0.0
        # On the leader after :meth:`run`: the step's logprobs of the rows that asked.
        self.logprobs: dict[str, list[TokenLogprobs]] = {}
        # ... and the prompt logprobs of the chunks that asked (one stage only: the engine
        # refuses them on pipelines).
        self.prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    @torch.no_grad()
    def run(self, plan: StepPlan) -> tuple[dict[str, list[int]], bool, list[bool]]:
        """Execute the plan; on the leader, return the new tokens of each sampling row.

        The flag says whether every rank delivered the plan's KV pages; the list
        has a flag per KV-tier load, True where every rank loaded that block.
        """
        start = time.perf_counter()
        self.logprobs, self.prompt_logprobs = {}, {}
        self.runner.sampler.forget(plan.finished_request_ids)
        loads_ok = self._tier_loads(plan)
        try:
            if not plan.seqs:  # tier work or exports; ranks still hear of finished requests
                return {}, self._without_forward(plan), loads_ok
            tokens, ok = self._forward(plan)
        finally:
            self.runner.finish_tier_ops()
            self.run_seconds += time.perf_counter() - start
        return tokens, ok, loads_ok

    def _without_forward(self, plan: StepPlan) -> bool:
        hooks = self.hooks
        if hooks is None:
            return not plan.kv_sends
        hooks.before_step(plan)
        if not plan.kv_sends:
            return True
        hooks.export(plan)
        return self._all_landed(hooks.after_step(plan))

    def _all_landed(self, ok: bool) -> bool:
        """Every rank's pages of the step landed (a MIN over the ranks' flags)."""
        if self.groups.layout.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.groups.cpu_group)
        return bool(flag.item())

    def _tier_loads(self, plan: StepPlan) -> list[bool]:
        ok = self.runner.start_tier_ops(plan)
        if ok and self.groups.layout.world_size > 1:
            flags = torch.tensor(ok, dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.groups.cpu_group)
            ok = [bool(f) for f in flags.tolist()]
        return ok

    def _forward(self, plan: StepPlan) -> tuple[dict[str, list[int]], bool]:
        g, ctx, hooks = self.groups, self.ctx, self.hooks
        if hooks is not None:
            hooks.before_step(plan)
        micro = split_micro_batches(plan, ctx.pp_size)
        if plan.kv_sends:
            micro = [StepPlan(mb.step_id, mb.seqs, kv_sends=plan.kv_sends) for mb in micro]
        batches = [self.runner.prepare(mb) for mb in micro]
        in_flight: list[tuple[dist.Work | None, torch.Tensor]] = []
        tokens: dict[str, list[int]] = {}
        for mb, batch in zip(micro, batches, strict=True):
            on_layer = partial(hooks.on_layer, micro=mb) if hooks and plan.kv_sends else None
            hidden, residual = self._receive(batch)
            hidden, residual = self.runner.model(
                batch.input_ids,
                batch.positions,
                self.runner.caches,
                batch.meta,
                hidden,
                residual,
                on_layer=on_layer,
                lora=batch.lora,
            )
            if not ctx.is_last_stage:
                assert residual is not None
                out = torch.stack([hidden, residual])  # [2, T, hidden]
                with ctx.comm.timed(out.numel() * out.element_size()):
                    work = dist.isend(out, dst=g.peer(ctx.pp_rank + 1))
                in_flight.append((work, out))
            elif batch.sample_ids or batch.prompt_rows:
                in_flight.extend(self._sample(batch, hidden, tokens))
        if g.is_leader and g.sampler_rank != 0:
            self._receive_tokens(batches, tokens)
        with ctx.comm.timed(0):
            for work, _ in in_flight:
                if work is not None:
                    work.wait()
        ok = hooks.after_step(plan) if hooks is not None else True
        # Every rank's pages have landed (or some failed) before the step returns.
        return tokens, self._all_landed(ok) if plan.kv_sends else ok

    def _receive(self, batch: PreparedBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.ctx.is_first_stage:
            return None, None
        buf = torch.empty(
            (2, batch.num_tokens, self.hidden_size),
            dtype=self.runner.dtype,
            device=self.runner.device,
        )
        with self.ctx.comm.timed(buf.numel() * buf.element_size()):
            dist.recv(buf, src=self.groups.peer(self.ctx.pp_rank - 1))
        return buf[0], buf[1]

    def _receive_tokens(self, batches: list[PreparedBatch], tokens: dict[str, list[int]]) -> None:
        """On the leader: the new token ids of each micro-batch, from the sampler rank."""
        g = self.groups
        for batch in batches:
            if batch.sample_ids:
                # [S, max_sample_tokens], each row padded with -1
                got = torch.empty(
                    (len(batch.sample_ids), batch.max_sample_tokens), dtype=torch.int64
                )
                with self.ctx.comm.timed(got.numel() * 8):
                    dist.recv(got, src=g.sampler_rank, group=g.cpu_group)
                rows = [[t for t in row if t >= 0] for row in got.tolist()]
                tokens.update(zip(batch.sample_ids, rows, strict=True))
                if _logprob_width(batch):
                    table = torch.empty(_logprob_shape(batch), dtype=torch.float64)
                    with self.ctx.comm.timed(table.numel() * 8):
                        dist.recv(table, src=g.sampler_rank, group=g.cpu_group)
                    self.logprobs.update(_logprobs_from_table(batch, rows, table))

    def _sample(
        self, batch: PreparedBatch, hidden: torch.Tensor, tokens: dict[str, list[int]]
    ) -> list[tuple[dist.Work | None, torch.Tensor]]:
        # Every TP rank joins the logits all-gather; one rank samples.
        g = self.groups
        if batch.prompt_rows:
            got = prompt_logprobs(self.runner.model.compute_logits, hidden, batch.prompt_rows)
            self.prompt_logprobs.update(got if g.is_leader else {})
        if not batch.sample_ids:
            return []
        logits = self.runner.model.compute_logits(hidden[batch.sample_indices])
        if g.rank != g.sampler_rank:
            return []
        sampler = self.runner.sampler
        sampled = sampler.verify(logits, batch.sample_rows, batch.sample_drafts, batch.sample_ids)
        logprobs = sampler.logprobs(logits, batch.sample_rows, batch.sample_drafts, sampled)
        if g.is_leader:
            tokens.update(zip(batch.sample_ids, sampled, strict=True))
            self.logprobs.update((batch.sample_ids[i], v) for i, v in logprobs.items())
            return []
        width = batch.max_sample_tokens
        out = torch.tensor([t + [-1] * (width - len(t)) for t in sampled], dtype=torch.int64)
        sends = [(dist.isend(out, dst=0, group=g.cpu_group), out)]
        if _logprob_width(batch):  # every rank knows from the plan whether any row asked
            table = _logprob_table(batch, logprobs)
            sends.append((dist.isend(table, dst=0, group=g.cpu_group), table))
        return sends


# -- logprobs from a sampler rank that is not the leader ------------------------------------
# A float64 table [rows, tokens, 1 + 2k]: per new token its logprob, then k (id, logprob)
# pairs (ids are exact in float64); unused cells are NaN.


def _logprob_width(batch: PreparedBatch) -> int:
    """1 + 2k for the batch's largest ``logprobs`` k; 0 when no row asks."""
    asked = [r.logprobs for r in batch.sample_rows if r.logprobs >= 0]
    return 1 + 2 * max(asked) if asked else 0


def _logprob_shape(batch: PreparedBatch) -> tuple[int, int, int]:
    return (len(batch.sample_ids), batch.max_sample_tokens, _logprob_width(batch))


def _logprob_table(batch: PreparedBatch, logprobs: dict[int, list[TokenLogprobs]]) -> torch.Tensor:
    table = torch.full(_logprob_shape(batch), float("nan"), dtype=torch.float64)
    for i, entries in logprobs.items():
        for j, (value, top) in enumerate(entries):
            table[i, j, 0] = value
            for m, (token, lp) in enumerate(top):
                table[i, j, 1 + 2 * m], table[i, j, 2 + 2 * m] = token, lp
    return table


def _logprobs_from_table(
    batch: PreparedBatch, rows: list[list[int]], table: torch.Tensor
) -> dict[str, list[TokenLogprobs]]:
    out: dict[str, list[TokenLogprobs]] = {}
    cells = table.tolist()
    for i, (rid, r) in enumerate(zip(batch.sample_ids, batch.sample_rows, strict=True)):
        if r.logprobs < 0:
            continue
        out[rid] = [
            (
                cells[i][j][0],
                [(int(cells[i][j][1 + 2 * m]), cells[i][j][2 + 2 * m]) for m in range(r.logprobs)],
            )
            for j in range(len(rows[i]))
        ]
    return out
