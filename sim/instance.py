"""One simulated instance: the real engine scheduler, timed by a profile.

Each instance owns a real :class:`~pdserve.engine.scheduler.Scheduler` over a
real :class:`~pdserve.engine.kv_cache_manager.KVCacheManager` (continuous
batching, chunked prefill, token budget, preemption, prefix caching). Model
execution is replaced by the profile's step time; every sampled token is
:data:`TOKEN` and requests stop on length (``ignore_eos``).

A step: ``start(now)`` calls ``Scheduler.schedule`` and returns when the step
ends; ``complete()`` calls ``Scheduler.update``. A step that starts after the
instance sat idle, or while another instance on its host (``peers``) is
mid-step, takes the step model's ``live_time``; a model with noise
(``jitter``) times each step, or each run of steps, by its instance's next
factor (:class:`~pdserve.sim.jitter.Jitter`). In fast mode a slowed step runs
alone (a peer's step that starts during a run does not slow the run). On a host
of few cores (``host_cores``) the peers share the cores (processor sharing): a
step runs as many times slower as the busy peers' threads and its own exceed
the cores, re-timed whenever a peer's step starts or ends (``reshare``); such
instances run step by step.

In fast mode a step whose batch is decode only and cannot change by itself (no
prefill chunk, no preemption, nothing waiting that could be admitted, enough
free blocks) runs as a *run* of ``k`` steps: up to the first request that
finishes. An event that touches the instance mid-run (an arrival, a
reservation, a hand-off) first calls ``interrupt(now)``, which cuts the run at
the step in flight, so the batch changes at the same step boundary as in the
step-by-step mode. The
``k - 1`` later steps of a run apply what ``Scheduler.update`` would: slots,
``num_computed_tokens``, one token each, and the length stop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

from pdserve.core.config import SchedulerConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.messages import LoadReport
from pdserve.core.request import Request, RequestStatus
from pdserve.core.step import StepPlan
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.scheduler import Scheduler
from pdserve.router.state import InstanceView
from pdserve.sim.jitter import Jitter
from pdserve.sim.profile import MAX_SECONDS, StepFeatures, StepModel

TOKEN = 7  # every simulated sampled token (never an EOS: requests set ignore_eos)
EMA = 0.2  # weight of the newest step in the reported mean step time


class _Sampled(dict[str, int]):
    """What a simulated step sampled: :data:`TOKEN` for every row (no dict to build)."""

    def __missing__(self, request_id: str) -> int:
        return TOKEN


SAMPLED = _Sampled()


@dataclass
class InstanceStats:
    steps: int = 0
    busy_s: float = 0.0
    tokens: int = 0
    batch_sum: int = 0  # sum over steps of the batch size
    runs: int = 0  # schedule() calls (a fast-mode run counts once)


@dataclass
class StepDone:
    """What one step (or run of steps) produced."""

    end: float
    steps: int
    # request id -> new tokens; without per-token detail, only the requests whose
    # first token this is (a finished request's count is its output tokens)
    tokens: dict[str, int] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)  # filled when asked for (ITL)
    step_gaps: list[float] = field(default_factory=list)  # successive differences of those


class SimInstance:
    """A prefill or decode instance of one region in virtual time."""

    def __init__(
        self,
        instance_id: str,
        role: str,
        region: str,
        step_model: StepModel,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.role = role
        self.region = region
        self.step_model = step_model
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv, max_model_len, clock or (lambda: 0.0))
        self.view = InstanceView(instance_id, role, region, None, block_size, max_model_len)
        self.stats = InstanceStats()
        self.draining = False
        self.generation = 0  # bumps when the pending step's end moves
        self.kick_pending = False  # a "kick" event will start the next step
        self._plan: StepPlan | None = None
        self._start = 0.0
        self._end = 0.0
        self._steps = 1
        self._held = False  # the blocks of the run's later steps are taken
        self._seqs = 0
        self._context = 0
        self._mean_step = 0.0
        self._mean_tokens = 0.0
        self._idle_since = -float("inf")  # when the last step ended
        self.peers: list[SimInstance] = []  # the instances on its host (itself among them)
        self.host_cores = 0.0  # the cores the peers share (0: devices of its own)
        self.threads = 1  # the cores its ranks' threads would use
        self._crowded = 1.0  # how many times its time the step in flight takes
        self._slows = step_model.slows  # live_time can differ from time: read once
        self.seed_noise(0)
        self._factor = 1.0  # the step's (or run's) noise: sim.jitter
        self._quiet = 0.0  # the last step's (or run's) time without it

    def seed_noise(self, seed: int) -> None:
        """Take the ``seed``-th draws of the step noise (each seed, other draws)."""
        model = self.step_model
        self._jitter = Jitter(model.jitter, model.jitter_s, f"{self.instance_id}/{seed}")

    @property
    def busy(self) -> bool:
        return self._plan is not None

    @property
    def pending_end(self) -> float:
        return self._end

    def start(self, now: float, fast: bool) -> float | None:
        """Schedule the next step at ``now``; its end time, or None with nothing to run."""
        assert self._plan is None, "a step is already running"
        preemptions = self.scheduler.num_preemptions
        plan = self.scheduler.schedule()
        self.stats.runs += 1
        if plan.is_empty:
            return None
        model, steps = self.step_model, 1
        cold = shared = False
        if self._slows:
            cold = now - self._idle_since > model.cold_after_s
            shared = any(p.busy for p in self.peers if p is not self)
        crowding = self.crowding() if self.host_cores else 1.0
        alone = not (cold or shared or self.host_cores)  # a shared host: step by step
        if fast and alone and self.scheduler.num_preemptions == preemptions:
            steps = self._run_length(plan)  # a slowed step runs alone: only it is slower
        self._plan, self._start, self._steps, self._held = plan, now, steps, False
        self._seqs, self._context = len(plan.seqs), sum(s.start_pos for s in plan.seqs)
        if steps == 1:
            rows = [(len(s.token_ids), s.start_pos) for s in plan.seqs]
            duration = model.live_time(StepFeatures.of(rows), cold, shared)
        else:
            duration = model.decode_run_time(self._seqs, self._context, steps)
        if duration > MAX_SECONDS * steps:  # a model out of range would run for ever
            raise InvalidArgumentError(
                "step",
                f"{self.instance_id}: a step of {sum(len(s.token_ids) for s in plan.seqs)} "
                f"new tokens over {self._context} cached takes {duration / steps:.3g} s, past "
                f"the {MAX_SECONDS:g} s a simulated step may take: check the step model of "
                "the profile of its layout",
            )
        if self._jitter.sigma:
            elapsed = now - self._idle_since + self._quiet  # the quiet time since the last start
            self._factor, self._quiet = self._jitter.factor(elapsed), duration
        self._end, self._crowded = now + duration * self._factor * crowding, crowding
        return self._end

    def crowding(self) -> float:
        """How many times its time a step takes on the shared host now: the threads
        of the peers mid-step and its own over the host's cores (at least 1)."""
        busy = self.threads + sum(p.threads for p in self.peers if p.busy and p is not self)
        return max(1.0, busy / self.host_cores)

    def reshare(self, now: float) -> bool:
        """The step in flight goes on at the host's crowding from ``now`` (a peer's
        step started or ended): its end moves, True when it did (processor sharing;
        its ``generation`` bumps, the caller queues the new end)."""
        if self._plan is None or not self.host_cores:
            return False
        crowding = self.crowding()
        if crowding == self._crowded:
            return False
        self._end = now + (self._end - now) * crowding / self._crowded
        self._crowded = crowding
        self.generation += 1
        return True

    def _run_length(self, plan: StepPlan) -> int:
        """Steps the decode-only batch of ``plan`` runs unchanged (1: not such a batch)."""
        requests, limit = self.scheduler.requests, self.scheduler.max_model_len
        if not plan.seqs or len(plan.seqs) != len(self.scheduler.running):
            return 1
        k, longest = limit, 0  # steps until the first request finishes; the longest row
        for seq in plan.seqs:
            if len(seq.token_ids) != 1 or seq.sampling is None:
                return 1
            start = seq.start_pos  # the row's one token is its last: start + 1 tokens
            if start > longest:
                longest = start
            r = requests[seq.request_id]
            left = r.sampling_params.max_tokens + r.num_prompt_tokens - start - 1
            if left < k:
                k = left
        k = min(k, limit - longest - 1)  # and none reaches the context limit
        if k <= 1:
            return 1
        # Blocks the later steps need must be free now: nothing else frees any
        # (no request finishes before step k) and a shortfall would preempt.
        bs, free = self.kv.block_size, self.kv.num_free_blocks
        # Each row's table covers its token now, so k steps add at most this many blocks
        # to it: where all rows' worst case is free, so is the run (the common case).
        if len(plan.seqs) * ((k - 2) // bs + 1) <= free:
            return k
        remaining = [(s.start_pos, len(s.block_table)) for s in plan.seqs]

        def need(steps: int) -> int:
            return sum(max(0, -(-(c + steps) // bs) - held) for c, held in remaining)

        if need(k) <= free:
            return k
        lo, hi = 1, k - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def interrupt(self, now: float) -> bool:
        """Cut a fast-mode run at the step in flight at ``now``; True if the end moved.

        The caller is about to change this instance (a reservation may take free
        blocks), so the blocks of the steps still to run are taken now: the run
        was planned on the blocks free when it started.
        """
        if self._plan is None or self._steps == 1:
            return False
        cut = False
        if now < self._end:
            steps, elapsed = self.step_model.decode_step_end(
                self._seqs, self._context, (now - self._start) / self._factor
            )
            if steps < self._steps:
                self._steps, self._end, cut = steps, self._start + elapsed * self._factor, True
                self._quiet = elapsed  # the noise's clock: the run's time without it
                self.generation += 1
        self.hold_run_blocks()
        return cut

    def hold_run_blocks(self) -> None:
        """Take now the blocks the rest of a fast-mode run needs (it was planned on the
        blocks free when it started); the run itself goes on unchanged."""
        if self._plan is None or self._steps == 1 or self._held:
            return  # held already: a cut run needs no more than it had
        self._held = True
        requests, allocate, steps = self.scheduler.requests, self.kv.allocate_slots, self._steps
        bs = self.kv.block_size
        for seq in self._plan.seqs:  # a row's table is as schedule() left it
            if -(-(seq.start_pos + steps) // bs) > len(seq.block_table):
                ok = allocate(requests[seq.request_id], steps)
                assert ok, "a fast-mode run was planned with too few free blocks"

    def complete(self, want_step_ends: bool = False) -> StepDone:
        """Apply the finished step (or run) to the scheduler's state; ``want_step_ends``:
        per-token detail (every request's new tokens, and the step ends)."""
        plan, steps = self._plan, self._steps
        assert plan is not None
        self._plan, self._idle_since = None, self._end
        done = StepDone(self._end, steps)
        tokens, finished = done.tokens, done.finished
        for request in self.scheduler.update(plan, SAMPLED):
            if want_step_ends or len(request.token_ids) - request.num_prompt_tokens == 1:
                tokens[request.request_id] = 1
            if request.status.finished:
                finished.append(request)
        if steps > 1:
            self._apply_run(plan, steps - 1, done, want_step_ends)
        if want_step_ends:
            ends = done.step_ends = self._step_ends(steps)
            done.step_gaps = [t - s for s, t in pairwise(ends)]
        self._account(plan, steps)
        return done

    def _apply_run(self, plan: StepPlan, more: int, done: StepDone, count: bool) -> None:
        sched, kv = self.scheduler, self.kv
        requests, limit, tokens = sched.requests, sched.max_model_len, done.tokens
        held, caching, extra = self._held, kv.pool.enable_caching, [TOKEN] * more
        bs, end = kv.block_size, 1 + more  # a row's tokens in the KV cache: start + end
        for seq in plan.seqs:
            r = requests.get(seq.request_id)
            if r is None or r.status is not RequestStatus.RUNNING:
                continue
            # Held: the table covers the whole run already; else it is as schedule() left it.
            if not held and -(-(seq.start_pos + end) // bs) > len(seq.block_table):
                ok = kv.allocate_slots(r, more)
                assert ok, "a fast-mode run was planned with too few free blocks"
            r.num_computed_tokens += more
            ids = r.token_ids
            ids.extend(extra)
            if caching:
                kv.cache_computed_blocks(r)
            if count:
                tokens[r.request_id] += more  # update() gave it the run's first token
            n = len(ids)
            if n - r.num_prompt_tokens >= r.sampling_params.max_tokens or n >= limit:
                sched.finish(r.request_id, RequestStatus.FINISHED_LENGTH)
                done.finished.append(r)

    def _step_ends(self, steps: int) -> list[float]:
        if steps == 1:
            return [self._end]
        times = self.step_model.decode_step_times(self._seqs, self._context, steps)
        if self._factor != 1.0:
            times = [t * self._factor for t in times]
        out = list(accumulate(times, initial=self._start))[1:]
        out[-1] = self._end
        return out

    def _account(self, plan: StepPlan, steps: int) -> None:
        duration = self._end - self._start
        s = self.stats
        s.steps += steps
        s.busy_s += duration
        tokens = plan.num_tokens * steps
        s.tokens += tokens
        s.batch_sum += len(plan.seqs) * steps
        self._mean_step += EMA * (duration / steps - self._mean_step)
        self._mean_tokens += EMA * (tokens / steps - self._mean_tokens)

    def report(self) -> LoadReport:
        """The load report a live instance would push (no KV events)."""
        waiting = self.scheduler.waiting
        prompts = sum(r.num_tokens - r.num_computed_tokens for r in waiting) if waiting else 0
        return LoadReport(
            self.instance_id,
            self.role,
            waiting=len(waiting),
            running=len(self.scheduler.running),
            waiting_prompt_tokens=prompts,
            free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
            step_seconds=self._mean_step,
            step_tokens=self._mean_tokens,
        )

    @property
    def idle(self) -> bool:
        s = self.scheduler
        return self._plan is None and not (s.requests or s.held)
