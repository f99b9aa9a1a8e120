"""The compatibility handshake refuses what would give wrong output, naming both sides."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.layout import Layout
from pdserve.transfer.handshake import (
    IncompatibleInstancesError,
    KVSpec,
    check_compatible,
    model_fingerprint,
)

LAYOUT = Layout(1, 1, 1, ((0, 4),))
BASE = KVSpec("p0", "abc", "/models/a", "float32", 16, 4, 2, 8, LAYOUT)


def test_same_model_different_layouts_pass() -> None:
    other = dataclasses.replace(BASE, instance_id="d0", layout=Layout(2, 2, 1, ((0, 2), (2, 4))))
    check_compatible(BASE, other)


def test_afd_layouts_pass_and_the_kv_shape_still_counts() -> None:
    """An afd side (attention ranks 0..A-1, expert ranks after them) pairs with any layout."""
    afd = dataclasses.replace(BASE, instance_id="d0", layout=Layout(2, 1, 1, ((0, 4),), 2))
    check_compatible(BASE, afd)
    check_compatible(afd, BASE)
    with pytest.raises(IncompatibleInstancesError, match="head_dim: prefill p0 has 8"):
        check_compatible(BASE, dataclasses.replace(afd, head_dim=16))


@pytest.mark.parametrize(
    ("field", "value", "text"),
    [
        ("dtype", "bfloat16", "dtype: prefill p0 has float32, decode d0 has bfloat16"),
        ("block_size", 32, "block_size: prefill p0 has 16, decode d0 has 32"),
        ("quantization", "int8", "quantization: prefill p0 has none, decode d0 has int8"),
        (
            "model_fingerprint",
            "zzz",
            "model: prefill p0 has /models/a (abc), decode d0 has /models/a (zzz)",
        ),
    ],
)
def test_mismatch_is_refused_with_both_values(field: str, value, text: str) -> None:
    decode = dataclasses.replace(BASE, instance_id="d0", **{field: value})
    with pytest.raises(IncompatibleInstancesError) as err:
        check_compatible(BASE, decode)
    assert text in str(err.value)


def test_int8_prefill_and_float_decode_are_refused_with_the_reason() -> None:
    prefill = dataclasses.replace(BASE, quantization="int8")
    decode = dataclasses.replace(BASE, instance_id="d0")
    with pytest.raises(IncompatibleInstancesError) as err:
        check_compatible(prefill, decode)
    assert str(err.value) == (
        "cannot transfer KV pages; quantization: prefill p0 has int8, decode d0 has none"
    )
    check_compatible(prefill, dataclasses.replace(decode, quantization="int8"))


def test_fingerprint_tells_checkpoints_apart(reference_models) -> None:
    a, b = reference_models("llama"), reference_models("qwen2")
    assert model_fingerprint(a) == model_fingerprint(a)
    assert model_fingerprint(a) != model_fingerprint(b)
