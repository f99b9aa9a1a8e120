"""LoRA adapter names in an engine config: their validation and the forms the API,
YAML and CLI give them in."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pdserve.core.errors import ConflictError, InvalidArgumentError


class UnknownAdapterError(InvalidArgumentError):
    """A request names a LoRA adapter this server does not serve (HTTP 404)."""

    grpc_code = "NOT_FOUND"
    http_status = 404

    def __init__(self, name: str, served: tuple[str, ...], base: str | None = None) -> None:
        valid = ([base] if base else []) + list(served)
        super().__init__("model", f"unknown model or LoRA adapter {name!r}; valid names: {valid}")


class AdapterConflictError(ConflictError):
    """A runtime load or unload that the adapters held now forbid (HTTP 409): the name
    is taken, the instance is full (``max_loras``), or requests still use the adapter."""


def check_adapter_name(field: str, name: object) -> str:
    """A valid adapter name (1 to 128 printable characters), or InvalidArgumentError."""
    if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 128:
        raise InvalidArgumentError(field, f"must be 1 to 128 printable characters, got {name!r}")
    return name


def adapter_fingerprint(folder: str | Path) -> str:
    """Hash of an adapter folder's adapter_config.json and weight files: same content, same hash.

    Prefix-cache blocks computed under an adapter are salted by it (not by the
    name alone), and a prefill/decode pair compares it per name.
    """
    root = Path(folder)
    files = [root / "adapter_config.json", *sorted(root.glob("*.safetensors"))]
    return fingerprint_of([(f.name, f.read_bytes() if f.is_file() else None) for f in files])


def fingerprint_of(files: list[tuple[str, bytes | None]]) -> str:
    """:func:`adapter_fingerprint` of bytes already read: (file name, its bytes or None),
    adapter_config.json first, then the weight files by name."""
    h = hashlib.sha256()
    for name, data in files:
        h.update(name.encode())
        if data is not None:
            h.update(data)
    return h.hexdigest()[:24]


def check_adapters(adapters: object, max_loras: int | None = None) -> None:
    if max_loras is not None and isinstance(adapters, tuple) and len(adapters) > max_loras:
        raise InvalidArgumentError(
            "lora_adapters", f"{len(adapters)} adapters exceed max_loras={max_loras}"
        )
    if not isinstance(adapters, tuple):
        raise InvalidArgumentError("lora_adapters", "must be (name, folder) pairs or a mapping")
    names = set()
    for entry in adapters:
        if (
            not isinstance(entry, tuple)
            or len(entry) != 2
            or not all(isinstance(v, str) and v for v in entry)
        ):
            raise InvalidArgumentError(
                "lora_adapters", f"each adapter must be a (name, folder) pair, got {entry!r}"
            )
        name = entry[0]
        if name in names or not name.isprintable() or len(name) > 128:
            raise InvalidArgumentError(
                "lora_adapters", f"adapter name {name!r} is repeated, too long or not printable"
            )
        names.add(name)


def adapter_pairs(value: object) -> tuple[tuple[str, str], ...]:
    """``lora_adapters`` as given by the API, YAML or CLI: a mapping, pairs or ``name=folder``."""
    if isinstance(value, dict):
        return tuple((str(k), str(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        pairs: list[tuple[str, str]] = []
        for entry in value:
            if isinstance(entry, str) and "=" in entry:
                name, folder = entry.split("=", 1)
                pairs.append((name, folder))
            elif isinstance(entry, list | tuple) and len(entry) == 2:
                pairs.append((entry[0], entry[1]))
            else:
                raise InvalidArgumentError(
                    "lora_adapters", f"each adapter must be name=folder or a pair, got {entry!r}"
                )
        return tuple(pairs)
    raise InvalidArgumentError("lora_adapters", f"must be a mapping or a list, got {value!r}")
