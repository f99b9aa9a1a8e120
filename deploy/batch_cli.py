"""``pdserve batch``: the command line of :mod:`pdserve.batch`."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.core.errors import InvalidArgumentError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run an OpenAI Batch API file on a cluster (resumable)")
    p.add_argument("--input", required=True, help="JSONL of batch request lines")
    p.add_argument("--output", required=True, help="JSONL of results (appended; resumes)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the cluster's HTTP door")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--priority", type=int, default=-1, help="for lines that set none")
    p.add_argument("--retry-for-s", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    path = Path(args.input)
    if not path.is_file():
        raise InvalidArgumentError("--input", f"no such file: {path}")
    if args.concurrency < 1:
        raise InvalidArgumentError("--concurrency", "must be >= 1")
    url = urlsplit(args.url)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise InvalidArgumentError(
            "--url", f"must be http://HOST:PORT or https://..., got {args.url!r}"
        )
    if not args.retry_for_s >= 0:
        raise InvalidArgumentError("--retry-for-s", f"must be >= 0, got {args.retry_for_s}")
    from pdserve.batch import BatchRunner  # brings Ray: only when a batch runs

    runner = BatchRunner(args.url, args.api_key, args.concurrency, args.priority, args.retry_for_s)
    summary = asyncio.run(runner.run(path, Path(args.output), progress=not args.no_progress))
    print(
        f"{summary.lines} lines: {summary.succeeded} succeeded, {summary.failed} failed, "
        f"{summary.skipped} already done; {summary.retries} retries"
        + (
            f"; {summary.resent} sent again (an earlier run's server never ran them)"
            if summary.resent
            else ""
        )
        + (f"; errors {summary.errors}" if summary.errors else "")
    )
    return 0 if summary.failed == 0 else 1
