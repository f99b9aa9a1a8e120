"""API keys: from the config, ``$PDSERVE_API_KEYS`` and ``$PDSERVE_ADMIN_API_KEYS``
(comma-separated).

Both front doors check the same keys: gRPC in the ``authorization`` metadata,
HTTP in the ``Authorization`` header, as ``Bearer <key>``. With no key
configured the router refuses to start unless auth was disabled explicitly.
A key may carry a priority: the default of the requests that set none, and the
highest any of them may set (a batch client's key, say, at -1). Admin keys (``admin: true``) may also change what the
cluster serves (load and unload LoRA adapters); any other key only sends requests.
"""

from __future__ import annotations

import hmac
import os

from pdserve.core.errors import AuthenticationError, InvalidArgumentError, PermissionDeniedError


def _env_keys(name: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in os.environ.get(name, "").split(",") if k.strip())


def _bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


class ApiKeys:
    def __init__(
        self,
        keys: tuple[str, ...],
        disabled: bool,
        priorities: tuple[tuple[str, int], ...] = (),
        admins: tuple[str, ...] = (),
    ) -> None:
        admins = tuple(admins) + _env_keys("PDSERVE_ADMIN_API_KEYS")
        self.keys = tuple(dict.fromkeys((*keys, *_env_keys("PDSERVE_API_KEYS"), *admins)))
        self._keys = tuple(_bytes(k) for k in self.keys)
        self._admins = tuple(_bytes(k) for k in admins)
        self.disabled = disabled
        self._priorities = {_bytes(k): p for k, p in priorities}
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
        if self.disabled:
            return None
        given = self._given(authorization)
        # Bytes, so any key compares in constant time (str needs ASCII); every key is tried.
        if not _known(given, self._keys):
            raise AuthenticationError("unknown API key")
        return self._priorities.get(given)

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
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationError("malformed authorization: expected 'Bearer <key>'")
        return _bytes(key.strip())


def _known(given: bytes, keys: tuple[bytes, ...]) -> bool:
    return sum(hmac.compare_digest(given, k) for k in keys) > 0
