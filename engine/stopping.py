"""Token-level stops of one request: EOS, stop token ids, ``max_tokens``, the context limit.

The scheduler asks after each token it appends; stop strings are matched on
text instead (``engine/detokenizer.py``) and cut through ``Scheduler.stop_at``.
"""

from __future__ import annotations

from pdserve.core.request import Request, RequestStatus


def token_stop(
    request: Request, token: int, max_model_len: int
) -> tuple[RequestStatus, int | None] | None:
    """Whether ``token``, just appended, ends ``request``: (status, stop reason) or None."""
    p = request.sampling_params
    num_tokens = len(request.token_ids)
    num_output = num_tokens - request.num_prompt_tokens
    if num_output >= p.min_tokens:
        if token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if num_output >= p.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
