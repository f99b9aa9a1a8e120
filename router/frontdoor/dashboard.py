"""The cluster's observability routes on the router's HTTP server.

    GET /metrics          Prometheus exposition of every metric in pdserve.core.metrics
    GET /dashboard        the live P:D dashboard (a static page; it reads the data below)
    GET /dashboard/data   JSON: SLOs, per-region time series, the instances and the Ray
                          node each runs on, scaling decisions (?since=<unix s>)

``/metrics`` and ``/dashboard/data`` take the same API keys as the
completion routes (``Authorization: Bearer <key>``; Prometheus sends it with
``authorization: {credentials: ...}``). The page itself holds no data: it
asks for a key (or takes one from the URL fragment, ``/dashboard#key=...``,
which never reaches the server) when the data route answers 401.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from pdserve.core.errors import InvalidArgumentError
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.router import Router

STATIC = resources.files("pdserve.router.frontdoor").joinpath("static")


def add_routes(app: web.Application, router: Router, keys: ApiKeys) -> None:
    async def metrics(request: web.Request) -> web.Response:
        keys.check(request.headers.get("Authorization"))
        body, content_type = router.obs.exposition()
        # aiohttp wants the charset apart from the media type.
        media, _, params = content_type.partition(";")
        charset = params.partition("charset=")[2] or "utf-8"
        return web.Response(body=body, content_type=media.strip(), charset=charset)

    async def page(request: web.Request) -> web.Response:
        return web.Response(
            text=STATIC.joinpath("dashboard.html").read_text(), content_type="text/html"
        )

    async def script(request: web.Request) -> web.Response:
        return web.Response(
            text=STATIC.joinpath("dashboard.js").read_text(), content_type="text/javascript"
        )

    async def data(request: web.Request) -> web.Response:
        keys.check(request.headers.get("Authorization"))
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            raise InvalidArgumentError("since", "must be a number (unix seconds)") from None
        return web.json_response(router.obs.dashboard(router, since))

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/dashboard.js", script)
    app.router.add_get("/dashboard/data", data)
