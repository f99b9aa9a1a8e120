"""A command's options, typed: argparse's namespace stops at the command's handler.

A command line handler builds its options once, with :func:`options_from`, as a
frozen dataclass whose fields are named as the flags' ``dest`` (``--max-concurrency``
-> ``max_concurrency``); everything below the handler takes that dataclass. A field
whose type is itself a dataclass is a group of flags (the workload flags several
commands share) and is built from the same namespace (its name is no flag's). A field with a default may be
missing from the namespace (a command that has no such flag); one without a default
may not.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def options_from(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``cls`` (a dataclass) with each field taken from ``args`` by name, a group
    field built the same way; ``given`` fields are taken from there instead.

    Raises ``TypeError`` naming the fields ``args`` lacks that have no default.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    parsed = vars(args)
    values: dict[str, Any] = {}
    missing: list[str] = []
    for field in dataclasses.fields(cls):
        hint = hints.get(field.name)
        if not field.init:
            continue
        if field.name in given:
            values[field.name] = given[field.name]
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            values[field.name] = options_from(hint, args)
        elif field.name in parsed:
            values[field.name] = parsed[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            missing.append(field.name)
    if missing:
        raise TypeError(
            f"{cls.__name__} needs the option(s) {', '.join(missing)}, which the parsed "
            "flags do not hold: add the flag(s) to the command's parser, or a default"
        )
    return cls(**values)


def flat_options(options: object) -> dict[str, Any]:
    """The fields of a dataclass of options by name, in order, a group's fields in its
    place (the flags as the command line gave them)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(flat_options(value))
        else:
            out[field.name] = value
    return out
