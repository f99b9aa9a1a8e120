"""Both front doors over TLS and mTLS, reached by real clients (grpc, openai over https)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdserve.router.config import RouterConfig, TlsConfig
from pdserve.router.frontdoor.auth import ApiKeys
from pdserve.router.frontdoor.grpc_service import start_grpc
from pdserve.router.frontdoor.http_api import HttpApi, start_http
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc
from pdserve.router.router import Router

KEY = "tls-key"


def _cert(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    ca: bool,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, signer = issuer if issuer else (subject, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(signer, hashes.SHA256())


def _write(
    folder: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> None:
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A test CA, a server certificate for 127.0.0.1 and a client certificate."""
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("pdserve test CA", ca_key, None, ca=True)
    _write(folder, "ca", ca, ca_key)
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(folder, name, _cert(name, key, (ca.subject, ca_key), ca=False), key)
    return folder


class Doors:
    """Both front doors of a router with no instance, on an event loop in a thread."""

    def __init__(self, tls: TlsConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = RouterConfig(model_name="tiny", api_keys=(KEY,), tls=tls)
        router = Router(config, None, None, vocab_size=100)
        keys = ApiKeys(config.api_keys, False)
        self.grpc_server, self.grpc_port = self._run(start_grpc(router, keys, "127.0.0.1", 0, tls))
        self.http_runner, self.http_port = self._run(
            start_http(HttpApi(router, keys, 1 << 20), "127.0.0.1", 0, tls)
        )

    def _run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self._run(self.grpc_server.stop(None))
        self._run(self.http_runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tls_doors(pki) -> Iterator[Doors]:
    doors = Doors(TlsConfig(str(pki / "server.pem"), str(pki / "server.key")))
    yield doors
    doors.close()


@pytest.fixture(scope="module")
def mtls_doors(pki) -> Iterator[Doors]:
    doors = Doors(TlsConfig(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem")))
    yield doors
    doors.close()


def _grpc(doors: Doors, pki: Path, client_cert: bool) -> pb_grpc.CompletionStub:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )
    channel = grpc.secure_channel(f"127.0.0.1:{doors.grpc_port}", credentials)
    return pb_grpc.CompletionStub(channel)


def _openai(doors: Doors, pki: Path, client_cert: bool) -> openai.OpenAI:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        context.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return openai.OpenAI(
        base_url=f"https://127.0.0.1:{doors.http_port}/v1",
        api_key=KEY,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=context),
    )


AUTH = (("authorization", f"Bearer {KEY}"),)


def test_tls_clients_verify_the_server(tls_doors, pki) -> None:
    models = _grpc(tls_doors, pki, client_cert=False).ListModels(
        pb.ListModelsRequest(), metadata=AUTH, timeout=10
    )
    assert [m.id for m in models.models] == ["tiny"]
    assert [m.id for m in _openai(tls_doors, pki, client_cert=False).models.list().data] == ["tiny"]
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    url = f"https://127.0.0.1:{tls_doors.http_port}/health"
    with urllib.request.urlopen(url, context=context, timeout=10) as health:
        assert health.status == 200


def test_plain_clients_cannot_talk_to_a_tls_door(tls_doors) -> None:
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_doors.http_port}/health", timeout=5)
    plain = pb_grpc.CompletionStub(grpc.insecure_channel(f"127.0.0.1:{tls_doors.grpc_port}"))
    with pytest.raises(grpc.RpcError) as err:
        plain.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate(mtls_doors, pki) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _grpc(mtls_doors, pki, client_cert=False).ListModels(
            pb.ListModelsRequest(), metadata=AUTH, timeout=5
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.APIConnectionError):
        _openai(mtls_doors, pki, client_cert=False).models.list()
    models = _grpc(mtls_doors, pki, client_cert=True).ListModels(
        pb.ListModelsRequest(), metadata=AUTH, timeout=10
    )
    assert [m.id for m in models.models] == ["tiny"]
    assert [m.id for m in _openai(mtls_doors, pki, client_cert=True).models.list().data] == ["tiny"]


def test_a_missing_certificate_file_names_the_field(tmp_path) -> None:
    from pdserve.core.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"server\.tls\.cert"):
        TlsConfig(str(tmp_path / "nope.pem"), str(tmp_path / "nope.key"))
