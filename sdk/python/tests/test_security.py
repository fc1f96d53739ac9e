"""Connecting securely against a real broker: dev certificate trust, tokens, mutual TLS and
permission rules, each refusal as its typed error."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from broker import run_cli
from conftest import StartBroker, run
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import felix_client
from felix_client import Client


def test_the_dev_certificate_must_be_trusted(start_broker: StartBroker, tmp_path: Path) -> None:
    """Without the broker's certificate as CA, or with another server name, TLS fails as a
    FelixConnectionError; with it, the client connects."""
    broker = start_broker()
    other_ca, _ = make_ca(tmp_path, "other")

    async def scenario() -> None:
        with pytest.raises(felix_client.FelixConnectionError):
            await Client.connect(broker.config(ca=other_ca, connect_timeout=20.0))
        with pytest.raises(felix_client.FelixConnectionError):
            await Client.connect(broker.config(server_name="wrong.example", connect_timeout=20.0))
        async with await Client.connect(broker.config()) as client:
            assert await client.list_streams() == []
        # Development only: no verification at all.
        async with await Client.connect(broker.config(ca=None, insecure=True)) as client:
            assert await client.list_streams() == []

    run(scenario())


def test_tokens(start_broker: StartBroker, tmp_path: Path) -> None:
    """With FELIX_AUTH=required, a connection needs a valid token: none or a wrong one is
    UnauthenticatedError (code 60); the token `felix token add` printed works."""
    tokens = tmp_path / "tokens"
    token = run_cli(["token", "add", "alice"], {"FELIX_TOKENS_FILE": str(tokens)}).strip()
    assert token.startswith("felix_")
    broker = start_broker(FELIX_TOKENS_FILE=str(tokens), FELIX_AUTH="required")

    async def scenario() -> None:
        with pytest.raises(felix_client.UnauthenticatedError) as missing:
            await Client.connect(broker.config())
        assert missing.value.code == 60
        wrong = token[:-4] + ("0000" if not token.endswith("0000") else "1111")
        with pytest.raises(felix_client.UnauthenticatedError):
            await Client.connect(broker.config(token=wrong))
        async with await Client.connect(broker.config(token=token)) as client:
            await client.create_stream("alice-stream", 1)
            assert (await client.publish("alice-stream", [("k", "v")]))[0].count == 1

    run(scenario())


def test_mutual_tls(start_broker: StartBroker, tmp_path: Path) -> None:
    """A client certificate from FELIX_CLIENT_CA makes its Common Name the principal (rules
    apply to it); no certificate is refused under FELIX_AUTH=required; one from another CA
    fails the TLS handshake."""
    ca_cert, ca_key = make_ca(tmp_path, "clients")
    alice_cert, alice_key = make_client(tmp_path, "alice", ca_cert, ca_key)
    rogue_ca, rogue_key = make_ca(tmp_path, "rogue")
    rogue_cert, rogue_client_key = make_client(tmp_path, "mallory", rogue_ca, rogue_key)
    broker = start_broker(
        FELIX_CLIENT_CA=str(ca_cert), FELIX_AUTH="required", FELIX_RULES="alice all alice.*"
    )

    async def scenario() -> None:
        config = broker.config(client_cert=alice_cert, client_key=alice_key)
        async with await Client.connect(config) as client:
            await client.create_stream("alice.orders", 1)
            with pytest.raises(felix_client.PermissionDeniedError) as denied:
                await client.create_stream("bob.orders", 1)
            assert denied.value.code == 61 and "alice" in denied.value.message
        with pytest.raises(felix_client.UnauthenticatedError):
            await Client.connect(broker.config())
        with pytest.raises(felix_client.FelixConnectionError):
            await Client.connect(broker.config(client_cert=rogue_cert, client_key=rogue_client_key))

    run(scenario())


def test_permission_denied(start_broker: StartBroker) -> None:
    """Rules refuse a request with PermissionDeniedError (code 61) and the connection goes on."""
    broker = start_broker(FELIX_RULES="* admin,subscribe *")

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            await client.create_stream("guarded", 2)
            with pytest.raises(felix_client.PermissionDeniedError) as denied:
                await client.publish("guarded", [("k", "v")])
            assert denied.value.code == 61
            assert "publish" in denied.value.message and "guarded" in denied.value.message
            subscription = await client.subscribe("guarded")
            subscription.close()

    run(scenario())


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed test CA: (certificate PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(_name(f"{name} test CA"))
        .issuer_name(_name(f"{name} test CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return (
        _write(directory / f"{name}-ca.pem", cert.public_bytes(serialization.Encoding.PEM)),
        _write(directory / f"{name}-ca.key", _key_pem(key)),
    )


def make_client(directory: Path, name: str, ca_cert: Path, ca_key: Path) -> tuple[Path, Path]:
    """A client certificate for principal `name` signed by the CA: (certificate, key)."""
    issuer = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    issuer_key = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    assert isinstance(issuer_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(_name(name))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
        .sign(issuer_key, hashes.SHA256())
    )
    return (
        _write(directory / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
        _write(directory / f"{name}.key", _key_pem(key)),
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
