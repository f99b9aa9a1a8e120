"""JSON for result files: indented where a reader looks, one line per row of data.

``json.dumps(payload, indent=1)`` puts every number of every list on a line of
its own and runs the pure-Python encoder. A simulated run of 30,000 requests
with their per-token gaps took longer to write that way than to simulate
(docs/results/simulator.md). :func:`dumps` indents dicts inside dicts (options, summaries,
percentiles) and writes each of these on one line, with the standard library's
C encoder: a list of scalars, and a dict in a list whose values are scalars or
lists of scalars (a request record, a row of counts over time). The text parses
to the same value as ``json.dumps`` of it.
"""

from __future__ import annotations

import json
from typing import Any

SCALARS = (str, int, float, bool, type(None))
SCALAR_TYPES = frozenset(SCALARS)


def _flat(value: Any) -> bool:
    """A scalar, or a list of scalars (their exact types are checked at C speed first;
    a subclass, such as numpy's float64, by ``isinstance``)."""
    if isinstance(value, (list, tuple)):
        return SCALAR_TYPES.issuperset(map(type, value)) or all(
            isinstance(x, SCALARS) for x in value
        )
    return isinstance(value, SCALARS)


def _key(key: Any) -> str:
    """A dict key as ``json.dumps`` writes it (non-string keys become strings)."""
    return json.dumps(key if isinstance(key, str) else json.dumps(key))


def dumps(value: Any, indent: int = 1) -> str:
    """``value`` as JSON text (see the module docstring)."""
    return _encode(value, indent, 0, False)


def _encode(value: Any, indent: int, level: int, in_list: bool) -> str:
    if _flat(value) or (
        in_list and isinstance(value, dict) and all(_flat(v) for v in value.values())
    ):
        return json.dumps(value)
    inner = "\n" + " " * (indent * (level + 1))
    close = "\n" + " " * (indent * level)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{_key(k)}: {_encode(v, indent, level + 1, False)}" for k, v in value.items()]
        return "{" + inner + ("," + inner).join(items) + close + "}"
    if isinstance(value, (list, tuple)):
        rows = [_encode(v, indent, level + 1, True) for v in value]
        return "[" + inner + ("," + inner).join(rows) + close + "]"
    return json.dumps(value)  # not JSON: json's TypeError names the type
