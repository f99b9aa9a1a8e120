"""API keys: from the config, ``$PDSERVE_API_KEYS`` and ``$PDSERVE_ADMIN_API_KEYS``
(comma-separated).

Both front doors check the same keys: gRPC in the ``authorization`` metadata,
HTTP in the ``Authorization`` header, as ``Bearer <key>``. With no key
configured the router refuses to start unless auth was disabled explicitly.
A key may carry a priority: the default of the requests that set none, and the
highest any of them may set (a batch client's key, say, at -1). Admin keys (``admin: true``) may also change what the
cluster serves (load and unload LoRA adapters); any other key only sends requests.

A key, as configured and as sent, is compared in one form, :func:`normalise_key`
(surrounding whitespace gone); an empty one is never a key. Each key is its own
prefix-cache tenant unless keys name the same ``tenant`` (:class:`Caller`); the
tenant travels as a hash (:func:`cache_salt`), never as the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from pdserve.core.errors import AuthenticationError, InvalidArgumentError, PermissionDeniedError


def normalise_key(raw: str) -> str:
    """A key in the one form configured and presented keys are compared in: without
    the whitespace around it (an HTTP header loses it on the way, gRPC metadata and a
    YAML string keep it). Empty means no key."""
    return raw.strip()


def _env_keys(name: str) -> tuple[str, ...]:
    keys = (normalise_key(k) for k in os.environ.get(name, "").split(","))
    return tuple(k for k in keys if k)


def _bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def check_keys(field: str, keys: tuple[str, ...]) -> None:
    """Refuse an empty or whitespace-only key, and a key given twice, naming ``field[i]``
    (an unset variable that envsubst or Helm filled in is an empty key)."""
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not normalise_key(key):
            raise InvalidArgumentError(f"{field}[{i}]", "must be a non-empty key")
        first = seen.setdefault(normalise_key(key), i)
        if first != i:
            raise InvalidArgumentError(f"{field}[{i}]", f"repeats the key of {field}[{first}]")


def cache_salt(tenant: str | None, asked: str | None) -> str | None:
    """The ``SamplingParams.cache_salt`` of a request: its key's tenant (None: auth is
    off, one tenant) and the salt the request names (None: none). A hash of both, so
    no client can name another tenant's salt, and no key travels in it."""
    if tenant is None and asked is None:
        return None
    h = hashlib.blake2b(b"pdserve-cache-salt\0", digest_size=16)
    for part in (tenant, asked):
        h.update(b"\1" + _bytes(part) + b"\0" if part is not None else b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as far as serving it goes.

    priority: the key's default priority (None: it sets none, or auth is off).
    tenant: the key's prefix-cache tenant, a hash of its ``tenant`` name or of the key
        itself (None: auth is off, everyone shares).
    """

    priority: int | None = None
    tenant: str | None = None


def _tenant(key: str, name: str | None) -> str:
    what = b"name\0" + _bytes(name) if name is not None else b"key\0" + _bytes(key)
    return hashlib.blake2b(b"pdserve-tenant\0" + what, digest_size=16).hexdigest()


class ApiKeys:
    def __init__(
        self,
        keys: tuple[str, ...],
        disabled: bool,
        priorities: tuple[tuple[str, int], ...] = (),
        admins: tuple[str, ...] = (),
        tenants: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """``tenants``: (key, tenant name) pairs; keys naming one tenant share its
        prefix cache (any other key is a tenant of its own)."""
        check_keys("auth.api_keys", tuple(keys))
        check_keys("auth.api_key_admins", tuple(admins))
        keys, admins = tuple(map(normalise_key, keys)), tuple(map(normalise_key, admins))
        admins = admins + _env_keys("PDSERVE_ADMIN_API_KEYS")
        self.keys = tuple(dict.fromkeys((*keys, *_env_keys("PDSERVE_API_KEYS"), *admins)))
        self._keys = tuple(_bytes(k) for k in self.keys)
        self._admins = tuple(_bytes(k) for k in admins)
        self.disabled = disabled
        self._priorities = {_bytes(normalise_key(k)): p for k, p in priorities}
        names = {normalise_key(k): name for k, name in tenants}
        self._tenants = {_bytes(k): _tenant(k, names.get(k)) for k in self.keys}
        if not self.keys and not disabled:
            raise InvalidArgumentError(
                "api_keys",
                "no API key configured: set api_keys (or $PDSERVE_API_KEYS), or disable auth "
                "explicitly for local use",
            )

    def check(self, authorization: str | None) -> int | None:
        """Raise AuthenticationError unless ``authorization`` is ``Bearer <known key>``.

        Returns the key's default priority (None: it has none, or auth is off).
        """
        return self.caller(authorization).priority

    def caller(self, authorization: str | None) -> Caller:
        """:meth:`check`, returning the key's priority and prefix-cache tenant."""
        if self.disabled:
            return Caller()
        given = self._given(authorization)
        # Bytes, so any key compares in constant time (str needs ASCII); every key is tried.
        if not _known(given, self._keys):
            raise AuthenticationError("unknown API key")
        return Caller(self._priorities.get(given), self._tenants[given])

    def check_admin(self, authorization: str | None, what: str) -> None:
        """:meth:`check`, then PermissionDeniedError unless the key is an admin's."""
        self.check(authorization)
        if not self.disabled and not _known(self._given(authorization), self._admins):
            raise PermissionDeniedError(
                f"this API key may not {what}: it needs an admin key (admin: true in "
                "auth.api_keys, or $PDSERVE_ADMIN_API_KEYS)"
            )

    @staticmethod
    def _given(authorization: str | None) -> bytes:
        if not authorization:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        key = normalise_key(key)
        if scheme.lower() != "bearer" or not key:  # "Bearer" and a non-breaking space: no key
            raise AuthenticationError("malformed authorization: expected 'Bearer <key>'")
        return _bytes(key)


def _known(given: bytes, keys: tuple[bytes, ...]) -> bool:
    return sum(hmac.compare_digest(given, k) for k in keys) > 0
