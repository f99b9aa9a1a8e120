"""Reserving decode pages for one attempt, retried on other instances when refused.

    reserve(attempt, choice)
      the chosen pair left while the request waited  -> another placement in the region
      decode refused (full, or dead)  -> another decode of the region (retry budget)
      every decode of the region refused  -> another region, or ``OverloadedError``
    a caller cancelled mid-reservation: the pages are freed once the decode holds them

A decode instance's ``inflight`` counts the reservation from the choice on, so
requests placed while it is pending see it. :func:`cause_of` turns the error of
a Ray call into the pdserve error behind it (this module's and the attempt
lifecycle's in :mod:`pdserve.router.attempts`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import InstanceFailedError, OverloadedError, PdserveError
from pdserve.core.messages import Reservation, ReserveRequest
from pdserve.router.admission import RetryBudget
from pdserve.router.config import RouterConfig
from pdserve.router.placement import Choice, RegionChooser
from pdserve.router.state import ClusterView, InstanceView

if TYPE_CHECKING:
    from pdserve.router.attempts import Attempt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterParts:
    """The parts of one router that its attempts act through (runs on the router's loop)."""

    config: RouterConfig
    cluster: ClusterView
    chooser: RegionChooser
    retries: RetryBudget
    sink: Any  # the router's actor handle: decode instances push tokens to it
    unregister: Callable[[str], None]  # drops an instance found dead


class Reserver:
    """Reserves an attempt's decode pages on some pair; runs on the router's loop."""

    def __init__(self, parts: RouterParts, spawn: Callable[[Any], None]) -> None:
        self.parts = parts
        self.spawn = spawn  # runs a coroutine as a task the attempts keep

    async def reserve(
        self, attempt: Attempt, choice: Choice
    ) -> tuple[InstanceView | None, InstanceView, Reservation]:
        """The pair the attempt got and its decode's reservation; counts the decode's inflight.

        Raises ``OverloadedError`` or ``InstanceFailedError`` when the retry budget
        runs out; sets ``attempt.region`` when the attempt moves to another region.
        """
        refused: set[str] = set()
        full: set[str] = set()  # regions whose every decode instance refused
        while True:
            prefill, decode = choice.prefill, choice.decode
            if not self._usable(decode) or (prefill is not None and not self._usable(prefill)):
                choice = self._replace(attempt, choice)  # it left while the request waited
                continue
            if decode.instance_id in refused:  # the region is full: another one, or 429
                full.add(choice.region)
                choice = self.parts.chooser.choose(attempt.inp, frozenset(full))
                attempt.region = choice.region
                continue
            # Counted from the choice on, so arrivals placed before this reservation
            # returns see it (and spread).
            decode.inflight += 1
            self.parts.cluster.touch(decode)
            try:
                return prefill, decode, await self._reserve(attempt, choice)
            except BaseException as e:
                decode.inflight -= 1
                self.parts.cluster.touch(decode)
                if not isinstance(e, OverloadedError | InstanceFailedError):
                    raise
                if isinstance(e, InstanceFailedError):
                    self.parts.unregister(decode.instance_id)  # dead: the controller replaces it
                refused.add(decode.instance_id)
                if not self.parts.retries.try_spend():
                    raise
                choice = self._replace(attempt, choice)

    def _usable(self, view: InstanceView) -> bool:
        return self.parts.cluster.instances.get(view.instance_id) is view and view.available

    def _replace(self, attempt: Attempt, choice: Choice) -> Choice:
        """Another placement in the region; another region when its last decode is gone."""
        try:
            return self.parts.chooser.place(attempt.inp, choice.region, choice.hashes)
        except OverloadedError:
            choice = self.parts.chooser.choose(attempt.inp)
            attempt.region = choice.region
            return choice

    async def _reserve(self, attempt: Attempt, choice: Choice) -> Reservation:
        inp, prefill, decode = attempt.inp, choice.prefill, choice.decode
        request = ReserveRequest(
            attempt.attempt_id,
            inp.prompt_token_ids,
            inp.params,
            self.parts.config.reservation_ttl_s,
            attempt.offset,
            prefill_here=prefill is None,  # nobody would send the KV: decode computes it
            peer=self.parts.chooser.peer_prefix(choice),
        )
        attempt.peer = request.peer
        prefill_id = prefill.instance_id if prefill is not None else None
        ref = decode.handle.reserve.remote(request, prefill_id, self.parts.sink)
        pending = asyncio.wrap_future(ref.future())
        try:
            reservation: Reservation = await asyncio.shield(pending)
            return reservation
        except asyncio.CancelledError:  # the client left: free the pages once they are held
            self.spawn(self._release_late(pending, decode, attempt.attempt_id))
            raise
        except Exception as e:
            raise cause_of(e) from None

    async def _release_late(
        self, pending: asyncio.Future[Reservation], decode: InstanceView, attempt_id: str
    ) -> None:
        try:
            await pending
        except Exception:
            return  # refused or failed: nothing is held
        try:
            await decode.handle.abort.remote(attempt_id)
        except Exception:
            logger.info("abort of %s did not reach %s", attempt_id, decode.instance_id)


def cause_of(e: BaseException) -> BaseException:
    """The pdserve error behind a Ray error, or InstanceFailedError for a dead actor.

    A task's error comes back as a class that is both Ray's ``RayTaskError`` and the
    raised class, whose text is the remote traceback: the raised error itself is
    its ``cause``, and only that one's message is fit for a client."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, PdserveError):
        return cause
    if isinstance(e, PdserveError):
        return e
    if type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
        return InstanceFailedError(str(e))
    return e
