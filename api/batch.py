"""Batch jobs in the OpenAI Batch API line format: ``pdserve.batch``.

The runner lives with the HTTP front door (:mod:`pdserve.router.frontdoor.batch_runner`),
which also runs uploaded files as batches itself (``POST /v1/batches``); this is
its public name for clients and ``pdserve batch``.
"""

from pdserve.router.frontdoor.batch_runner import (
    BatchLine,
    BatchRunner,
    BatchSummary,
    error_record,
    finished_lines,
    parse_input,
)

__all__ = [
    "BatchLine",
    "BatchRunner",
    "BatchSummary",
    "error_record",
    "finished_lines",
    "parse_input",
]
