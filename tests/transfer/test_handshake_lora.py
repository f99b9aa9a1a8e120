"""Prefill and decode instances must hold the same content under each adapter name both serve."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pdserve.core.layout import Layout
from pdserve.transfer.handshake import (
    IncompatibleInstancesError,
    KVSpec,
    adapter_fingerprints,
    check_compatible,
)

BASE = KVSpec("p0", "abc", "/models/a", "float32", 16, 4, 2, 8, Layout(1, 1, 1, ((0, 4),)))


def _adapter(folder: Path, alpha: int) -> str:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": alpha}))
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return str(folder)


def test_same_adapters_pass_and_a_different_one_is_refused(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", 8)
    b = _adapter(tmp_path / "b", 16)  # same weights, other scale: other content
    prefill = dataclasses.replace(BASE, lora_adapters=adapter_fingerprints((("sql", a),)))
    same = dataclasses.replace(prefill, instance_id="d0")
    check_compatible(prefill, same)

    changed = dataclasses.replace(same, lora_adapters=adapter_fingerprints((("sql", b),)))
    with pytest.raises(IncompatibleInstancesError, match="lora adapter 'sql': prefill p0 has "):
        check_compatible(prefill, changed)

    # Held by one side only (loaded at runtime on some instances): no mismatch;
    # the router places requests under it only where both hold it.
    check_compatible(prefill, dataclasses.replace(same, lora_adapters=()))
