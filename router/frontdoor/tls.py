"""TLS for the front doors: one :class:`~pdserve.router.config.TlsConfig`, two servers.

gRPC takes its credentials object; aiohttp an :class:`ssl.SSLContext`. Both
require a client certificate when the config names a client CA (mTLS).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from pdserve.router.config import TlsConfig


def grpc_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    key, cert = Path(tls.key).read_bytes(), Path(tls.cert).read_bytes()
    ca = Path(tls.client_ca).read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca:
        context.load_verify_locations(tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
