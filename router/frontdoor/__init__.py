"""The front doors: where a client's request enters pdserve and its tokens leave.

``grpc_service`` (``pdserve.v1.Completion`` and gRPC health), ``http_api`` (the
OpenAI-compatible routes, ``/metrics`` and ``/dashboard`` through ``dashboard``),
``auth`` (API keys) and ``requests`` (turning either door's fields into one
validated :class:`~pdserve.router.router.CompletionInput`). They call the
router; nothing below them imports them.
"""
