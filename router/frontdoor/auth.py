"""API keys: from the config and ``$PDSERVE_API_KEYS`` (comma-separated).

Both front doors check the same keys: gRPC in the ``authorization`` metadata,
HTTP in the ``Authorization`` header, as ``Bearer <key>``. With no key
configured the router refuses to start unless auth was disabled explicitly.
A key may carry a default priority for the requests that set none (a batch
client's key, say, at -1).
"""

from __future__ import annotations

import hmac
import os

from pdserve.core.errors import AuthenticationError, InvalidArgumentError


class ApiKeys:
    def __init__(
        self,
        keys: tuple[str, ...],
        disabled: bool,
        priorities: tuple[tuple[str, int], ...] = (),
    ) -> None:
        env = [k.strip() for k in os.environ.get("PDSERVE_API_KEYS", "").split(",") if k.strip()]
        self.keys = tuple(keys) + tuple(env)
        self._keys = tuple(k.encode("utf-8", "surrogatepass") for k in self.keys)
        self.disabled = disabled
        self._priorities = {k.encode("utf-8", "surrogatepass"): p for k, p in priorities}
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
        if not authorization:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationError("malformed authorization: expected 'Bearer <key>'")
        given = key.strip().encode("utf-8", "surrogatepass")
        # Bytes, so any key compares in constant time (str needs ASCII); every key is tried.
        if not sum(hmac.compare_digest(given, k) for k in self._keys):
            raise AuthenticationError("unknown API key")
        return self._priorities.get(given)
