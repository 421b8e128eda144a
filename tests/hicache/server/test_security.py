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


TOKEN_A, TOKEN_B, TOKEN_OPS = "team-a-token-0123456789", "team-b-token-0123456789", "ops-" * 5
TOKEN_SCRAPER = "scraper-token-0123456789"


@pytest.fixture
def tenants_daemon(start_daemon, tmp_path):
    """team-a and team-b, each with its own token; ops may use both (--auth-token-file)."""
    tenants = tmp_path / "tenants"
    tenants.write_text(f"# token namespaces\n{TOKEN_A} team-a=8MiB\n\n{TOKEN_B}   team-b,shared\n")
    tenants.chmod(0o600)
    files = {}
    tokens = (("a", TOKEN_A), ("b", TOKEN_B), ("ops", TOKEN_OPS), ("scraper", TOKEN_SCRAPER))
    for name, token in tokens:
        files[name] = tmp_path / f"token-{name}"
        files[name].write_text(token)
        files[name].chmod(0o600)
    daemon = start_daemon(
        "--capacity", "32MiB", "--tenants-file", str(tenants),
        "--auth-token-file", str(files["ops"]), "--metrics-port", "0",
        "--metrics-token-file", str(files["scraper"]),
    )  # fmt: skip
    return daemon, files


def _metadata(token: str):
    return (("authorization", f"Bearer {token}"),)


def test_a_token_may_use_only_its_own_namespaces(tenants_daemon):
    daemon, files = tenants_daemon
    base = f"grpc://{daemon.address}"
    assert _round_trip(f"{base}?namespace=team-a&token_file={files['a']}")
    assert _round_trip(f"{base}?namespace=shared&token_file={files['b']}")
    assert _round_trip(f"{base}?namespace=team-a&token_file={files['ops']}")
    with pytest.raises(BackendConfigError, match="PERMISSION_DENIED: this token may not use"):
        _round_trip(f"{base}?namespace=team-a&token_file={files['b']}")
    # Every call, raw: team-b's token gets nothing of team-a, whether it exists or not.
    key = os.urandom(16)
    with grpc.insecure_channel(daemon.address) as channel:
        calls = {
            "BatchExists": pb.BatchExistsRequest(namespace="team-a", keys=[key]),
            "Delete": pb.DeleteRequest(namespace="team-a", keys=[key]),
            "Stats": pb.StatsRequest(namespace="team-a"),
        }
        for method, request in calls.items():
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(method_path(method))(
                    request.SerializeToString(), metadata=_metadata(TOKEN_B), timeout=5
                )
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
            assert "team-a" in caught.value.details()
        get = pb.BatchGetRequest(namespace="team-a", keys=[key]).SerializeToString()
        with pytest.raises(grpc.RpcError) as caught:
            list(channel.unary_stream(method_path("BatchGet"))(get, metadata=_metadata(TOKEN_B)))
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        from storage_backends import encode_object
        from storage_backends.pieces import OutPiece, encode_put_request

        blob = encode_object(key, LAYOUT, b"forged")
        put = encode_put_request("team-a", [OutPiece(0, key, len(blob), 0, [blob])])
        with pytest.raises(grpc.RpcError) as caught:
            channel.stream_unary(method_path("BatchPut"))(
                iter([put]), metadata=_metadata(TOKEN_B), timeout=5
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Stats of "every namespace" is every namespace this token may use.
        for token, names in (
            (TOKEN_B, ["shared", "team-b"]),
            (TOKEN_OPS, ["shared", "team-a", "team-b"]),
        ):  # noqa: E501
            raw = channel.unary_unary(method_path("Stats"))(
                pb.StatsRequest().SerializeToString(), metadata=_metadata(token), timeout=5
            )
            assert sorted(ns.name for ns in pb.StatsResponse.FromString(raw).namespaces) == names


def test_metrics_show_a_tenant_only_its_own_namespaces(tenants_daemon):
    import urllib.error
    import urllib.request

    daemon, files = tenants_daemon
    port = int(daemon.log.split("metrics on :")[1].split("/")[0])
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape(token: str | None) -> str:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.read().decode()

    for token in (None, "not-a-token-of-this-server"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            scrape(token)
        assert caught.value.code == 401
    mine = scrape(TOKEN_B)
    assert 'namespace="team-b"' in mine and 'namespace="shared"' in mine
    assert "team-a" not in mine and "hicache_server_calls" not in mine
    for token in (TOKEN_OPS, TOKEN_SCRAPER):
        everything = scrape(token)
        assert 'namespace="team-a"' in everything and "hicache_server_calls_total" in everything
    with pytest.raises(BackendConfigError, match="UNAUTHENTICATED: wrong bearer token"):
        _round_trip(f"grpc://{daemon.address}?namespace=team-a&token_file={files['scraper']}")
