"""What the engine reports for one request after a step (:class:`RequestOutput`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.core.request import CompletionOutput, Request, RequestMetrics, RequestOutput
from pdserve.core.step import TokenLogprobs
from pdserve.engine.detokenizer import IncrementalDetokenizer


def request_output(
    request: Request,
    prompt: str | None,
    detok: IncrementalDetokenizer,
    new_token_ids: list[int],
    new_logprobs: Sequence[TokenLogprobs],
) -> RequestOutput:
    """The request's output so far, with what this step added; a finished request's
    detokenizer is flushed. Logprobs only where its params asked for them."""
    finished = request.finished
    asked = request.sampling_params.logprobs is not None
    if finished:
        detok.finish(request.output_token_ids)
    new_text = detok.pop_new_text(finished)
    completion = CompletionOutput(
        index=0,
        text=detok.text,
        token_ids=request.output_token_ids,
        finish_reason=request.status.value if finished else None,
        stop_reason=request.stop_reason,
        logprobs=request.logprobs if asked else None,
    )
    metrics = RequestMetrics(
        arrival_time=request.arrival_time,
        first_token_time=request.first_token_time,
        finished_time=time.monotonic() if finished else None,
        num_cached_prompt_tokens=request.num_cached_prompt_tokens,
        num_preemptions=request.num_preemptions,
        first_scheduled_time=request.first_scheduled_time,
        activated_time=request.activated_time,
    )
    return RequestOutput(
        request_id=request.request_id,
        prompt=prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        metrics=metrics,
        new_token_ids=new_token_ids,
        new_text=new_text,
        new_logprobs=list(new_logprobs) if asked else None,
        prompt_logprobs=_prompt_logprobs(request),
    )


def _prompt_logprobs(request: Request) -> list[TokenLogprobs | None] | None:
    """None for the first prompt token, then each one's; None unless asked."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    return [None, *request.prompt_logprobs]


def record_prompt_logprobs(request: Request, start: int, entries: list[TokenLogprobs]) -> None:
    """Keep a chunk's prompt logprobs (the chunk's tokens from ``start`` on predict the
    prompt tokens from ``start + 1``); a chunk recomputed after a preemption adds nothing."""
    have = len(request.prompt_logprobs)
    if start <= have:
        request.prompt_logprobs += entries[have - start :]
