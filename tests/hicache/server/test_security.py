"""Bearer tokens and TLS, end to end: a real daemon, the grpc:// and grpcs:// backends."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os

import grpc
import pytest

from storage_backends import BackendConfigError, BackendUnavailableError, open_backend
from storage_backends.proto import kvstore_pb2 as pb
from storage_backends.protocol import method_path

LAYOUT = "test;layout"


def _round_trip(url: str) -> bool:
    async def body() -> bool:
        async with open_backend(url, layout=LAYOUT) as store:
            key, page = os.urandom(16), os.urandom(10_000)
            assert await store.batch_put([key], [page]) == [True]
            into = bytearray(len(page))
            assert await store.batch_get([key], [into]) == [True]
            return bytes(into) == page

    return asyncio.run(body())


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret-token-of-the-test\n")
    path.chmod(0o600)
    return path


def test_no_wrong_and_right_token(start_daemon, token_file, tmp_path):
    daemon = start_daemon("--capacity", "16MiB", "--auth-token-file", str(token_file))
    wrong = tmp_path / "wrong"
    wrong.write_text("s3cret-token-of-the-tesT")
    base = f"grpc://{daemon.address}"
    assert _round_trip(f"{base}?token_file={token_file}")
    for url, message in (
        (base, "missing bearer token"),
        (f"{base}?token_file={wrong}", "wrong bearer token"),
    ):
        with pytest.raises(BackendConfigError, match=f"UNAUTHENTICATED: {message}"):
            _round_trip(url)
    # Raw calls: every method checks the token; health does not need one.
    with grpc.insecure_channel(daemon.address) as channel:
        request = pb.StatsRequest().SerializeToString()
        for metadata, message in (
            ((), "missing bearer token"),
            ((("authorization", "Bearer nope"),), "wrong bearer token"),
            ((("authorization", "Basic x"),), "is not 'Bearer <token>'"),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(method_path("Stats"))(request, metadata=metadata, timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            call = channel.stream_unary(method_path("BatchPut"))
            call(iter([b"\x0a\x01x"]), metadata=(("authorization", "Bearer no"),), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    daemon.wait_serving(timeout_s=5)  # the health service answers without a token


def _self_signed(tmp_path):
    """A fresh key and a certificate for localhost / 127.0.0.1, signed by itself."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hicache-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_with_a_self_signed_certificate(start_daemon, token_file, tmp_path):
    cert, key = _self_signed(tmp_path)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    daemon = start_daemon(
        "--capacity", "16MiB", "--tls-cert", str(cert), "--tls-key", str(key),
        "--auth-token-file", str(token_file), credentials=credentials,
    )  # fmt: skip
    url = f"grpcs://{daemon.address}?ca_file={cert}&token_file={token_file}"
    assert _round_trip(url)
    assert _round_trip(url.replace("127.0.0.1", "localhost"))
    # Plaintext to the TLS port fails; so does TLS that does not trust this certificate.
    (tmp_path / "other").mkdir()
    other_cert, _ = _self_signed(tmp_path / "other")
    for bad in (
        f"grpc://{daemon.address}?token_file={token_file}",
        f"grpcs://{daemon.address}?ca_file={other_cert}&token_file={token_file}",
    ):
        with pytest.raises(BackendUnavailableError, match="no cache-server answered"):
            _round_trip(bad + "&connect_timeout=1")
    assert daemon.stop() == 0
