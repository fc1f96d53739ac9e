"""Wire codec, hash and error unit tests: the specification's exact byte vectors
(dataplane/wire/tests/spec_vectors.rs), round trips, and the decoding rules of section 7."""

from __future__ import annotations

import struct

import pytest

from felix_client import errors, wire
from felix_client.hash import fnv1a_64, shard_for_key


def dump(text: str) -> bytes:
    return bytes.fromhex(text)


def check(frame: wire.Frame, hex_dump: str) -> None:
    data = wire.encode(frame)
    assert data == dump(hex_dump)
    buffer = bytearray(data)
    assert wire.Decoder().decode(buffer) == frame
    assert buffer == b""


def test_shard_hash_examples() -> None:
    """The section 8 hash examples are what fnv1a_64 and shard_for_key compute."""
    assert fnv1a_64(b"user-42") == 0x32C6D7A54D35DACB == 3_658_848_852_250_057_419
    assert shard_for_key(b"user-42", 48) == 27
    assert fnv1a_64(b"sensor/7") == 0xA08C2C06666C0F11 == 11_568_669_948_807_745_297
    assert shard_for_key(b"sensor/7", 16) == 1
    assert shard_for_key(b"k1", 48) == 17
    assert fnv1a_64(b"") == 14_695_981_039_346_656_037
    assert shard_for_key(b"", 48) == 5
    with pytest.raises(ValueError):
        shard_for_key(b"k", 0)


def test_hello_dump() -> None:
    """The Hello hex dump of section 9 is exactly what the encoder writes and decodes back."""
    check(
        wire.Hello(1, 1, 0, "cli"),
        "11 00 00 00 01 00 01 00 01 00 00 00 00 00 00 00 00 00 03 00 63 6c 69",
    )


def test_hello_with_token_dump() -> None:
    """A token sets the TOKEN feature bit and follows the client name."""
    check(
        wire.Hello(1, 1, wire.FEATURE_TOKEN, "cli", b"tok"),
        "16 00 00 00 01 00 01 00 01 00 01 00 00 00 00 00 00 00 03 00 63 6c 69 03 00 74 6f 6b",
    )


def test_publish_dump() -> None:
    """The one-record Publish hex dump of section 9."""
    check(
        wire.Publish(7, wire.AckMode.ACKED, "orders", (wire.Record(b"k1", b"hello"),)),
        "22 00 00 00 20 00 07 00 00 00 00 00 00 00 00 06 00 6f 72 64 65 72 73"
        " 01 00 00 00 02 00 6b 31 05 00 00 00 68 65 6c 6c 6f",
    )


def test_producer_publish_dump() -> None:
    """The ProducerPublish hex dump of section 9: the same record as batch 3 of producer
    0x1122334455667788 on shard 17."""
    frame = wire.ProducerPublish(
        7,
        wire.AckMode.ACKED,
        "orders",
        0x1122334455667788,
        3,
        17,
        (wire.Record(b"k1", b"hello"),),
    )
    check(
        frame,
        "36 00 00 00 22 00 07 00 00 00 00 00 00 00 00 06 00 6f 72 64 65 72 73"
        " 88 77 66 55 44 33 22 11 03 00 00 00 00 00 00 00 11 00 00 00"
        " 01 00 00 00 02 00 6b 31 05 00 00 00 68 65 6c 6c 6f",
    )
    # A Publish of the same records plus 20 bytes.
    assert len(wire.encode(frame)) == wire.FRAME_HEADER_LEN + wire.encoded_producer_publish_len(
        "orders", frame.records
    )
    assert wire.encoded_producer_publish_len("orders", frame.records) == (
        wire.encoded_publish_len("orders", frame.records) + wire.PRODUCER_FIELDS_LEN
    )


def test_hello_with_the_producer_feature() -> None:
    """The PRODUCER bit (0x2) is a plain feature bit: no field follows, and it travels with
    TOKEN."""
    check(
        wire.Hello(1, 1, wire.FEATURE_PRODUCER, "cli"),
        "11 00 00 00 01 00 01 00 01 00 02 00 00 00 00 00 00 00 03 00 63 6c 69",
    )
    check(
        wire.Hello(1, 1, wire.FEATURE_PRODUCER | wire.FEATURE_TOKEN, "cli", b"tok"),
        "16 00 00 00 01 00 01 00 01 00 03 00 00 00 00 00 00 00 03 00 63 6c 69 03 00 74 6f 6b",
    )
    echoed = wire.HelloOk(1, wire.FEATURE_PRODUCER, wire.Limits(), (), ())
    decoded = wire.Decoder().decode(bytearray(wire.encode(echoed)))
    assert isinstance(decoded, wire.HelloOk) and decoded.features == wire.FEATURE_PRODUCER


def test_ack_dump() -> None:
    """The Ack hex dump of section 9 (k1 on shard 17 of 48, offset 41)."""
    check(
        wire.Ack(7, (wire.ShardAck(17, 41, 1),)),
        "1c 00 00 00 21 00 07 00 00 00 00 00 00 00 01 00 00 00"
        " 11 00 00 00 29 00 00 00 00 00 00 00 01 00 00 00",
    )


ROUTE = wire.StreamRoute("orders", wire.StreamKind.DURABLE, 2, wire.HashKind.FNV1A_64, (0, 1))
EVERY_FRAME: list[wire.Frame] = [
    wire.Hello(1, 1, 0, "felix-python", None),
    wire.HelloOk(1, 0, wire.Limits(), (7401, 7402), (ROUTE,)),
    wire.CreateStream(1, "orders", 4, wire.StreamKind.DURABLE),
    wire.DescribeStream(2, "orders"),
    wire.ListStreams(3),
    wire.DeleteStream(4, "orders"),
    wire.StreamInfo(
        5,
        "orders",
        wire.StreamKind.IN_MEMORY,
        wire.HashKind.FNV1A_64,
        (wire.ShardInfo(0, 0, 3, 9), wire.ShardInfo(1, 1, 0, 0)),
    ),
    wire.StreamList(6, (wire.StreamSummary("a", wire.StreamKind.IN_MEMORY, 1),)),
    wire.Done(7),
    wire.DescribeCluster(8),
    wire.ClusterMap(
        9, 1, (wire.ClusterMember(1, "127.0.0.1:7400"),), (wire.ClusterRoute("orders", (1, 0)),)
    ),
    wire.Publish(10, wire.AckMode.FIRE_AND_FORGET, "s", (wire.Record(b"", b""),)),
    wire.ProducerPublish(
        16, wire.AckMode.FIRE_AND_FORGET, "s", 2**64 - 1, 0, 3, (wire.Record(b"", b"p"),) * 2
    ),
    wire.Ack(11, ()),
    wire.Subscribe(12, "s", None, wire.Start.EARLIEST),
    wire.Subscribe(13, "s", (0, 2), ((2, 40),)),
    wire.Subscribed(14, ((0, 1), (2, 40))),
    wire.Delivery((wire.DeliveredRecord(1, 2, 3, b"key", b"payload"),)),
    wire.ErrorFrame(15, errors.ErrorCode.TOO_OLD, 12, "too old"),
]


@pytest.mark.parametrize("frame", EVERY_FRAME, ids=lambda frame: type(frame).__name__)
def test_every_frame_round_trips(frame: wire.Frame) -> None:
    """Every frame type decodes back to itself, byte-exactly re-encoded (canonical)."""
    data = wire.encode(frame)
    buffer = bytearray(data)
    decoded = wire.Decoder().decode(buffer)
    assert decoded == frame
    assert decoded is not None and wire.encode(decoded) == data


def test_frames_come_out_one_at_a_time() -> None:
    """A buffer holding a frame and a half yields the frame, then waits for the rest."""
    first, second = wire.encode(wire.Done(1)), wire.encode(wire.Done(2))
    buffer = bytearray(first + second[:5])
    decoder = wire.Decoder()
    assert decoder.decode(buffer) == wire.Done(1)
    assert decoder.decode(buffer) is None
    buffer += second[5:]
    assert decoder.decode(buffer) == wire.Done(2)
    assert decoder.decode(buffer) is None


def header(body_len: int, frame_type: int, flags: int = 0) -> bytearray:
    return bytearray(struct.pack("<IBB", body_len, frame_type, flags))


def test_header_is_judged_before_the_body() -> None:
    """Oversized length, unknown type and non-zero flags fail from the 6 header bytes alone."""
    decoder = wire.Decoder(wire.Limits(max_frame_bytes=100))
    with pytest.raises(errors.FrameTooLargeError) as too_large:
        decoder.decode(header(101, wire.FrameType.DONE))
    assert too_large.value.code == 3
    assert decoder.decode(header(100, wire.FrameType.DONE)) is None
    with pytest.raises(errors.UnknownFrameTypeError) as unknown:
        decoder.decode(header(8, 0x7E))
    assert unknown.value.code == 4
    with pytest.raises(errors.MalformedError):
        decoder.decode(header(8, wire.FrameType.DONE, flags=1))


def body_frame(frame_type: int, body: bytes) -> bytearray:
    return header(len(body), frame_type) + body


def test_decoding_rules() -> None:
    """Section 7: limits before bytes, lists checked against what remains, enums, trailing
    bytes and UTF-8, each with its error code."""
    decoder = wire.Decoder(wire.Limits(max_name_bytes=4, max_shards=8))
    request = struct.pack("<Q", 1)
    cases: list[tuple[bytes, int, type[errors.FelixError]]] = [
        # A name over the limit: LimitExceeded, even though its bytes are missing.
        (request + struct.pack("<H", 5), wire.FrameType.DESCRIBE_STREAM, errors.LimitExceededError),
        # A name within the limit whose bytes are missing: Malformed.
        (
            request + struct.pack("<H", 3) + b"ab",
            wire.FrameType.DESCRIBE_STREAM,
            errors.MalformedError,
        ),
        # Invalid UTF-8.
        (
            request + struct.pack("<H", 2) + b"\xff\xfe",
            wire.FrameType.DESCRIBE_STREAM,
            errors.MalformedError,
        ),
        # Trailing bytes.
        (request + b"\x00", wire.FrameType.DONE, errors.MalformedError),
        # A body shorter than a fixed field.
        (b"\x01\x02", wire.FrameType.DONE, errors.MalformedError),
        # A list count over its limit, then one whose items cannot fit in what remains.
        (request + struct.pack("<I", 9), wire.FrameType.ACK, errors.LimitExceededError),
        (request + struct.pack("<I", 2) + bytes(16), wire.FrameType.ACK, errors.MalformedError),
        # An unknown enum value and an unknown error code.
        (
            request + struct.pack("<H", 1) + b"s" + struct.pack("<I", 1) + b"\x07",
            wire.FrameType.CREATE_STREAM,
            errors.MalformedError,
        ),
        (request + struct.pack("<HQH", 999, 0, 0), wire.FrameType.ERROR, errors.MalformedError),
        # A TOKEN bit without the token bytes.
        (struct.pack("<HHQH", 1, 1, 1, 0), wire.FrameType.HELLO, errors.MalformedError),
    ]
    for body, frame_type, expected in cases:
        with pytest.raises(expected):
            decoder.decode(body_frame(frame_type, body))


def test_producer_publish_decoding_rules() -> None:
    """A ProducerPublish is checked like a Publish: its fixed fields must be there, the record
    count is limited and checked against what remains (6 bytes a record), no trailing bytes."""
    decoder = wire.Decoder(wire.Limits(max_batch_records=2))
    head = struct.pack("<QB", 1, 0) + struct.pack("<H", 1) + b"s"
    producer = struct.pack("<QQI", 9, 1, 0)
    record = struct.pack("<H", 1) + b"k" + struct.pack("<I", 0)
    good = head + producer + struct.pack("<I", 1) + record
    decoded = decoder.decode(body_frame(wire.FrameType.PRODUCER_PUBLISH, good))
    assert decoded == wire.ProducerPublish(
        1, wire.AckMode.ACKED, "s", 9, 1, 0, (wire.Record(b"k", b""),)
    )
    cases: list[tuple[bytes, type[errors.FelixError]]] = [
        # The producer fields cut short.
        (head + producer[:10], errors.MalformedError),
        # More records than the limit, then more than the body can hold.
        (head + producer + struct.pack("<I", 3), errors.LimitExceededError),
        (head + producer + struct.pack("<I", 2) + record, errors.MalformedError),
        # An unknown ack mode.
        (
            struct.pack("<QB", 1, 2) + head[9:] + producer + struct.pack("<I", 0),
            errors.MalformedError,
        ),
        # Trailing bytes.
        (good + b"\x00", errors.MalformedError),
    ]
    for body, expected in cases:
        with pytest.raises(expected):
            decoder.decode(body_frame(wire.FrameType.PRODUCER_PUBLISH, body))


def test_route_core_count_must_match_shard_count() -> None:
    """A HelloOk route whose core list differs from its shard count is Malformed."""
    bad = wire.StreamRoute("s", wire.StreamKind.IN_MEMORY, 3, wire.HashKind.FNV1A_64, (0, 1))
    data = bytearray(wire.encode(wire.HelloOk(1, 0, wire.Limits(), (), (bad,))))
    with pytest.raises(errors.MalformedError):
        wire.Decoder().decode(data)


def test_long_texts_are_truncated_on_a_character_boundary() -> None:
    """A client name over 255 bytes is cut on a UTF-8 character boundary, like the Rust encoder."""
    frame = wire.Hello(1, 1, 0, "é" * 200)
    decoded = wire.Decoder().decode(bytearray(wire.encode(frame)))
    assert isinstance(decoded, wire.Hello)
    assert decoded.client_name == "é" * 127


def test_outgoing_checks_match_the_limits() -> None:
    """check_outgoing refuses what the broker's decoder would, with the same error class."""
    limits = wire.Limits(max_key_bytes=2, max_batch_records=1)
    ok = wire.Publish(1, wire.AckMode.ACKED, "s", (wire.Record(b"ab", b""),))
    wire.check_outgoing(ok, limits)
    with pytest.raises(errors.LimitExceededError):
        wire.check_outgoing(
            wire.Publish(1, wire.AckMode.ACKED, "s", (wire.Record(b"abc", b""),)), limits
        )
    with pytest.raises(errors.LimitExceededError):
        wire.check_outgoing(
            wire.Publish(1, wire.AckMode.ACKED, "s", (wire.Record(b"", b""),) * 2), limits
        )
    produced = wire.ProducerPublish(1, wire.AckMode.ACKED, "s", 5, 1, 0, (wire.Record(b"ab", b""),))
    wire.check_outgoing(produced, limits)
    with pytest.raises(errors.LimitExceededError):
        wire.check_outgoing(
            wire.ProducerPublish(1, wire.AckMode.ACKED, "s", 5, 1, 0, (wire.Record(b"abc", b""),)),
            limits,
        )


def test_every_code_has_its_exception() -> None:
    """Each wire error code maps to its own exception class carrying that code."""
    classes = set()
    for code in errors.ErrorCode:
        error = errors.error_for_code(code, "m", 5)
        assert error.code == code and error.detail == 5 and error.message == "m"
        assert isinstance(error, errors.FelixError)
        assert code.wire_name in str(error)
        classes.add(type(error))
    assert len(classes) == len(errors.ErrorCode)
    assert errors.FelixConnectionError("gone").code == 0


def test_lag_message_positions() -> None:
    """The subscriber_lagged message's shard:next_offset list parses; a truncated one says so."""
    lagged = errors.SubscriberLaggedError(
        "subscriber fell behind live delivery; resume from shard:next_offset 0:120 1:97"
    )
    assert lagged.announced_positions() == ({0: 120, 1: 97}, True)
    truncated = errors.SubscriberLaggedError(
        "subscriber fell behind live delivery; resume from shard:next_offset 0:120 1:97 ..."
    )
    assert truncated.announced_positions() == ({0: 120, 1: 97}, False)
    assert errors.SubscriberLaggedError("reset").announced_positions() == ({}, False)


def test_hostile_bytes_raise_only_typed_errors() -> None:
    """Mutated and truncated frames never make the decoder raise anything but a FelixError
    with a wire code (a seeded, bounded search)."""
    import random

    rng = random.Random(30)
    decoder = wire.Decoder(wire.Limits(max_frame_bytes=4096, max_shards=16))
    originals = [wire.encode(frame) for frame in EVERY_FRAME]
    for _ in range(5000):
        data = bytearray(rng.choice(originals))
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(data))
            data[position] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data) + 1)]
        try:
            # Bounded: each decode takes a frame off or stops.
            for _ in range(len(data)):
                if decoder.decode(data) is None:
                    break
        except errors.FelixError as error:
            assert error.code in (1, 3, 4, 6)
