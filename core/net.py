"""Network addresses as pdserve prints, dials and binds them."""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (``[::1]:8000``), as gRPC and URLs take it."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
