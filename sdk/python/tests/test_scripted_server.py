"""The SDK against a scripted in-process QUIC server: broker behaviour too rare or too hostile
to provoke from a real broker (a lagged subscription's Error frame with its resume positions,
bytes that are not Felix, frames in the wrong place) gives the documented typed errors."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from conftest import run
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import felix_client
from felix_client import Client, ClientConfig, ErrorCode, Start, wire

#: Answers one decoded client frame with raw bytes (frames, or anything else).
Script = Callable[[wire.Frame], list[bytes]]

LIMITS = wire.Limits(max_shards=1024)
LAGGED = "subscriber fell behind live delivery; resume from shard:next_offset"


def hello_ok(version: int = 1) -> bytes:
    return wire.encode(wire.HelloOk(version, 0, LIMITS, (), ()))


def delivery(shard: int, offsets: range) -> bytes:
    records = tuple(wire.DeliveredRecord(shard, o, 0, b"k", b"%d" % o) for o in offsets)
    return wire.encode(wire.Delivery(records))


class ScriptedServer(QuicConnectionProtocol):
    script: Script
    received: list[wire.Frame]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffers: dict[int, bytearray] = {}

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if not isinstance(event, events.StreamDataReceived):
            return
        buffer = self.buffers.setdefault(event.stream_id, bytearray())
        buffer += event.data
        while (frame := wire.Decoder().decode(buffer)) is not None:
            self.received.append(frame)
            for data in self.script(frame):
                self._quic.send_stream_data(event.stream_id, data)
        self.transmit()


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.pem", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def scripted(
    tmp_path: Path, script: Script, received: list[wire.Frame]
) -> tuple[QuicServer, ClientConfig]:
    """A server on a loopback ephemeral port answering with `script`, and a config for it."""
    cert, key = self_signed(tmp_path)
    configuration = QuicConfiguration(is_client=False, alpn_protocols=[wire.ALPN])
    configuration.load_cert_chain(str(cert), str(key))

    def protocol(*args: Any, **kwargs: Any) -> ScriptedServer:
        server = ScriptedServer(*args, **kwargs)
        server.script = script
        server.received = received
        return server

    server = await serve("127.0.0.1", 0, configuration=configuration, create_protocol=protocol)
    transport = cast(asyncio.DatagramTransport, server._transport)
    port = transport.get_extra_info("sockname")[1]
    return server, ClientConfig(host="127.0.0.1", port=port, ca=cert, connect_timeout=20.0)


def test_resume_from_the_lagged_message(tmp_path: Path) -> None:
    """A lagged Error frame's shard:next_offset list is where resume_on_lag subscribes again,
    shards that delivered nothing included; the records then continue without a gap."""
    received: list[wire.Frame] = []

    def script(frame: wire.Frame) -> list[bytes]:
        match frame:
            case wire.Hello():
                return [hello_ok()]
            case wire.Subscribe(start=Start.EARLIEST):
                return [
                    wire.encode(wire.Subscribed(frame.request_id, ((0, 0), (1, 7)))),
                    delivery(0, range(0, 10)),
                    wire.encode(
                        wire.ErrorFrame(
                            frame.request_id, ErrorCode.SUBSCRIBER_LAGGED, 0, f"{LAGGED} 0:10 1:7"
                        )
                    ),
                ]
            case wire.Subscribe():
                return [
                    wire.encode(wire.Subscribed(frame.request_id, ((0, 10), (1, 7)))),
                    delivery(0, range(10, 15)),
                    delivery(1, range(7, 9)),
                ]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, received)
        try:
            async with await Client.connect(config) as client:
                subscription = await client.subscribe(
                    "s", shards=[0, 1], start=Start.EARLIEST, resume_on_lag=True
                )
                records = [await anext(subscription) for _ in range(17)]
                assert subscription.resumes == 1
                expected = [*((0, offset) for offset in range(15)), (1, 7), (1, 8)]
                assert [(r.shard, r.offset) for r in records] == expected
                subscription.close()
        finally:
            server.close()
        resumed = [f for f in received if isinstance(f, wire.Subscribe)][1]
        assert resumed.start == ((0, 10), (1, 7))

    run(scenario())


def test_lagged_error_carries_the_positions(tmp_path: Path) -> None:
    """Without resume_on_lag, the SubscriberLaggedError holds the positions to resume from."""

    def script(frame: wire.Frame) -> list[bytes]:
        match frame:
            case wire.Hello():
                return [hello_ok()]
            case wire.Subscribe():
                return [
                    wire.encode(wire.Subscribed(frame.request_id, ((3, 5),))),
                    delivery(3, range(5, 8)),
                    wire.encode(
                        wire.ErrorFrame(
                            frame.request_id, ErrorCode.SUBSCRIBER_LAGGED, 0, f"{LAGGED} 3:8"
                        )
                    ),
                ]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, [])
        try:
            async with await Client.connect(config) as client:
                subscription = await client.subscribe("s", shards=[3])
                offsets = []
                with pytest.raises(felix_client.SubscriberLaggedError) as lagged:
                    async for item in subscription:
                        offsets.append(item.offset)
                assert offsets == [5, 6, 7]
                assert lagged.value.resume_positions == {3: 8}
                assert lagged.value.code == 21
        finally:
            server.close()

    run(scenario())


# What a hostile or broken server answers the first request with, and the error it must give.
HOSTILE: list[tuple[str, bytes, type[felix_client.FelixError]]] = [
    ("garbage", b"\xff" * 64, felix_client.FrameTooLargeError),
    ("unknown type", bytes([8, 0, 0, 0, 0x6E, 0]) + bytes(8), felix_client.UnknownFrameTypeError),
    ("bad flags", bytes([8, 0, 0, 0, 0x16, 1]) + bytes(8), felix_client.MalformedError),
    (
        "trailing bytes",
        bytes([9, 0, 0, 0, 0x16, 0]) + bytes(9),
        felix_client.MalformedError,
    ),
    ("wrong place", wire.encode(wire.Hello(1, 1, 0, "x")), felix_client.ProtocolViolationError),
    (
        "stream error",
        wire.encode(wire.ErrorFrame(0, ErrorCode.INTERNAL, 0, "broken")),
        felix_client.InternalError,
    ),
]


@pytest.mark.parametrize(("case", "answer", "expected"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_answers_are_typed_errors(
    tmp_path: Path, case: str, answer: bytes, expected: type[felix_client.FelixError]
) -> None:
    """Bytes that are not a valid answer fail the request with the decoding rule's typed error
    (section 7), and the request stream only: a new one works."""
    answers = iter([answer])

    def script(frame: wire.Frame) -> list[bytes]:
        match frame:
            case wire.Hello():
                return [hello_ok()]
            case wire.ListStreams():
                return [next(answers, wire.encode(wire.StreamList(frame.request_id, ())))]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, [])
        try:
            async with await Client.connect(config) as client:
                with pytest.raises(expected):
                    await client.list_streams()
                assert await client.list_streams() == []
        finally:
            server.close()

    run(scenario())


def test_bad_handshake_answers(tmp_path: Path) -> None:
    """A HelloOk choosing another version, or a refusal, fails connect with a typed error."""
    answers = iter(
        [
            hello_ok(version=2),
            wire.encode(wire.ErrorFrame(0, ErrorCode.UNSUPPORTED_VERSION, 0, "no")),
        ]
    )

    def script(frame: wire.Frame) -> list[bytes]:
        return [next(answers)] if isinstance(frame, wire.Hello) else []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, [])
        try:
            with pytest.raises(felix_client.ProtocolViolationError):
                await Client.connect(config)
            with pytest.raises(felix_client.UnsupportedVersionError):
                await Client.connect(config)
        finally:
            server.close()

    run(scenario())
