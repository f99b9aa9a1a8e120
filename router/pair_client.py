"""Drive requests through one prefill and one decode instance, to completion.

The smallest router: no regions or policies, just the request lifecycle over
actor handles and :mod:`pdserve.core.messages`. For each request, in order:

1. reserve pages on the decode instance (it may decide to prefill the request
   itself: short, or mostly cached there); when it is full the request waits
   for a running one to finish, then tries again;
2. otherwise ask the prefill instance to run the prompt into the reservation;
   its first token comes back before the pages finish moving;
3. collect the finished output from the decode instance; a request whose KV
   never reached it (the transfer failed: the decode instance ended it) runs
   again from step 1, prefilled on the decode instance this time.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import ray

from pdserve.core.errors import OverloadedError, PdserveError, TransferError
from pdserve.core.messages import FirstToken, PrefillRequest, ReserveRequest
from pdserve.core.request import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer

Work = tuple[str, list[int], SamplingParams]


class PairClient:
    def __init__(
        self,
        prefill: Any,
        prefill_id: str,
        decode: Any,
        tokenizer: Tokenizer | None,
        ttl_s: float = 30.0,
    ) -> None:
        self.prefill = prefill
        self.prefill_id = prefill_id
        self.decode = decode
        self.tokenizer = tokenizer
        self.ttl_s = ttl_s
        self._ids = itertools.count()

    def generate(self, work: list[Work], timeout_s: float = 600.0) -> list[RequestOutput]:
        deadline = time.monotonic() + timeout_s
        arrival = {rid: time.monotonic() for rid, _, _ in work}
        first_seen: dict[str, float] = {}
        first: dict[str, Any] = {}  # request id -> ObjectRef of its FirstToken
        refs: dict[Any, tuple[str, str]] = {}  # ObjectRef -> (kind, request id)
        done: dict[str, RequestOutput] = {}
        queue = list(work)
        here: set[str] = set()  # prefilled on decode: their KV transfer failed
        while queue or refs:
            while queue:
                rid, prompt, params = queue[0]
                request = ReserveRequest(rid, prompt, params, self.ttl_s, prefill_here=rid in here)
                try:
                    res = self._get(self.decode.reserve.remote(request, self.prefill_id, None))
                except OverloadedError:
                    if not any(kind == "done" for kind, _ in refs.values()):
                        raise
                    break  # full: wait for a running request to finish
                queue.pop(0)
                if not res.local:
                    first[rid] = self.prefill.prefill.remote(
                        PrefillRequest(rid, prompt, params, res)
                    )
                    refs[first[rid]] = ("first", rid)
                refs[self.decode.wait.remote([rid])] = ("done", rid)
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(f"{len(refs)} results missing after {timeout_s} s")
            kind, rid = refs.pop(ready[0])
            if kind == "first":
                first_seen[rid] = time.monotonic()
                continue
            if self._transfer_failed(first.get(rid)):  # recompute it on the decode instance
                del first[rid]
                here.add(rid)
                queue.append(next(w for w in work if w[0] == rid))
                continue
            done[rid] = self._finish(rid, ready[0], first.pop(rid, None), arrival[rid], first_seen)
        return [done[rid] for rid, _, _ in work]

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; both instances free its pages."""
        ray.get([self.decode.abort.remote(request_id), self.prefill.drop.remote(request_id)])

    def _finish(
        self, rid: str, wait_ref: Any, first_ref: Any, arrival: float, first_seen: dict[str, float]
    ) -> RequestOutput:
        (out,) = self._get(wait_ref)
        if first_ref is not None:
            token: FirstToken = self._get(first_ref)
            if token.finished:  # the first token ended it; decode dropped the reservation
                return self._first_only(rid, token, arrival)
        # Timings as this client saw them: TTFT includes queueing and the transfer path.
        first_time = first_seen.get(rid, out.metrics.first_token_time)
        out.metrics = RequestMetrics(
            arrival,
            first_time,
            time.monotonic(),
            out.metrics.num_cached_prompt_tokens,
            out.metrics.num_preemptions,
        )
        return out

    def _first_only(self, rid: str, token: FirstToken, arrival: float) -> RequestOutput:
        text = self.tokenizer.decode([token.token_id]) if self.tokenizer else ""
        now = time.monotonic()
        return RequestOutput(
            rid,
            None,
            [],
            [CompletionOutput(0, text, [token.token_id], token.finish_reason)],
            True,
            RequestMetrics(arrival, now, now),
        )

    @staticmethod
    def _transfer_failed(first_ref: Any) -> bool:
        """Whether a request's prefill ended with a failed KV transfer (its output is over)."""
        if first_ref is None:
            return False
        try:
            ray.get(first_ref)
        except ray.exceptions.RayTaskError as e:
            return isinstance(e.cause, TransferError)
        return False

    @staticmethod
    def _get(ref: Any) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, PdserveError):
                raise e.cause from None
            raise
