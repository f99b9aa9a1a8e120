"""pdserve's environment variables, each kind read one way.

Switches: ``PDSERVE_CPU_GEMV``, ``PDSERVE_SHARE_WEIGHTS`` and
``PDSERVE_SHM_COLLECTIVES`` are on unless set off. Each takes
``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off`` in any case.

Sizes: ``PDSERVE_CPU_KV_CACHE_BYTES`` (the KV pool of a CPU rank whose config names
none) takes a whole number of bytes.

An empty value is the default, and any other that does not parse keeps the default
with a warning naming the variable (once per value and process), so a typo never
turns a feature off unseen or kills an actor.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
_warned: set[tuple[str, str]] = set()


def env_switch(name: str, default: bool = True) -> bool:
    """The switch ``$name``: True or False as set, ``default`` when unset, empty or unknown."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    if value:
        _warn(name, raw, "one of " + "/".join(ON + OFF), "on" if default else "off")
    return default


def env_bytes(name: str, default: int) -> int:
    """The byte count ``$name``: a whole number above 0, ``default`` when unset, empty or not."""
    raw = os.environ.get(name, "")
    value = raw.strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    if value:
        _warn(name, raw, "a whole number of bytes above 0", f"{default} bytes")
    return default


def _warn(name: str, raw: str, expected: str, default: str) -> None:
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        log.warning("$%s=%r is not %s: %s", name, raw, expected, default)
