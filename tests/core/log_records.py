"""A logging handler that keeps each record's message, for tests of what is logged
(pdserve's loggers may not propagate to pytest's caplog once setup_logging ran)."""

from __future__ import annotations

import logging


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
