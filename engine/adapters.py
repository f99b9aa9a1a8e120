"""The LoRA adapters an engine serves now: those it started with, plus runtime loads.

An :class:`AdapterSet` is owned by the engine core and read and changed only on
the engine's thread (between steps), so a step never sees an adapter half
loaded. Each adapter holds one of ``max_loras`` slots; the executor keeps the
weights of slot ``i`` on every rank (``models/lora_loader.py``) and a plan
names adapters, which each rank maps to its slot.

    load(name, folder):   checks (name free, a slot free) -> executor loads the
                          weights on every rank (validating them first) -> served
    unload(name):         refused while any queued, running or reserved request
                          uses it (409 naming how many) -> executor frees the slot

Prefix-cache blocks are salted by the adapter's name and content fingerprint,
so KV computed under an unloaded adapter is never reused for a different one
loaded later under the same name (the same content again may reuse it: it is
the same KV).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.core.adapters import (
    AdapterConflictError,
    UnknownAdapterError,
    adapter_fingerprint,
    check_adapter_name,
)
from pdserve.core.config import EngineConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.engine.block_hash import adapter_salt
from pdserve.engine.executor import Executor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter held: where it was read from, its content hash and its slot."""

    name: str
    folder: str
    fingerprint: str
    slot: int


class AdapterSet:
    def __init__(self, config: EngineConfig, read: dict[str, str] | None = None) -> None:
        """``read``: the fingerprint of each start-up adapter's bytes as the ranks read
        them (:meth:`~pdserve.engine.executor.Executor.adapter_fingerprints`)."""
        read = read or {}
        self.capacity = config.max_loras
        self._served: dict[str, ServedAdapter] = {
            name: ServedAdapter(name, folder, read.get(name) or adapter_fingerprint(folder), slot)
            for slot, (name, folder) in enumerate(config.lora_adapters)
        }

    def __len__(self) -> int:
        return len(self._served)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._served)

    def fingerprints(self) -> tuple[tuple[str, str], ...]:
        """(name, content fingerprint) of each adapter held (the handshake's and router's view)."""
        return tuple((a.name, a.fingerprint) for a in self._served.values())

    def check(self, name: str | None) -> None:
        """Raise :class:`UnknownAdapterError` (404) unless ``name`` is None (base) or held."""
        if name is not None and name not in self._served:
            raise UnknownAdapterError(name, self.names)

    def salt(self, name: str | None) -> bytes | None:
        """The parent of the first block of a request under ``name`` (None: the base)."""
        served = self._served.get(name) if name is not None else None
        return adapter_salt(name, served.fingerprint if served else "")

    def load(self, executor: Executor, name: str, folder: str) -> ServedAdapter:
        """Load ``folder`` as ``name`` on every rank; refuses a taken name or a full set."""
        check_adapter_name("lora_name", name)
        if not isinstance(folder, str) or not folder:
            raise InvalidArgumentError("lora_path", f"must be a non-empty path, got {folder!r}")
        held = self._served.get(name)
        if held is not None:
            raise AdapterConflictError(
                "lora_name",
                f"adapter {name!r} is already loaded (from {held.folder!r}); unload it first",
            )
        used = {a.slot for a in self._served.values()}
        free = [slot for slot in range(self.capacity) if slot not in used]
        if not free:
            raise AdapterConflictError(
                "lora_name",
                f"this instance holds max_loras={self.capacity} adapters {list(self.names)}; "
                "unload one first",
            )
        # validates before any rank changes; the fingerprint is of the bytes they loaded
        fingerprint = executor.load_adapter(free[0], name, folder)
        served = ServedAdapter(name, folder, fingerprint, free[0])
        self._served[name] = served
        logger.info("LoRA adapter %r loaded from %s into slot %d", name, folder, served.slot)
        return served

    def unload(self, executor: Executor, name: str, users: int) -> None:
        """Free ``name``'s slot on every rank; ``users``: requests that still run under it."""
        served = self._served.get(name)
        if served is None:
            raise UnknownAdapterError(name, self.names)
        if users:
            raise AdapterConflictError(
                "lora_name",
                f"adapter {name!r} is used by {users} running or queued requests; "
                "unload it when they have finished",
            )
        executor.unload_adapter(served.slot, name)
        del self._served[name]
        logger.info("LoRA adapter %r unloaded from slot %d", name, served.slot)
