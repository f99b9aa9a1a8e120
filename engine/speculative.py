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
    rate: float = 1.0
    steps_since_probe: int = 0


class Speculator:
    """Proposes drafts for decoding requests and tracks how many are accepted."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        """``proposer``: the instance's draft model, needed by method "draft"."""
        self.config = config
        self.stats = SpeculationStats()
        self._tracks: dict[str, _Track] = {}
        self._model: ModelDrafter | None = None
        # The acceptance rate below which a draft model's drafting costs more than it
        # wins (see observe_step), from EWMAs of step times with and without drafts.
        self.draft_cost = 0.0
        self._times = {"pass": 0.0, "verify": 0.0, "plain": 0.0}
        self._fill: tuple[float, int] | None = None  # the last fill: (seconds, passes)
        self._steps = 0
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
        limit = min(
            budget,
            max_model_len - request.num_tokens,
            p.max_tokens - request.num_output_tokens - 1,
        )
        if limit <= 0 or request.num_output_tokens < p.min_tokens:
            return []  # tokens banned below min_tokens would differ per draft position
        track = self._tracks.setdefault(request.request_id, _Track())
        floor = self.config.min_acceptance  # 0: both per-request rules off
        if track.rate < (max(floor, self.draft_cost) if floor > 0 else 0.0):
            track.steps_since_probe += 1
            # A draft model's probe also reads every token since the last one: rarer.
            if track.steps_since_probe < (PROBE_EVERY if self._model is None else 4 * PROBE_EVERY):
                return []
            track.steps_since_probe = 0
        c = self.config
        k = min(limit, c.num_speculative_tokens)
        if self._model is not None:  # slots for now; fill() puts the draft model's tokens in
            return [PENDING] * min(k, self._model.limit(request))
        return propose_ngram(request.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)

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
        self._fill = (time.perf_counter() - start, max(len(d) for d in filled.values()))
        return filled

    def observe_step(self, seconds: float) -> None:
        """The target step just run took ``seconds``: update what drafting costs.

        A request drafting ``k`` tokens at acceptance rate ``r`` (accepted over
        proposed) gets ``1 + k r`` tokens from a step that costs, in plain steps,
        ``(verify + k pass) / plain``: the verifying step (longer than a plain one
        where extra tokens are not free) and ``k`` draft passes. Drafting pays
        while ``r`` is above ``((verify + k pass) / plain - 1) / k``; until a plain
        step was timed, a verifying step stands in for one (``r > pass / verify``).
        A request below ``draft_cost`` stops drafting (and probes every
        ``4 PROBE_EVERY`` steps) as it does below ``min_acceptance``; a
        ``min_acceptance`` of 0 turns both rules off.
        """
        if self._model is None or seconds <= 0:
            return
        t = self._times
        if self._fill is None:
            t["plain"] += EWMA_WEIGHT * (seconds - t["plain"]) if t["plain"] else seconds
            return
        took, passes = self._fill
        self._fill = None
        for name, value in (("verify", seconds), ("pass", took / max(passes, 1))):
            t[name] += EWMA_WEIGHT * (value - t[name]) if t[name] else value
        k = self.config.num_speculative_tokens
        plain = t["plain"] or t["verify"]
        # At least the passes alone (a verifying step is never cheaper than a plain
        # one; timed at other batch sizes, it may look so).
        floor = t["pass"] / t["verify"]
        self.draft_cost = max(((t["verify"] + k * t["pass"]) / plain - 1) / k, floor)

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A row verified ``proposed`` drafts and kept ``accepted`` of them."""
        self.stats.steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        track = self._tracks.setdefault(request_id, _Track())
        track.rate += EWMA_WEIGHT * (accepted / proposed - track.rate)

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
        if self._model is not None:
            self._model.forget(request_id)
