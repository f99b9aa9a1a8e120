"""What the HTTP front door keeps on an aiohttp request while it serves it."""

from aiohttp import web

# The router counts the request's outcome from here on; an error before it is a
# refusal (`Router.reject`). Admin calls set it too: they are not completions.
ADMITTED = web.RequestKey("admitted", bool)
# The priority the caller's API key grants (None: the key sets none).
KEY_PRIORITY = web.RequestKey[int | None]("key_priority")
# The caller's prefix-cache tenant (a hash; None: auth is off, one tenant for all).
KEY_TENANT = web.RequestKey[str | None]("key_tenant")
# The body's size, which decides whether its parsing leaves the event loop.
BODY_BYTES = web.RequestKey("body_bytes", int)
