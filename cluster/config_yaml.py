"""Reading the cluster config's YAML: values with the line each field came from.

:func:`to_python` turns a composed YAML node into plain dicts, lists and
scalars while recording, in a :class:`Lines`, the line of every field path
(``regions[0].prefill.count``). The checks here (a section must be a mapping
or a list, a field must be known to its dataclass, a value must have its type,
a number must be finite)
raise errors through :meth:`Lines.error`, which puts ``file:line:`` in front of
the field. :mod:`pdserve.cluster.config` builds the config from these values.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import yaml

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.frontdoor.auth import check_keys


class Lines:
    """Field path -> line in the YAML file, for error messages."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: dict[str, int] = {}

    def error(self, path: str, message: str) -> InvalidArgumentError:
        line = self.lines.get(path)
        where = f"{self.source}:{line}: " if line is not None else f"{self.source}: "
        err = InvalidArgumentError(path, message)
        err.args = (where + str(err),)
        return err


def to_python(node: yaml.Node, path: str, lines: Lines) -> Any:
    lines.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key, value in node.value:
            name = str(key.value)
            sub = f"{path}.{name}" if path else name
            lines.lines[sub] = key.start_mark.line + 1
            out[name] = to_python(value, sub, lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [to_python(v, f"{path}[{i}]", lines) for i, v in enumerate(node.value)]
    if node.tag == "tag:yaml.org,2002:null":
        return None  # an empty value (``models:`` with nothing under it)
    value = yaml.safe_load(yaml.serialize(node))
    if isinstance(value, float) and not math.isfinite(value):
        # no setting means anything by .nan or .inf, and a NaN passes every "> 0" check
        raise lines.error(path, f"must be a finite number, got {value}")
    return value


def typed(value: Any, kind: type, field: str, lines: Lines) -> Any:
    """``value`` as ``kind`` (an int is a float too; a bool is never a number; a
    quoted number, as templates write them, is its number)."""
    if kind is bool and isinstance(value, bool):
        return value
    if kind in (int, float) and isinstance(value, str):
        try:
            value = kind(value.strip())
        except ValueError:
            pass  # refused below, as a string
        else:
            if not math.isfinite(value):
                raise lines.error(field, f"must be a finite number, got {value}")
            return value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and (kind is float or (kind is int and float(value).is_integer())):
        return kind(value)
    if kind is str and isinstance(value, str):
        return value
    hint = ""
    if kind is str and isinstance(value, bool):  # YAML reads on/off/yes/no as booleans
        hint = f" (YAML read an unquoted word as {value}: quote it)"
    raise lines.error(field, f"must be {'an' if kind is int else 'a'} {kind.__name__}{hint}")


def get_map(raw: dict[str, Any], key: str, lines: Lines, parent: str = "") -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise lines.error(f"{parent}.{key}" if parent else key, "must be a mapping")
    return value


def get_list(raw: dict[str, Any], key: str, lines: Lines) -> list[Any]:
    value = raw.get(key) or []
    if not isinstance(value, list):
        raise lines.error(key, "must be a list")
    return value


def known_fields(values: dict[str, Any], cls: type, prefix: str, lines: Lines) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise lines.error(f"{prefix}.{key}", f"unknown field (known: {sorted(names)})")
    return values


def typed_fields(values: dict[str, Any], cls: type, prefix: str, lines: Lines) -> dict[str, Any]:
    """:func:`known_fields`, each value of a number, bool or str field of ``cls``
    checked for its type (None where the field is optional): a dataclass's own
    checks compare numbers, and ``"abc" > 0`` raised a TypeError from them."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in known_fields(values, cls, prefix, lines).items():
        kind, optional = scalar_kind(hints[key])
        if kind is None or (value is None and optional):
            out[key] = value
        else:
            out[key] = typed(value, kind, f"{prefix}.{key}", lines)
    return out


def scalar_kind(hint: Any) -> tuple[type | None, bool]:
    """(int, float, bool or str, or None for other types; whether None is allowed)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    scalar = len(kinds) == 1 and kinds[0] in (int, float, bool, str)
    return (kinds[0] if scalar else None), len(kinds) < len(args)


def typed_map(
    raw: dict[str, Any], key: str, kind: type, parent: str, lines: Lines
) -> dict[str, Any]:
    """The mapping at ``raw[key]``, each value of type ``kind`` (names: strings)."""
    where = f"{parent}.{key}"
    return {
        str(k): typed(v, kind, f"{where}.{k}", lines)
        for k, v in get_map(raw, key, lines, parent).items()
    }


def api_key_entries(
    auth: dict[str, Any], lines: Lines
) -> list[tuple[str, int | None, bool, str | None]]:
    """``auth.api_keys``: each a key, or ``{key: ..., priority: N, admin: true, tenant:
    name}`` (a default priority; whether it may load and unload adapters; the
    prefix-cache tenant it shares with the keys naming the same one, else its own):
    (key, priority, admin, tenant). An empty or repeated key is refused."""
    out: list[tuple[str, int | None, bool, str | None]] = []
    known = ("key", "priority", "admin", "tenant")
    for i, entry in enumerate(get_list(auth, "api_keys", lines)):
        where = f"auth.api_keys[{i}]"
        if isinstance(entry, str):
            out.append((entry, None, False, None))
        elif not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise lines.error(where, f"must be a key, or a mapping with {', '.join(known)}")
        elif unknown := set(entry) - set(known):
            raise lines.error(
                where, f"unknown fields {sorted(unknown)} (known: {', '.join(known)})"
            )
        else:
            priority = entry.get("priority")
            if priority is not None:
                priority = typed(priority, int, f"{where}.priority", lines)
            admin = typed(entry.get("admin", False), bool, f"{where}.admin", lines)
            tenant = entry.get("tenant")
            if tenant is not None:
                tenant = typed(tenant, str, f"{where}.tenant", lines)
                if not tenant.strip():
                    raise lines.error(f"{where}.tenant", "must be a non-empty name")
            out.append((entry["key"], priority, admin, tenant))
    try:
        check_keys("auth.api_keys", tuple(key for key, *_ in out))
    except InvalidArgumentError as e:
        raise lines.error(e.field, e.message) from None
    return out
