"""What a row tells the sampling rank of its request's tokens, for penalties and schemas.

The rank keeps what it was sent (``parallel/penalties.py``, ``parallel/grammar.py``);
each row carries the rest. ``Request.penalty_seen_sent`` counts what was sent and
goes back to 0 when the ranks drop the request's state (a preemption).
"""

from __future__ import annotations

from pdserve.core.request import Request
from pdserve.core.step import RowSampling


def send_seen(request: Request, sampling: RowSampling, num_output: int) -> None:
    """What the sampling rank has not seen of the tokens a row's penalties and schema
    look at: the generated tokens (and the prompt before them: repetition penalty)."""
    p, ids = request.sampling_params, request.token_ids
    done = request.output_offset + num_output
    lead = len(ids) - done if p.repetition_penalty != 1 else 0
    sent, request.penalty_seen_sent = request.penalty_seen_sent, done + lead
    sampling.penalties, sampling.json_schema = p.penalties, p.json_schema
    sampling.num_seen_prompt, sampling.seen_from = lead, sent
    sampling.seen = ids[len(ids) - done - lead + sent :]
