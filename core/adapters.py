"""LoRA adapter names in an engine config: their validation and the forms the API,
YAML and CLI give them in."""

from __future__ import annotations

from pdserve.core.errors import InvalidArgumentError


class UnknownAdapterError(InvalidArgumentError):
    """A request names a LoRA adapter this server does not serve (HTTP 404)."""

    grpc_code = "NOT_FOUND"
    http_status = 404

    def __init__(self, name: str, served: tuple[str, ...], base: str | None = None) -> None:
        valid = ([base] if base else []) + list(served)
        super().__init__("model", f"unknown model or LoRA adapter {name!r}; valid names: {valid}")


def check_adapters(adapters: object) -> None:
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
