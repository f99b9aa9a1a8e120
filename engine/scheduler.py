"""Continuous batching with chunked prefill and preemption by recompute.

Each step shares a token budget (``max_num_batched_tokens``) among requests:

1. running requests that are decoding (one token each), oldest first;
2. running requests partway through their prompt (the next chunk);
3. waiting requests, each starting from its longest prefix-cache hit; a prompt
   longer than the budget left is split.

Priority (``engine/priority.py``) orders each of the three: higher first.

A decoding request may carry drafts (``engine/speculative.py``): its row is
``[last token] + drafts``, all with KV slots and counted in the budget.

When the pool has no block for a running request, the lowest-priority running
request (the newest among equals) is preempted: its blocks are freed and it
goes back to the front of its priority in the queue, to be recomputed from
token 0 (prefix caching usually makes that cheap). Waiting requests are not
admitted in a step that preempted. A waiting request short of blocks may
preempt running requests of strictly lower priority (a few a step).

Queues: ``waiting`` is fed by ``add_request`` and drained by ``schedule``;
``running`` is filled by ``schedule`` (and ``activate``) and emptied by
``update``/``finish``. Outside the queues, two kinds of request hold blocks:
``reserved`` (decode role: pages waiting for KV from a prefill instance) and
``held`` (prefill role: finished, pages kept until decode acknowledged them).
Within one step a third: ``loading``, waiting requests whose offloaded prefix
blocks (host or disk tier) the step copies back; they rejoin the front of the
queue when it ends and find those blocks as ordinary prefix hits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.core.config import SchedulerConfig, SpeculativeConfig
from pdserve.core.request import Request, RequestStatus
from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan, TierOps, TokenLogprobs
from pdserve.engine.block_pool import KVBlock
from pdserve.engine.draft import DraftProposer
from pdserve.engine.integrity import check_queues
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.outputs import record_prompt_logprobs
from pdserve.engine.priority import WaitingQueue, by_priority, victim, victims_for
from pdserve.engine.seen import send_seen
from pdserve.engine.speculative import Speculator
from pdserve.engine.stopping import token_stop

RUNNING = RequestStatus.RUNNING
MAX_TIER_LOADS = 2
MAX_PRIORITY_PREEMPTIONS = 4  # a step's preemptions to admit a higher priority


class Scheduler:
    """Owns the waiting and running queues of one engine and their KV blocks."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        speculative: SpeculativeConfig | None = None,
        proposer: DraftProposer | None = None,
    ) -> None:
        """``clock``: where the request timestamps come from (a simulator passes its own);
        ``proposer``: the draft model of ``speculative_method: draft``."""
        self.clock = clock
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # waiting, running or reserved
        self.reserved: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        # Waiting requests whose offloaded prefix is copied back during this step.
        self.loading: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._step_id = 0
        self.num_preemptions = 0
        self.spec = Speculator(speculative or SpeculativeConfig(), proposer)
        self._drafts: dict[str, list[int]] = {}  # this step's drafts per request

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_work(self) -> bool:
        """Something to schedule (reserved requests wait for their KV)."""
        return bool(self.waiting or self.running)

    # -- disaggregation: decode-side reservations, prefill-side holds ---------

    def reserve(self, request: Request) -> int | None:
        """Hold blocks for the request's prompt and first token; None if no room.

        Returns how many leading tokens are already cached here (whole blocks),
        which the prefill instance need not send.
        """
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs:
            return None
        prefix = self.kv.find_cached_prefix(request)
        need = request.num_tokens + 1 - len(prefix) * self.kv.block_size
        if not self.kv.allocate_slots(request, need, prefix):
            return None
        request.status = RequestStatus.RESERVED
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return request.num_computed_tokens

    def activate(self, request_id: str, first_token: int) -> Request:
        """The reserved request's prompt KV has landed: join the running batch."""
        request = self.reserved.pop(request_id)
        request.activated_time = self.clock()
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_computed_blocks(request)
        request.append_token(first_token, self.clock())
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (they stay in the prefix cache)."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request)
        return True

    def schedule(self) -> StepPlan:
        """Pick this step's batch and reserve its KV slots."""
        if self.kv.tiers is not None:
            self.kv.tiers.begin_step()  # before allocating: victims' copies go first
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted = False
        decoding: list[Request] = []  # one known token each, before those mid-prompt
        prefilling: list[Request] = []
        for r in by_priority(self.running):
            (decoding if len(r.token_ids) - r.num_computed_tokens == 1 else prefilling).append(r)
        self._drafts = {}
        drafting = self.spec.batch_allowed(len(decoding))
        cap, allocate = self.config.max_prefill_chunk, self.kv.allocate_slots
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request.status is not RUNNING:
                continue  # preempted earlier in this loop
            remaining = len(request.token_ids) - request.num_computed_tokens
            num_new = min(remaining, budget, cap or remaining)  # a decode row: 1
            if drafting and remaining == 1:
                num_new += self._draft(request, budget - 1)
            while not allocate(request, num_new):
                loser = victim(self.running)
                budget += self._preempt(loser, chosen)
                preempted = True
                if loser is request:
                    break
            else:
                chosen.append((request, num_new))
                budget -= num_new
        if not preempted:
            budget = self._admit_waiting(budget, chosen)
        self._step_id += 1
        finished = self._finished_since_last_step
        tier_ops = self.kv.tiers.take_ops() if self.kv.tiers is not None else TierOps()
        if chosen or tier_ops:  # an empty plan is not executed: its ranks would never hear
            self._finished_since_last_step = []
        if self._drafts:
            self._drafts = self.spec.fill(self._drafts, [r for r, _ in chosen], self.kv.block_table)
        seqs = [self._scheduled(r, n) for r, n in chosen]
        return StepPlan(self._step_id, seqs, list(finished), tier_ops=tier_ops)

    def loads_done(self, plan: StepPlan, ok: list[bool]) -> None:
        """The plan's tier loads ran (``ok``: a flag per load); requeue the loading requests."""
        if not plan.tier_ops.loads and not self.loading:
            return
        self.kv.loads_done(plan.tier_ops.loads, ok)
        for request in reversed(self.loading):
            self.waiting.push_front(request)
        self.loading.clear()

    def _draft(self, request: Request, budget: int) -> int:
        """Propose drafts that fit the budget, the context limit and the free blocks."""
        if request.sampling_params.json_schema is not None:
            return 0  # a grammar row is sampled at one position (parallel/grammar.py)
        drafts = self.spec.propose(request, budget, self.max_model_len)
        if not drafts or not self.kv.can_allocate(request, 1 + len(drafts)):
            return 0
        self._drafts[request.request_id] = drafts
        return len(drafts)

    def _preempt(self, request: Request, chosen: list[tuple[Request, int]]) -> int:
        """Send a running request back to wait; returns the step's tokens it gives back."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = request.penalty_seen_sent = 0  # ranks forget it
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)
        self._drafts.pop(request.request_id, None)
        # Ranks may hold per-request state (e.g. sampling); tell them to drop it.
        self._finished_since_last_step.append(request.request_id)
        for i, (r, n) in enumerate(chosen):
            if r is request:  # already picked this step
                del chosen[i]
                return n
        return 0

    def _admit_waiting(self, budget: int, chosen: list[tuple[Request, int]]) -> int:
        allowed = MAX_PRIORITY_PREEMPTIONS
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.head
            whole = request.sampling_params.prompt_logprobs is not None  # no cache hits
            prefix = [] if whole else self.kv.find_cached_prefix(request)
            if not whole and self._load_offloaded(request, prefix):
                continue
            computed = len(prefix) * self.kv.block_size
            cap = self.config.max_prefill_chunk or budget
            num_new = min(request.num_tokens - computed, budget, cap)
            if not self.kv.allocate_slots(request, num_new, prefix):
                losers = victims_for(request, self.running, self.kv, prefix, num_new)[:allowed]
                if not losers:
                    break
                allowed -= len(losers)  # they queue behind it; look again with their blocks freed
                budget += sum(self._preempt(loser, chosen) for loser in losers)
                continue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new
        return budget

    def _load_offloaded(self, request: Request, prefix: list[KVBlock]) -> bool:
        """Start copying the request's offloaded prefix back; it waits out this step.

        A request loads at most ``MAX_TIER_LOADS`` times: if its blocks keep being
        evicted before it is admitted, it recomputes them instead.
        """
        if request.num_tier_loads >= MAX_TIER_LOADS:
            return False
        hits = self.kv.find_offloaded(request, len(prefix))
        # Leave a block per running request, so loading does not preempt one next step.
        if not hits or len(hits) + len(self.running) > self.kv.num_free_blocks:
            return False
        if not self.kv.start_loads(request, prefix, hits):
            return False
        self.waiting.popleft()
        self.loading.append(request)
        request.num_tier_loads += 1
        return True

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSeq:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        start, ids, rid = request.num_computed_tokens, request.token_ids, request.request_id
        drafts = self._drafts.get(rid) if self._drafts else None
        end = start + (num_new - len(drafts) if drafts else num_new)  # past the known tokens
        p, sampling = request.sampling_params, None
        if end == len(ids):
            num_output = end - request.num_prompt_tokens
            banned: tuple[int, ...] = ()
            if num_output < p.min_tokens:
                banned = request.eos_token_ids + p.stop_token_ids
            sampling = RowSampling(
                p.temperature,
                p.top_k,
                p.top_p,
                p.seed,
                request.output_offset + num_output,
                banned,
                -1 if p.logprobs is None else p.logprobs,
                p.logit_bias,
            )
            if request.tracks_seen:
                send_seen(request, sampling, num_output)
        tokens = ids[start:end]
        if drafts:
            tokens += drafts
        kv_ids = self.kv.block_table(rid)
        seq = ScheduledSeq(rid, tokens, start, kv_ids, sampling, len(drafts) if drafts else 0)
        if (k := p.prompt_logprobs) is not None:  # each next prompt token
            seq.prompt_logprobs = k
            seq.prompt_targets = ids[start + 1 : min(end + 1, request.num_prompt_tokens)]
        return seq

    def update(
        self,
        plan: StepPlan,
        sampled: dict[str, int],
        extra: dict[str, list[int]] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> list[Request]:
        """Advance counters after a step; return the requests that got tokens.

        ``extra``, ``prompt_logprobs``: ``StepResult``'s. Requests that hit a token-level stop
        (EOS, stop token, max_tokens, the context limit) are finished here and
        their blocks freed; a stop cuts a row's tokens where one-token steps would.
        """
        out = []
        requests, now, limit = self.requests, self.clock(), self.max_model_len
        cache = self.kv.cache_computed_blocks if self.kv.pool.enable_caching else None
        for seq in plan.seqs:
            rid = seq.request_id
            request = requests.get(rid)
            if request is None or request.status is not RUNNING:
                continue  # aborted while the step ran
            if prompt_logprobs and seq.prompt_targets:
                record_prompt_logprobs(request, seq.start_pos, prompt_logprobs[rid])
            if seq.num_draft_tokens:
                tokens = [sampled[rid], *(extra or {}).get(rid, ())]
                self._accept(request, seq, tokens)
                out.append(request)
                continue
            request.num_computed_tokens += len(seq.token_ids)
            if cache is not None:
                cache(request)
            if seq.sampling is None:
                continue
            token = sampled[rid]
            request.append_token(token, now)
            out.append(request)
            reason = token_stop(request, token, limit)
            if reason is not None:
                self.finish(rid, *reason)
        return out

    def _accept(self, request: Request, seq: ScheduledSeq, tokens: list[int]) -> None:
        """Append a verifying row's tokens up to the first stop.

        KV is valid for the last token and each accepted draft, i.e. for every
        token but the newest; the rejected drafts' blocks past that go back.
        """
        self.spec.record(request.request_id, seq.num_draft_tokens, len(tokens) - 1)
        reason = None
        now = self.clock()
        for token in tokens:
            request.append_token(token, now)
            reason = token_stop(request, token, self.max_model_len)
            if reason is not None:
                break
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.trim(request, request.num_tokens)
        self.kv.cache_computed_blocks(request)
        if reason is not None:
            self.finish(request.request_id, *reason)

    def stop_at(self, request: Request, num_tokens: int, stop: str) -> None:
        """A stop string ended the request at its token ``num_tokens - 1``.

        Later tokens of the same step are dropped; if one of them already
        finished the request (EOS, length), the stop string is the reason now.
        """
        del request.token_ids[num_tokens:]
        del request.block_hashes[num_tokens // self.kv.block_size :]
        request.num_computed_tokens = min(request.num_computed_tokens, num_tokens - 1)
        if request.finished:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        else:
            self.finish(request.request_id, RequestStatus.FINISHED_STOPPED, stop)

    def finish(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> Request | None:
        """End a request in any state and free its blocks (idempotent)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.loading:  # its blocks go back when the step's loads end
            self.loading.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.reserved.pop(request_id, None)
        self.spec.forget(request_id)
        keep = status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        if request.hold_kv_on_finish and keep:
            self.held[request_id] = request
        else:
            self.kv.free(request)
        request.status = status
        request.stop_reason = stop_reason
        self._finished_since_last_step.append(request_id)
        return request

    def check_integrity(self) -> None:
        """Queues and block tables agree; raises AssertionError otherwise."""
        check_queues(self)
