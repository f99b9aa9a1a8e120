"""The prefill-to-decode hand-off, and who owns each page at every moment.

One message, :class:`HandOff`, passes a request from the prefill instance to
the decode instance once every page of its prompt has been sent.

Page ownership through a request's life (P = the prefill instance's pages of
the request, D = the decode instance's reserved pages)::

    moment                          P (prefill pool)             D (decode pool)
    ---------------------------------------------------------------------------------
    router reserves on decode       -                            lease (TTL), no writer yet
    prefill runs chunk by chunk     prefill request (in use)     lease; prefill writes pages
    last chunk ran, pages landed    held by prefill              lease; no more writes
    HandOff sent                    held by prefill              lease
    decode commits the HandOff      held until the ack arrives   decode request (running)
    prefill gets the ack            freed, kept as prefix cache  decode request
    decode finishes or aborts       -                            freed (prefix cache)

    abort or lease expiry before commit:
        decode asks the prefill to drop the request and waits for its answer
        (so no write can land in a page after it is freed); a prefill that is
        gone writes nothing, so its leases are freed at once. The prefill
        frees P when it drops the request, or when a HandOff is refused.

Every transition is counted (:class:`~pdserve.transfer.stats.LeaseStats`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.core.layout import Layout
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import TokenLogprobs


@dataclass(frozen=True)
class HandOff:
    """Prefill -> decode: the prompt's KV is in your reserved pages; take the request.

    Attributes:
        request_id, prompt_token_ids, params: the request as the client sent it.
        first_token: the token the prefill sampled (already returned to the client).
        output_index: index of the next token to sample; with ``params.seed`` the
            decode instance continues the same seeded stream.
        block_ids: the decode pages the KV was written to (the reservation's).
        prefill_id, prefill_layout: who sent it, and how its ranks were laid out.
        prefilled_at: wall-clock time (``time.time()``) the prefill finished; the
            decode instance measures the exposed transfer time from it.
        first_logprobs: the first token's logprobs, when the request asked for them.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: int
    output_index: int
    block_ids: list[int]
    prefill_id: str
    prefill_layout: Layout
    prefilled_at: float = 0.0
    first_logprobs: TokenLogprobs | None = None  # the first token's, when asked for


@dataclass
class Lease:
    """Decode-side hold on reserved pages until they are committed or released."""

    request_id: str
    prefill_id: str | None
    deadline: float  # time.monotonic()
    revoking: bool = False


@dataclass
class LeaseTable:
    """Reservations of one decode instance, by request id."""

    leases: dict[str, Lease] = field(default_factory=dict)

    def add(self, request_id: str, prefill_id: str | None, ttl_s: float) -> Lease:
        lease = Lease(request_id, prefill_id, time.monotonic() + ttl_s)
        self.leases[request_id] = lease
        return lease

    def take(self, request_id: str) -> Lease | None:
        """Remove and return a lease that is still valid (not being revoked)."""
        lease = self.leases.get(request_id)
        if lease is None or lease.revoking:
            return None
        return self.leases.pop(request_id)

    def expired(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        return [x for x in self.leases.values() if not x.revoking and x.deadline <= now]

    def of_prefill(self, prefill_id: str) -> list[Lease]:
        return [x for x in self.leases.values() if x.prefill_id == prefill_id]
