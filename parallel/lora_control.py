"""Loading and unloading LoRA adapters on every rank of an instance, between two steps.

The leader reads and checks the adapter itself first (a bad one is refused
before any rank changes), then sends a LoRA control message down the plan
channel, told apart from a step plan by its prefix, and applies it to its own
rank; each follower applies it when its loop reads it. Every rank therefore
changes its adapter slots at the same point of the plan stream, and the next
plan that names the adapter finds it on all of them (the EPLB re-placement in
``expert_slots.py`` rides the same channel).

Each rank reads the adapter folder itself, so the folder must be readable at
the same path on every rank's node. The message carries the fingerprint of the
bytes the leader read, and each follower checks its own read against it. A
follower that cannot read it, or read other bytes (the folder changed in
between), stops its loop (the leader's next step then fails and the instance is
restarted): never a step run with an adapter on some ranks only, nor with
different contents under one name.
"""

from __future__ import annotations

import msgpack

from pdserve.core.errors import InvalidArgumentError
from pdserve.parallel.model_runner import ModelRunner

LORA_PREFIX = b"pdserve-lora\x00"  # a StepPlan (a msgpack array) never starts so


def encode_lora(slot: int, name: str, folder: str | None, fingerprint: str = "") -> bytes:
    """The message that loads ``folder`` as ``name`` into ``slot`` (None: unloads the slot);
    ``fingerprint``: of the bytes the leader read, which every rank must read too."""
    return LORA_PREFIX + bytes(msgpack.packb([slot, name, folder, fingerprint]))


def is_lora(payload: bytes) -> bool:
    return payload.startswith(LORA_PREFIX)


def apply_lora(runner: ModelRunner, payload: bytes) -> None:
    """A follower runs a LoRA control message on its rank."""
    slot, name, folder, fingerprint = msgpack.unpackb(payload[len(LORA_PREFIX) :])
    if folder is None:
        runner.unload_adapter(int(slot))
        return
    adapter = runner.read_adapter(str(name), str(folder))
    if adapter.fingerprint != fingerprint:
        raise InvalidArgumentError(
            "lora_path",
            f"adapter {name!r}: this rank read other bytes from {folder!r} than the leader "
            f"(fingerprint {adapter.fingerprint}, the leader's {fingerprint}): the folder "
            "changed during the load",
        )
    runner.load_adapter(int(slot), str(name), adapter)
