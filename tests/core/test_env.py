"""On/off switches in the environment: the three that pdserve reads take the
same words, and a value that is none of them keeps the default with a warning
(``PDSERVE_SHARE_WEIGHTS=off`` used to leave sharing on, unseen)."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from pdserve.core.env import OFF, ON
from pdserve.kernels import cpu_gemv
from pdserve.models.shared_weights import shareable
from pdserve.parallel import rank_spec
from tests.core.log_records import Records


def _readers() -> dict[str, object]:
    """Each switch and the call of the real code that reads it."""
    model = nn.Linear(2, 2)
    return {
        "PDSERVE_SHARE_WEIGHTS": lambda: shareable(model),
        "PDSERVE_SHM_COLLECTIVES": rank_spec.shm_enabled_by_env,
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


def test_a_cpu_rank_sizes_its_default_kv_pool_from_the_environment(monkeypatch, tiny_path) -> None:
    """``$PDSERVE_CPU_KV_CACHE_BYTES`` sets the pool of a CPU rank whose config names
    none; a config that names one wins; a value that is not a byte count keeps 256 MiB."""
    from pdserve.core.config import build_engine_config
    from pdserve.core.model_config import ModelConfig
    from pdserve.parallel.model_runner import CPU_KV_ENV, ModelRunner

    def blocks(**options: object) -> int:
        config = build_engine_config(str(tiny_path), device="cpu", **options)
        return ModelRunner(ModelConfig.from_dir(tiny_path), config).max_num_blocks()

    monkeypatch.delenv(CPU_KV_ENV, raising=False)
    per_block = (256 << 20) // blocks()
    monkeypatch.setenv(CPU_KV_ENV, str(32 << 20))
    assert blocks() == (32 << 20) // per_block
    assert blocks(kv_cache_memory_bytes=64 << 20) == (64 << 20) // per_block
    seen = Records()
    logging.getLogger("pdserve.core.env").addHandler(seen)
    try:
        for bad in ("32MiB", "0", "-5"):
            monkeypatch.setenv(CPU_KV_ENV, bad)
            assert blocks() == (256 << 20) // per_block, bad
    finally:
        logging.getLogger("pdserve.core.env").removeHandler(seen)
    assert f"${CPU_KV_ENV}='32MiB' is not a whole number of bytes above 0: 268435456 bytes" in (
        seen.messages
    )
