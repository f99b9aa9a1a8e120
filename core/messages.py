"""Typed messages between the router and the prefill and decode instances.

They cross Ray actor boundaries (pickled dataclasses), so the router needs only
``pdserve.core`` to speak to instances. The life of a disaggregated request::

    router --ReserveRequest--> decode      -> Reservation (pages held under a lease)
    router --PrefillRequest--> prefill     -> FirstToken (as soon as it is sampled)
    prefill --pages, layer by layer--> decode's reserved pages   (pdserve.transfer)
    prefill --HandOff--> decode            -> the request joins decode's batch
    decode --TokenBatch per step--> router  (every new token of that router's requests)

A request short enough, or mostly cached on the decode instance, skips the
prefill instance: router --DecodeRequest--> decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.step import TokenLogprobs


@dataclass(frozen=True)
class PeerPrefix:
    """A prefill instance that holds, on its device, a longer prefix of the prompt.

    The router names it when the instance it chose for load lacks that prefix:
    the decode instance may take those pages from it over the KV connector and
    prefill only the rest itself, else the chosen prefill instance takes them
    (see :mod:`pdserve.transfer.peer_pull`).
    """

    prefill_id: str
    num_blocks: int  # leading blocks of the prompt it holds on its device


@dataclass(frozen=True)
class PeerExport:
    """Puller -> prefill peer: write your cached pages of these block hashes into my pages.

    ``block_ids`` are the puller's reserved pages, one per hash. The
    prefill instance sends the leading run of the hashes it still holds on its
    device, between two of its steps, and answers how many it sent.
    """

    request_id: str
    dest_id: str  # the instance that pulls (a decode or a prefill instance)
    block_hashes: list[bytes]
    block_ids: list[int]

    @property
    def transfer_id(self) -> str:
        """The pages' name on the wire: the reservation's own id ends before they are used."""
        return f"{self.request_id}/peer"


@dataclass(frozen=True)
class ReserveRequest:
    """Ask a decode instance to hold pages for a prompt that another instance prefills."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ttl_s: float = 30.0
    # A request moved from a failed instance: the last ``output_offset`` prompt
    # tokens were generated before; seeded sampling continues at that index.
    output_offset: int = 0
    # No prefill instance will send this prompt's KV (its region has none
    # available): the decode instance prefills it itself, whatever its length.
    prefill_here: bool = False
    # A prefill instance that holds more of the prompt on its device than the one
    # chosen to prefill it: the decode instance may take the prefix from it.
    peer: PeerPrefix | None = None


@dataclass(frozen=True)
class Reservation:
    """Pages a decode instance holds for one request until ``expires_at`` (monotonic, its clock).

    ``block_ids`` are the decode instance's physical pages covering the prompt;
    the first ``num_cached_tokens`` tokens (whole pages) are already cached
    there and need not be sent.
    """

    request_id: str
    decode_id: str
    block_ids: list[int]
    num_cached_tokens: int
    ttl_s: float
    # The decode instance chose to prefill the request itself (short prompt,
    # or mostly cached there): send it to no prefill instance.
    local: bool = False


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill a prompt; stream its KV into ``reservation`` (None: keep it local)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    reservation: Reservation | None = None
    output_offset: int = 0
    # A prefill instance that holds more of the prompt on its device: this one
    # pulls those pages from it first instead of computing them.
    peer: PeerPrefix | None = None


@dataclass(frozen=True)
class FirstToken:
    """The prefill's sampled token, sent back before the KV transfer completes.

    ``finished`` is set when the first token already ends the request (EOS,
    a stop token, ``max_tokens == 1``); no decode follows.
    """

    request_id: str
    token_id: int
    finished: bool
    finish_reason: str | None = None
    # Seconds spent in "prefill_queue" and "prefill" (see pdserve.core.metrics.PHASES).
    phases: dict[str, float] = field(default_factory=dict)
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    # Each prompt token's but the first, when the request asked (prompt_logprobs).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Leading prompt tokens the prefill found in its prefix cache (not computed).
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class DecodeRequest:
    """A whole request for a decode instance to prefill locally and decode."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class TokenUpdate:
    """New tokens of one request after a decode step (cumulative text is not resent)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    num_output_tokens: int = 0
    # On the last update: seconds in each phase this instance saw (transfer,
    # decode_queue, decode; prefill_queue and prefill when it prefilled itself).
    phases: dict[str, float] = field(default_factory=dict)
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    # With a request's first tokens, when this instance prefilled it and it asked.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # With a request's first tokens, when this instance prefilled it: the leading
    # prompt tokens it found in its prefix cache (None: another instance prefilled it).
    num_cached_tokens: int | None = None


@dataclass(frozen=True)
class TokenBatch:
    """Every update one instance produced for one router in one step."""

    instance_id: str
    updates: list[TokenUpdate] = field(default_factory=list)


@dataclass(frozen=True)
class LoadReport:
    """What an instance tells the routers about itself, every report interval.

    ``kv_added``/``kv_removed`` are the block hashes that entered or left this
    instance's prefix cache since the last report (its KV events); the router
    keeps an index of them to send a prompt where its prefix already is.
    """

    instance_id: str
    role: str
    waiting: int
    running: int
    waiting_prompt_tokens: int
    free_blocks: int
    num_blocks: int
    step_seconds: float  # recent mean duration of one engine step
    step_tokens: float  # recent mean tokens per step
    kv_added: list[bytes] = field(default_factory=list)
    kv_removed: list[bytes] = field(default_factory=list)
    # With KV tiers: blocks now held only below the device (host or disk), and
    # blocks back on the device; a peer serves only what is on its device.
    kv_lower: list[bytes] = field(default_factory=list)
    kv_device: list[bytes] = field(default_factory=list)
    healthy: bool = True


@dataclass(frozen=True)
class StepRecord:
    """One engine step as its instance ran it (``step_trace``): when it started
    (``time.monotonic``), how long the executor took, and per sequence the new
    tokens it computed and the cached tokens before them, the inputs of the
    simulator's step model (``pdserve.sim.profile.StepFeatures``)."""

    start_s: float
    seconds: float
    new_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
