"""Moving KV pages between instances: wire format, connectors, re-sharding.

The connector interface and its registry are in :mod:`~pdserve.transfer.connector`;
:func:`connector_classes` imports the implementation asked for (so it registers)
and returns it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdserve.core.errors import InvalidArgumentError

if TYPE_CHECKING:  # the names below are checked where torch is not imported (configs)
    from pdserve.transfer.connector import KVReceiver, KVSender

# Each connector's module registers it when imported; only the one asked for is
# imported (object_store, p2p and nccl need Ray, cuda_ipc and shm do not).
KNOWN = ("cuda_ipc", "nccl", "object_store", "p2p", "shm")
AUTO = "auto"  # a rank's own node: cuda_ipc for a KV cache on a GPU, shm for one in host memory
# ... and between ranks on different Ray nodes, this one (any receiver takes its messages)
ACROSS_NODES = "object_store"


def check_connector(name: str) -> None:
    if name != AUTO and name not in KNOWN:
        known = ", ".join([AUTO, *KNOWN])
        raise InvalidArgumentError("connector", f"unknown connector {name!r}; known: {known}")


def resolve_connector(name: str, device_type: str) -> str:
    """``name``, or for ``auto`` the same-node connector for a KV cache on a
    ``device_type`` device ("cuda", "cpu")."""
    check_connector(name)
    if name != AUTO:
        return name
    return "cuda_ipc" if device_type == "cuda" else "shm"


def across_nodes(name: str) -> str | None:
    """The connector ``name`` uses to a rank on another Ray node when it is not the one
    it uses on its own: ``auto`` picks per peer, a named connector is used for all."""
    check_connector(name)
    return ACROSS_NODES if name == AUTO else None


def connector_classes(name: str) -> tuple[type[KVSender], type[KVReceiver]]:
    """The (sender, receiver) classes of the connector called ``name``."""
    check_connector(name)
    if name == AUTO:
        raise InvalidArgumentError("connector", "auto names no connector until a device is known")
    from pdserve.transfer.connector import CONNECTORS

    importlib.import_module(f"pdserve.transfer.{name}")
    return CONNECTORS[name]


__all__ = ["across_nodes", "check_connector", "connector_classes", "resolve_connector"]
