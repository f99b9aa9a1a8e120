"""Speculative decoding: drafts, and when to stop proposing them.

Two ways to draft. ``ngram`` (prompt lookup): a decoding request's last ``n``
tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are
looked up in its own earlier tokens (prompt and output); the tokens that
followed their most recent earlier occurrence are the drafts. ``draft``: a
smaller model of the same vocabulary proposes them (``engine/draft.py``); the
scheduler reserves ``k`` slots per drafting request and, once the step's batch
is fixed, the draft model fills all of them in one batched call.

The scheduler schedules ``[last token] + drafts`` in one row; the rank
returns the target's tokens while they agree with the drafts, plus one more
(``Sampler.verify``), so a step yields between 1 and ``k + 1`` tokens.

KV of rejected drafts stays in the request's slots past ``num_computed_tokens``
and is overwritten by later steps; whole blocks past the request's tokens go
back to the pool after the step.

When it turns itself off:

- per step: a step with more than ``max_batch`` decoding requests drafts
  nothing. A verifying row costs ``k + 1`` tokens of compute; at a large batch
  the step is compute-bound and extra tokens cost time, while at a small batch
  the step's fixed cost dominates and the extra tokens are nearly free.
- per request: an exponentially weighted acceptance rate (accepted / proposed
  per verifying step, weight ``EWMA_WEIGHT`` on the newest) starts at 1. Below
  ``min_acceptance`` the request drafts only every ``PROBE_EVERY`` decode
  steps, so a request whose text turns repetitive again can come back.
- with a draft model, how many drafts (0 to ``k``) a request gets each step
  comes from what they cost and what they win (:meth:`Speculator.observe_step`,
  :func:`best_draft_length`): each draft position is accepted with the
  request's probability ``a`` once the ones before it were, so ``j`` drafts
  yield ``1 + a + ... + a^j`` tokens, against a step that costs the verified
  drafts and ``j`` passes of the draft model over a plain step. A request
  whose best length is 0 drafts nothing; one such row in ``4 PROBE_EVERY``
  probes with one draft, and probes grow rarer while drafting stays
  unprofitable. A new request starts from the instance's acceptance, so once
  an instance has learned that its draft does not pay, new requests do not pay
  for the draft reading their prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.core.config import SpeculativeConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.request import Request
from pdserve.engine.draft import PENDING, DraftProposer, ModelDrafter

EWMA_WEIGHT = 0.3  # weight of the newest verifying step in a request's acceptance rate
PROBE_EVERY = 8  # a request below min_acceptance drafts once per this many decode steps
PLAIN_EVERY = 16  # with a draft model, one step in this many drafts nothing (timed as plain)
MAX_PROBE_BACKOFF = 8  # a draft model's probes wait at most this many times their base interval
PRIOR_WEIGHT = 0.05  # weight of the newest verify in the instance's acceptance


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the tail n-gram.

    The longest tail (``n_max`` tokens) is tried first; a match must end before
    the tail itself. Empty when no tail of ``n_min..n_max`` tokens recurs.
    """
    total = len(token_ids)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        tail = token_ids[total - n :]
        first = tail[0]
        # Latest start i < total - n with token_ids[i : i + n] == tail.
        for i in range(total - n - 1, -1, -1):
            if token_ids[i] == first and token_ids[i : i + n] == tail:
                return token_ids[i + n : i + n + k]
    return []


@dataclass
class SpeculationStats:
    """What speculation did since the engine started."""

    steps: int = 0  # rows that verified drafts
    proposed: int = 0
    accepted: int = 0
    skipped_batches: int = 0  # steps that drafted nothing because the batch was large

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class _Track:
    """One request's acceptance and probing state."""

    rate: float = 1.0  # accepted / proposed (the min_acceptance rule)
    # Accepted drafts, and drafts tested (accepted plus the first rejected), per
    # verify: ``kept / tried`` is the chance that a draft position is accepted.
    kept: float = 1.0
    tried: float = 1.0
    steps_since_probe: int = 0

    def observe(self, proposed: int, accepted: int) -> None:
        self.rate += EWMA_WEIGHT * (accepted / proposed - self.rate)
        tried = accepted + (accepted < proposed)
        self.kept += EWMA_WEIGHT * (accepted - self.kept)
        self.tried += EWMA_WEIGHT * (tried - self.tried)

    @property
    def alpha(self) -> float:
        return self.kept / self.tried if self.tried > 0 else 1.0


def best_draft_length(alpha: float, k_max: int, draft_cost: float) -> int:
    """Drafts (0..``k_max``) that maximise tokens per unit of step time.

    ``j`` drafts, each accepted with probability ``alpha`` once the ones before
    it were, yield ``1 + alpha + ... + alpha^j`` tokens from a step costing
    ``1 + j draft_cost`` plain steps.
    """
    best, best_k, tokens, gain = 1.0, 0, 1.0, 1.0
    for k in range(1, k_max + 1):
        gain *= alpha
        tokens += gain
        value = tokens / (1.0 + k * draft_cost)
        if value > best:
            best, best_k = value, k
    return best_k


class Speculator:
    """Proposes drafts for decoding requests and tracks how many are accepted."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        """``proposer``: the instance's draft model, needed by method "draft"."""
        self.config = config
        self.stats = SpeculationStats()
        self._tracks: dict[str, _Track] = {}
        self._model: ModelDrafter | None = None
        # What one draft of a draft model costs, in plain steps (see observe_step),
        # from EWMAs of step times with and without drafts.
        self.draft_cost = 0.0
        self._times = dict.fromkeys(("pass", "verify", "plain", "drafts", "rows"), 0.0)
        # The last fill: (seconds, passes, drafts, rows).
        self._fill: tuple[float, int, int, int] | None = None
        self._steps = 0
        self._prior: _Track | None = None  # the instance's acceptance, over every request
        self._idle_rows = 0  # a draft model's rows that drafted nothing since its last probe
        self._probe_every = 0  # their probe interval now (0: the base)
        if config.method == "draft":
            if proposer is None:
                raise InvalidArgumentError(
                    "speculative_draft_model", "this executor loaded no draft model to run"
                )
            self._model = ModelDrafter(proposer)

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def batch_allowed(self, num_decoding: int) -> bool:
        """Whether a step with this many decoding requests drafts at all."""
        if not self.enabled:
            return False
        if num_decoding > self.config.max_batch:
            self.stats.skipped_batches += 1
            return False
        self._steps += 1  # a draft model's drafts are priced against a plain step, timed
        return self._model is None or self._steps % PLAIN_EVERY != 0  # now and then

    def propose(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """Drafts for one decoding request (may be empty).

        At most ``budget`` of them, and none past the context limit or past the
        request's ``max_tokens`` (the step's own token would be the last).
        """
        p = request.sampling_params
        c = self.config
        k = min(
            budget,
            max_model_len - request.num_tokens,
            p.max_tokens - request.num_output_tokens - 1,
            c.num_speculative_tokens,
        )
        if k <= 0 or request.num_output_tokens < p.min_tokens:
            return []  # tokens banned below min_tokens would differ per draft position
        track = self._track(request.request_id)
        if self._model is None:
            if c.min_acceptance > 0 and track.rate < c.min_acceptance and not self._probe(track):
                return []
            return propose_ngram(request.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        k = min(k, self._model.limit(request))
        if c.min_acceptance > 0 and k > 0:  # 0: both per-request rules off
            want = 0 if track.rate < c.min_acceptance else self._length(track, k)
            if want == 0 and not self._probe(track):
                return []
            if want:
                self._probe_every = 0  # drafting pays again: probes back to their base rate
            k = max(want, 1)  # slots for now; fill() puts the draft model's tokens in
        return [PENDING] * max(k, 0)

    def _track(self, request_id: str) -> _Track:
        track = self._tracks.get(request_id)
        if track is None:
            prior = self._prior
            track = _Track() if prior is None else _Track(kept=prior.alpha, tried=1.0)
            self._tracks[request_id] = track
        return track

    def _length(self, track: _Track, k: int) -> int:
        """A draft model's best draft count for this request (``k`` until timed)."""
        if not self._times["verify"]:
            return k
        return best_draft_length(track.alpha, k, self.draft_cost)

    def _probe(self, track: _Track) -> bool:
        """Whether a request that does not draft tries once now.

        With n-grams each such request tries every ``PROBE_EVERY`` steps. A
        draft model's probe also reads every token since the request's last
        one, so its probes are counted over the instance: one per
        ``4 PROBE_EVERY`` non-drafting rows, twice as rare after each probe
        while no request finds drafting worth it again.
        """
        if self._model is None:
            track.steps_since_probe += 1
            if track.steps_since_probe < PROBE_EVERY:
                return False
            track.steps_since_probe = 0
            return True
        base = 4 * PROBE_EVERY
        every = self._probe_every or base
        self._idle_rows += 1
        if self._idle_rows < every:
            return False
        self._idle_rows = 0
        self._probe_every = min(2 * every, MAX_PROBE_BACKOFF * base)
        return True

    def fill(
        self,
        drafts: dict[str, list[int]],
        requests: list[Request],
        block_table: Callable[[str], list[int]],
    ) -> dict[str, list[int]]:
        """The step's drafts once its batch is fixed (``requests``: every scheduled one).

        Method "draft" proposes every reserved slot in one batched call (see
        :meth:`ModelDrafter.fill`); n-gram drafts are returned as they are.
        """
        if self._model is None or not drafts:
            return drafts
        start = time.perf_counter()
        filled = self._model.fill(drafts, requests, block_table)
        lengths = [len(d) for d in filled.values() if d]
        self._fill = (time.perf_counter() - start, max(lengths), sum(lengths), len(lengths))
        return filled

    def observe_step(self, seconds: float) -> None:
        """The target step just run took ``seconds``: update what a draft costs.

        A step of ``R`` rows drafting ``j`` tokens each costs a plain step plus
        ``R j extra`` (verifying the drafts) plus ``j pass`` (the draft model's
        passes, shared by the rows), so one draft of one row costs
        ``(R extra + pass) / plain`` plain steps: :attr:`draft_cost`. Until a
        plain step was timed, a verifying step stands in for one (drafts then
        cost their passes only).
        """
        if self._model is None or seconds <= 0:
            return
        t = self._times
        if self._fill is None:
            _ewma(t, "plain", seconds)
            return
        took, passes, drafted, rows = self._fill
        self._fill = None
        _ewma(t, "verify", seconds)
        _ewma(t, "pass", took / max(passes, 1))
        _ewma(t, "drafts", float(drafted))
        _ewma(t, "rows", float(rows))
        plain = t["plain"] or t["verify"]
        extra = max(t["verify"] - plain, 0.0) / t["drafts"]  # verifying one draft
        self.draft_cost = (t["rows"] * extra + t["pass"]) / plain

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A row verified ``proposed`` drafts and kept ``accepted`` of them."""
        self.stats.steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self._track(request_id).observe(proposed, accepted)
        prior = self._prior = self._prior or _Track(kept=0.0, tried=0.0)
        tried = accepted + (accepted < proposed)
        prior.kept += PRIOR_WEIGHT * (accepted - prior.kept)
        prior.tried += PRIOR_WEIGHT * (tried - prior.tried)

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
        if self._model is not None:
            self._model.forget(request_id)


def _ewma(times: dict[str, float], name: str, value: float) -> None:
    old = times[name]
    times[name] = old + EWMA_WEIGHT * (value - old) if old else value
