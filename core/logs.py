"""Log setup for pdserve's processes (router, controller, instance ranks).

Every line about a request carries its id (a migrated request's later
attempts are ``<id>#1``, ``<id>#2``), so one ``grep <id>`` over the Ray
session's logs (``/tmp/ray/session_latest/logs/``) follows it through the
router, the prefill instance, the KV hand-off and the decode instance.
``$PDSERVE_LOG_LEVEL`` sets the level (default INFO).
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s"


def setup_logging(level: str | None = None) -> None:
    """Send pdserve's loggers to stderr (idempotent; for actor processes)."""
    log = logging.getLogger("pdserve")
    name = (level or os.environ.get("PDSERVE_LOG_LEVEL", "INFO")).upper()
    known = isinstance(logging.getLevelName(name), int)
    log.setLevel(name if known else "INFO")
    if not any(getattr(h, "pdserve", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.pdserve = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False
    if not known:  # an actor would die of it, and with it the cluster's start
        log.warning("log level %r is not one of DEBUG, INFO, WARNING, ERROR: INFO", name)
