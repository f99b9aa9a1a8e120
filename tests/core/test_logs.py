"""Log levels: a bad one on the command line is refused by name; one in
$PDSERVE_LOG_LEVEL (read by every actor) falls back to INFO with a warning, so
it cannot kill the actors and with them the cluster's start."""

from __future__ import annotations

import logging

import pytest

from pdserve.core.logs import setup_logging
from pdserve.deploy.cli import main
from tests.core.log_records import Records


def test_an_unknown_level_in_the_environment_is_info_with_a_warning(monkeypatch) -> None:
    log, seen = logging.getLogger("pdserve"), Records()
    before = log.level
    log.addHandler(seen)
    try:
        monkeypatch.setenv("PDSERVE_LOG_LEVEL", "loud")
        setup_logging()
        assert log.level == logging.INFO
        assert any("log level 'LOUD' is not one of" in m for m in seen.messages)
        monkeypatch.setenv("PDSERVE_LOG_LEVEL", "debug")
        setup_logging()
        assert log.level == logging.DEBUG
    finally:
        log.setLevel(before)
        log.removeHandler(seen)


def test_an_unknown_level_on_the_command_line_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--log-level", "loud", "plan", "--help"])
    assert e.value.code == 2 and "argument --log-level: invalid choice: 'LOUD'" in (
        capsys.readouterr().err
    )
