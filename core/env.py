"""pdserve's on/off environment switches, all read one way.

``PDSERVE_CPU_GEMV``, ``PDSERVE_SHARE_WEIGHTS`` and ``PDSERVE_SHM_COLLECTIVES``
are on unless set off. Each takes ``1``/``true``/``yes``/``on`` and
``0``/``false``/``no``/``off`` in any case; an empty value is the default, and
any other keeps the default with a warning naming the variable (once per value
and process), so a typo never turns a feature off unseen or kills an actor.
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
    if value and (name, raw) not in _warned:
        _warned.add((name, raw))
        log.warning(
            "$%s=%r is not one of %s: %s",
            name,
            raw,
            "/".join(ON + OFF),
            "on" if default else "off",
        )
    return default
