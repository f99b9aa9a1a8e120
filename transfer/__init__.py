"""Moving KV pages between instances: wire format, connectors, re-sharding.

The connector interface and its registry are in :mod:`~pdserve.transfer.connector`;
:func:`connector_classes` imports the implementations (so they register) and
picks one by name.
"""

from __future__ import annotations

from pdserve.core.errors import InvalidArgumentError
from pdserve.transfer.connector import CONNECTORS, KVReceiver, KVSender


def connector_classes(name: str) -> tuple[type[KVSender], type[KVReceiver]]:
    """The (sender, receiver) classes of the connector called ``name``."""
    from pdserve.transfer import object_store, p2p, shm  # noqa: F401

    if name not in CONNECTORS:
        raise InvalidArgumentError(
            "connector", f"unknown connector {name!r}; known: {sorted(CONNECTORS)}"
        )
    return CONNECTORS[name]


__all__ = ["connector_classes"]
