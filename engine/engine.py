"""The engine core: scheduler + executor + detokenizer, one step at a time.

    add_request ──> Scheduler.waiting ──schedule──> StepPlan ──Executor──> sampled tokens
                                                                               │
    RequestOutput <── detokenize, stop strings <── Scheduler.update <──────────┘

It holds no threads, sockets or Ray handles: the offline API loops ``step()``
until nothing is left; prefill and decode instances wrap the same object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from pdserve.core.config import EngineConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.messages import LoadReport
from pdserve.core.model_config import ModelConfig
from pdserve.core.request import (
    Request,
    RequestOutput,
    RequestStatus,
)
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.snapshot import KVTierCounters, SpeculationCounters
from pdserve.core.step import KVSend, StepPlan, StepResult, TokenLogprobs
from pdserve.core.tokenizer import Tokenizer
from pdserve.engine.adapters import AdapterSet, ServedAdapter
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.executor import Executor
from pdserve.engine.isolation import execute_isolating
from pdserve.engine.kv_cache_manager import KVCacheManager, resolve_max_model_len
from pdserve.engine.kv_tiers import TIERS
from pdserve.engine.outputs import request_output
from pdserve.engine.role import COLOCATED, RolePolicy
from pdserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    """Runs requests to completion over one executor."""

    def __init__(
        self,
        config: EngineConfig,
        model: ModelConfig,
        executor: Executor,
        tokenizer: Tokenizer | None,
    ) -> None:
        self.config = config
        self.model = model
        self.executor = executor
        self.tokenizer = tokenizer
        num_blocks = executor.num_kv_blocks
        self.max_model_len = resolve_max_model_len(
            config, model.max_position_embeddings, num_blocks
        )
        self.kv = KVCacheManager.from_config(config.cache, num_blocks, executor.tier_slots)
        self.adapters = AdapterSet(
            config, executor.adapter_fingerprints()
        )  # LoRA adapters served now (engine/adapters.py)
        self.kv.adapter_salt = self.adapters.salt
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            self.max_model_len,
            speculative=config.speculative,
            proposer=executor.draft_proposer,
        )
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self.eos_token_ids = model.eos_token_ids or (tokenizer.eos_token_ids if tokenizer else ())
        self.role = COLOCATED  # what a serving role changes in each step (engine/role.py)
        self.last_step_tokens = 0
        # This step's plan, time.monotonic() start and seconds; None when it ran nothing.
        self.last_step: tuple[StepPlan, float, float] | None = None

    def use_role(self, role: RolePolicy) -> None:
        """Serve as ``role`` from the next step on (a server starting on this engine;
        ``COLOCATED`` when its role ends)."""
        self.role = role

    # -- requests in --------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        hold_kv: bool = False,
        output_offset: int = 0,
    ) -> None:
        """Validate and queue one request; raises InvalidArgumentError naming the field.

        With ``hold_kv`` the request keeps its blocks when it finishes, until
        :meth:`release` (a prefill instance waiting for decode's acknowledgement).
        """
        request = self._new_request(request_id, prompt, params, arrival_time)
        request.hold_kv_on_finish = hold_kv
        request.output_offset = output_offset
        self.scheduler.add_request(request)
        self._track(request, prompt)

    def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, output_offset: int = 0
    ) -> tuple[list[int], int] | None:
        """Decode role: hold pages for a prompt prefilled elsewhere.

        Returns (block ids, tokens already cached here) or None when full.
        """
        request = self._new_request(request_id, prompt, params, None)
        request.output_offset = output_offset
        cached = self.scheduler.reserve(request)
        if cached is None:
            return None
        self._track(request, prompt)
        return self.kv.block_table(request_id), cached

    def activate(
        self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Decode role: the reserved prompt's KV has landed; decode from ``first_token``
        (``logprobs``: its entry, sampled on the prefill instance)."""
        request = self.scheduler.activate(request_id, first_token)
        stop = self._detok[request_id].update([first_token])
        if stop is not None:  # the first token completed a stop string
            self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED, stop)
        new = (
            [logprobs]
            if logprobs is not None and request.sampling_params.logprobs is not None
            else []
        )
        request.logprobs += new
        return self._output(request, [first_token], new)

    def cached_prefix_tokens(
        self, token_ids: list[int], params: SamplingParams | None = None
    ) -> int:
        """Leading tokens of a prompt whose KV is already cached here (whole blocks),
        for a request with ``params`` (its LoRA adapter names the chain)."""
        probe = Request("probe", token_ids, params or SamplingParams(), ())
        return len(self.kv.find_cached_prefix(probe)) * self.kv.block_size

    def load_report(
        self, instance_id: str, role: str, step_seconds: float, step_tokens: float
    ) -> LoadReport:
        """This engine's load and KV events since the last report."""
        sched = self.scheduler
        events = self.kv.drain_events()
        return LoadReport(
            instance_id,
            role,
            waiting=len(sched.waiting),
            running=len(sched.running),
            waiting_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
            free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
            step_seconds=step_seconds,
            step_tokens=step_tokens,
            kv_added=events.added,
            kv_removed=events.removed,
            kv_lower=events.lower,
            kv_device=events.device,
        )

    def spec_counters(self) -> SpeculationCounters | None:
        """What speculative decoding did since start (None when it is off)."""
        spec = self.scheduler.spec
        if not spec.enabled:
            return None
        s = spec.stats
        return SpeculationCounters(s.proposed, s.accepted, s.steps, s.skipped_batches)

    def tier_counters(self) -> KVTierCounters | None:
        """What the KV tiers did since start (None without tiers)."""
        tiers = self.kv.tiers
        if tiers is None:
            return None
        moved, seconds = self.executor.tier_io()
        c = tiers.counters
        blocks = {name: tiers.num_blocks(name) for name in TIERS if tiers.capacity(name)}
        return KVTierCounters(dict(c.hits), c.misses, c.failed_loads, blocks, moved, seconds)

    def load_adapter(self, name: str, folder: str) -> ServedAdapter:
        """Serve the PEFT LoRA adapter in ``folder`` as ``name`` from the next step on."""
        return self.adapters.load(self.executor, name, folder)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; refused (409, naming how many) while requests use it."""
        users = sum(r.sampling_params.lora == name for r in self.scheduler.requests.values())
        self.adapters.unload(self.executor, name, users)

    def release(self, request_id: str) -> bool:
        """Prefill role: free a finished request's held blocks (kept as prefix cache)."""
        return self.scheduler.release(request_id)

    def _new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival: float | None,
    ) -> Request:
        token_ids = self.tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidArgumentError(
                "prompt",
                f"{len(token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}",
            )
        params.check_vocab(self.model.vocab_size)
        self.adapters.check(params.lora)
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError("stop", "stop strings need a model with a tokenizer")
        layout = self.config.parallel
        if params.prompt_logprobs is not None and (layout.pipeline_parallel_size > 1 or layout.afd):
            raise InvalidArgumentError(
                "prompt_logprobs", "not computed by pipeline or afd instances"
            )
        return Request(request_id, token_ids, params, self.eos_token_ids, arrival)

    def _track(self, request: Request, prompt: str | list[int]) -> None:
        self._detok[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params
        )
        self._prompts[request.request_id] = prompt if isinstance(prompt, str) else None

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError(
                    "prompt", "this model has no tokenizer.json: pass token ids instead of text"
                )
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            token_ids = list(prompt)
            for t in token_ids:
                if (
                    isinstance(t, bool)
                    or not isinstance(t, int)
                    or not 0 <= t < self.model.vocab_size
                ):
                    raise InvalidArgumentError(
                        "prompt_token_ids",
                        f"each id must be an integer in [0, {self.model.vocab_size}), got {t!r}",
                    )
        else:
            raise InvalidArgumentError(
                "prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not token_ids:
            raise InvalidArgumentError("prompt", "must not be empty")
        return token_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is and free its blocks; None if unknown."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self._output(request, [])

    # -- the step ------------------------------------------------------------

    def is_idle(self) -> bool:
        """No request queued, running, reserved or holding pages."""
        s = self.scheduler
        return not (s.requests or s.held)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and post-process one batch; outputs for requests that moved."""
        self.last_step = None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if self.adapters:  # each row runs under its request's adapter
            plan = plan.with_lora(self._adapter_of)
        role = self.role  # one policy for the whole step, even if a flip swaps it meanwhile
        if role.plan is not None:
            plan = role.plan(plan)
        self.last_step_tokens = plan.num_tokens
        started, start = time.monotonic(), time.perf_counter()
        result, failed = self._execute(plan)
        self.last_step = (plan, started, time.perf_counter() - start)
        self.scheduler.spec.observe_step(self.last_step[2])
        if not result.kv_transfer_ok and role.on_transfer_failure is not None:
            role.on_transfer_failure(plan)
        self.scheduler.loads_done(plan, result.loads_ok)
        outputs = [out for rid in failed if (out := self._fail(rid)) is not None]
        requests = self.scheduler.requests
        before = {
            s.request_id: r.num_tokens for s in plan.seqs if (r := requests.get(s.request_id))
        }
        updated = self.scheduler.update(plan, result.sampled, result.extra, result.prompt_logprobs)
        for request in updated:
            new = request.token_ids[before[request.request_id] :]
            kept = self._detokenize(request, new)
            logprobs: list[TokenLogprobs] = []  # most steps: no row asked for them
            if result.logprobs and (got := result.logprobs.get(request.request_id)):
                logprobs = got[: len(kept)]
                request.logprobs += logprobs
            outputs.append(self._output(request, kept, logprobs))
        return outputs

    def _adapter_of(self, request_id: str) -> str | None:
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.sampling_params.lora

    def _detokenize(self, request: Request, new: list[int]) -> list[int]:
        """Feed a step's new tokens to the request's stop strings, one at a time.

        A stop string completed by one token ends the request there: tokens the
        step yielded after it (accepted drafts) are dropped. Returns the tokens kept.
        """
        detok = self._detok[request.request_id]
        for i, token in enumerate(new):
            stop = detok.update([token])
            if stop is not None and (not request.finished or i + 1 < len(new)):
                self.scheduler.stop_at(request, request.num_tokens - (len(new) - i - 1), stop)
                return new[: i + 1]
        return new

    def _execute(self, plan: StepPlan) -> tuple[StepResult, list[str]]:
        tiers = self.kv.tiers
        return execute_isolating(self.executor, plan, tiers.forget_writes if tiers else None)

    def export_pages(self, sends: list[KVSend]) -> bool:
        """Send cached pages to peers between steps, with no forward; True once all landed.

        The caller holds the source pages unchanged meanwhile (it runs on the
        engine's loop, so no step can evict them).
        """
        plan = StepPlan(0, [], kv_sends=sends)  # step 0: no scheduled step
        return self.executor.execute(plan).kv_transfer_ok

    def _fail(self, request_id: str) -> RequestOutput | None:
        """End a request whose step raised; its blocks are freed, never held."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ERROR, "engine error")
        return None if request is None else self._output(request, [])

    def generate(
        self,
        requests: list[tuple[str, str | list[int], SamplingParams]],
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run ``(request_id, prompt, params)`` to completion; outputs in the given order.

        All requests are validated before any is queued; if anything fails
        midway, every request of the batch is aborted so no block stays held.
        """
        for _, prompt, _ in requests:
            self.tokenize(prompt)
        done: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, params in requests:
                self.add_request(rid, prompt, params)
            while len(done) < len(requests):
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
                        if on_finished is not None:
                            on_finished(out)
        finally:
            for rid, _, _ in requests:
                if rid not in done:
                    self.abort_request(rid)
        return [done[rid] for rid, _, _ in requests]

    def _output(
        self, request: Request, new_token_ids: list[int], new_logprobs: Sequence[TokenLogprobs] = ()
    ) -> RequestOutput:
        rid = request.request_id
        out = request_output(
            request, self._prompts[rid], self._detok[rid], new_token_ids, new_logprobs
        )
        if request.finished:
            del self._detok[rid]
            del self._prompts[rid]
        return out

    def check_integrity(self) -> None:
        """Scheduler queues, block tables and the block pool agree (AssertionError if not)."""
        self.scheduler.check_integrity()
        assert set(self._detok) == set(self.scheduler.requests)

    def assert_idle(self) -> None:
        """No request is left and every KV block is back in the pool."""
        self.check_integrity()
        assert not self.has_unfinished_requests()
        assert not self.scheduler.held, f"held blocks not released: {sorted(self.scheduler.held)}"
        self.kv.assert_empty()

    def shutdown(self) -> None:
        self.executor.shutdown()
