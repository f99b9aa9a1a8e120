"""On/off switches in the environment: the three that pdserve reads take the
same words, and a value that is none of them keeps the default with a warning
(``PDSERVE_SHARE_WEIGHTS=off`` used to leave sharing on, unseen)."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from pdserve.core.env import OFF, ON
from pdserve.distributed import shm_comm
from pdserve.kernels import cpu_gemv
from pdserve.models.shared_weights import shareable
from tests.core.log_records import Records


def _readers() -> dict[str, object]:
    """Each switch and the call of the real code that reads it."""
    model = nn.Linear(2, 2)
    return {
        "PDSERVE_SHARE_WEIGHTS": lambda: shareable(model),
        "PDSERVE_SHM_COLLECTIVES": shm_comm.shm_enabled_by_env,
        # False where this host cannot build the kernel; then only "off" is checked
        cpu_gemv.ENV_SWITCH: cpu_gemv.available,
    }


@pytest.mark.parametrize("name", list(_readers()))
def test_every_switch_takes_the_same_words(monkeypatch, name: str) -> None:
    read = _readers()[name]
    monkeypatch.delenv(name, raising=False)
    default = read()  # type: ignore[operator]
    for word in OFF + tuple(w.upper() for w in OFF) + (" off ",):
        monkeypatch.setenv(name, word)
        assert read() is False, word  # type: ignore[operator]
    for word in (*ON, "On", ""):
        monkeypatch.setenv(name, word)
        assert read() is default, word  # type: ignore[operator]
    seen = Records()
    logging.getLogger("pdserve.core.env").addHandler(seen)  # "pdserve" may not propagate
    try:
        monkeypatch.setenv(name, "of")
        assert read() is default  # type: ignore[operator]
    finally:
        logging.getLogger("pdserve.core.env").removeHandler(seen)
    assert f"${name}='of' is not one of 1/true/yes/on/0/false/no/off: on" in seen.messages
