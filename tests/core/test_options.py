"""A command's options are built from argparse's namespace by field name."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from pdserve.core.options import flat_options, options_from


@dataclass(frozen=True)
class Group:
    seed: int = 0
    rate: float | None = None


@dataclass(frozen=True)
class Command:
    target: str
    group: Group = field(default_factory=Group)
    out: str = "out"


def test_fields_are_taken_by_name_and_a_group_from_the_same_flags() -> None:
    args = argparse.Namespace(target="x", seed=3, rate=2.0, out="o", func=print, command="c")
    got = options_from(Command, args)
    assert got == Command("x", Group(3, 2.0), "o")
    assert flat_options(got) == {"target": "x", "seed": 3, "rate": 2.0, "out": "o"}
    assert options_from(Command, args, out="given").out == "given"


def test_a_missing_flag_takes_its_default_and_one_without_a_default_is_named() -> None:
    assert options_from(Command, argparse.Namespace(target="x")) == Command("x")
    with pytest.raises(TypeError, match=r"Command needs the option\(s\) target"):
        options_from(Command, argparse.Namespace(seed=1))
