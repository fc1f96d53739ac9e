"""Felix wire protocol v1 codec (docs/wire-protocol.md): frames, limits, encoder and decoder.

Integers are little-endian; every length and count is explicit and checked against its limit
before anything is allocated for it. The decoder raises only the SDK's typed errors
(:class:`~felix_client.errors.MalformedError`, ``LimitExceededError``, ``FrameTooLargeError``,
``UnknownFrameTypeError``), deciding in the order the specification gives (section 7).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, TypeAlias

from .errors import (
    ErrorCode,
    FrameTooLargeError,
    LimitExceededError,
    MalformedError,
    UnknownFrameTypeError,
)

PROTOCOL_VERSION: Final = 1
ALPN: Final = "felix/1"
FRAME_HEADER_LEN: Final = 6
FEATURE_TOKEN: Final = 0x1
#: ``Hello`` / ``HelloOk`` feature bit 1: the client publishes as an idempotent producer with
#: ``ProducerPublish`` frames (section 4.16); no field in ``Hello``.
FEATURE_PRODUCER: Final = 0x2
#: Bytes a ``ProducerPublish`` carries beyond a ``Publish`` of the same records: the producer
#: id (u64), the sequence (u64) and the shard (u32).
PRODUCER_FIELDS_LEN: Final = 20

# Fixed by the protocol (section 6), not announced.
CLIENT_NAME_BYTES_MAX: Final = 255
TOKEN_BYTES_MAX: Final = 1024
ERROR_MESSAGE_BYTES_MAX: Final = 1024
CORES_MAX: Final = 1024
LISTED_STREAMS_MAX: Final = 65_536
CLUSTER_MEMBERS_MAX: Final = 1024
CLUSTER_ADDRESS_BYTES_MAX: Final = 64

# Smallest encoded size of each list item (section 7): a count times this must fit in what
# remains of the body before the list is read.
_CORE_PORT_LEN: Final = 2
_ROUTE_LEN_MIN: Final = 12
_SHARD_INFO_LEN: Final = 22
_SUMMARY_LEN_MIN: Final = 7
_PUBLISH_RECORD_MIN: Final = 6
_SHARD_ACK_LEN: Final = 16
_SHARD_LEN: Final = 4
_SHARD_OFFSET_LEN: Final = 12
_DELIVERED_RECORD_MIN: Final = 26
_CLUSTER_MEMBER_LEN_MIN: Final = 4
_CLUSTER_ROUTE_LEN_MIN: Final = 6


class FrameType(IntEnum):
    HELLO = 0x01
    HELLO_OK = 0x02
    CREATE_STREAM = 0x10
    DESCRIBE_STREAM = 0x11
    LIST_STREAMS = 0x12
    DELETE_STREAM = 0x13
    STREAM_INFO = 0x14
    STREAM_LIST = 0x15
    DONE = 0x16
    DESCRIBE_CLUSTER = 0x17
    CLUSTER_MAP = 0x18
    PUBLISH = 0x20
    ACK = 0x21
    PRODUCER_PUBLISH = 0x22
    SUBSCRIBE = 0x30
    SUBSCRIBED = 0x31
    DELIVERY = 0x32
    ERROR = 0x7F


class StreamKind(IntEnum):
    """In-memory streams keep a replay ring; durable ones an append-only log."""

    IN_MEMORY = 0
    DURABLE = 1


class HashKind(IntEnum):
    FNV1A_64 = 1


class AckMode(IntEnum):
    ACKED = 0
    FIRE_AND_FORGET = 1


class Start(IntEnum):
    """Where a subscription starts when no offsets are given."""

    LATEST = 0
    EARLIEST = 1


_FROM_OFFSETS: Final = 2
_SHARDS_ALL: Final = 0
_SHARDS_LIST: Final = 1


@dataclass(frozen=True, slots=True)
class Limits:
    """The broker's limits, announced in ``HelloOk`` (section 6)."""

    max_frame_bytes: int = 16 * 1024 * 1024
    max_batch_records: int = 4096
    max_payload_bytes: int = 4 * 1024 * 1024
    max_key_bytes: int = 1024
    max_name_bytes: int = 255
    max_shards: int = 4096


DEFAULT_LIMITS: Final = Limits()


@dataclass(frozen=True, slots=True)
class Record:
    """A record to publish: `key` picks the shard, `payload` is opaque."""

    key: bytes
    payload: bytes


@dataclass(frozen=True, slots=True)
class DeliveredRecord:
    """A record delivered to a subscription."""

    shard: int
    offset: int
    timestamp_us: int
    key: bytes
    payload: bytes


@dataclass(frozen=True, slots=True)
class StreamRoute:
    """A stream's routing in ``HelloOk``: the owning core of each shard."""

    name: str
    kind: StreamKind
    shard_count: int
    hash: HashKind
    shard_cores: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardInfo:
    shard: int
    core: int
    oldest_offset: int
    next_offset: int


@dataclass(frozen=True, slots=True)
class StreamSummary:
    name: str
    kind: StreamKind
    shard_count: int


@dataclass(frozen=True, slots=True)
class ShardAck:
    """A publish's records on `shard` got offsets ``first_offset .. first_offset + count``."""

    shard: int
    first_offset: int
    count: int


@dataclass(frozen=True, slots=True)
class ClusterMember:
    id: int
    addr: str


@dataclass(frozen=True, slots=True)
class ClusterRoute:
    name: str
    leaders: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Hello:
    min_version: int
    max_version: int
    features: int
    client_name: str
    token: bytes | None = None


@dataclass(frozen=True, slots=True)
class HelloOk:
    version: int
    features: int
    limits: Limits
    core_ports: tuple[int, ...]
    shard_map: tuple[StreamRoute, ...]


@dataclass(frozen=True, slots=True)
class CreateStream:
    request_id: int
    name: str
    shard_count: int
    kind: StreamKind


@dataclass(frozen=True, slots=True)
class DescribeStream:
    request_id: int
    name: str


@dataclass(frozen=True, slots=True)
class ListStreams:
    request_id: int


@dataclass(frozen=True, slots=True)
class DeleteStream:
    request_id: int
    name: str


@dataclass(frozen=True, slots=True)
class StreamInfo:
    request_id: int
    name: str
    kind: StreamKind
    hash: HashKind
    shards: tuple[ShardInfo, ...]


@dataclass(frozen=True, slots=True)
class StreamList:
    request_id: int
    streams: tuple[StreamSummary, ...]


@dataclass(frozen=True, slots=True)
class Done:
    request_id: int


@dataclass(frozen=True, slots=True)
class DescribeCluster:
    request_id: int


@dataclass(frozen=True, slots=True)
class ClusterMap:
    request_id: int
    member: int
    members: tuple[ClusterMember, ...]
    streams: tuple[ClusterRoute, ...]


@dataclass(frozen=True, slots=True)
class Publish:
    request_id: int
    ack: AckMode
    stream: str
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class ProducerPublish:
    """A ``Publish`` of an idempotent producer (section 4.16): batch `sequence` (1, 2, 3, ...
    per shard; 0 = no deduplication) of producer `producer`, every record on `shard`."""

    request_id: int
    ack: AckMode
    stream: str
    producer: int
    sequence: int
    shard: int
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class Ack:
    request_id: int
    shards: tuple[ShardAck, ...]


@dataclass(frozen=True, slots=True)
class Subscribe:
    """`shards` None selects every shard; `start` is a :class:`Start` or (shard, offset) pairs."""

    request_id: int
    stream: str
    shards: tuple[int, ...] | None
    start: Start | tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Subscribed:
    request_id: int
    shards: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Delivery:
    records: tuple[DeliveredRecord, ...]


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    request_id: int
    code: ErrorCode
    detail: int
    message: str


Frame: TypeAlias = (
    Hello
    | HelloOk
    | CreateStream
    | DescribeStream
    | ListStreams
    | DeleteStream
    | StreamInfo
    | StreamList
    | Done
    | DescribeCluster
    | ClusterMap
    | Publish
    | ProducerPublish
    | Ack
    | Subscribe
    | Subscribed
    | Delivery
    | ErrorFrame
)

# ---------------------------------------------------------------------------------------------
# Encoding

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<IBB")


def _truncate_utf8(text: str, max_bytes: int) -> bytes:
    """`text` as UTF-8, cut at a character boundary to at most `max_bytes` (as the Rust
    encoder does for client names and error messages)."""
    data = text.encode()
    if len(data) <= max_bytes:
        return data
    return data[:max_bytes].decode(errors="ignore").encode()


class _Writer:
    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, value: int) -> None:
        self.parts.append(bytes((value,)))

    def u16(self, value: int) -> None:
        self.parts.append(_U16.pack(value))

    def u32(self, value: int) -> None:
        self.parts.append(_U32.pack(value))

    def u64(self, value: int) -> None:
        self.parts.append(_U64.pack(value))

    def bytes16(self, data: bytes) -> None:
        self.u16(len(data))
        self.parts.append(data)

    def bytes32(self, data: bytes) -> None:
        self.u32(len(data))
        self.parts.append(data)

    def str16(self, text: str) -> None:
        self.bytes16(text.encode())


def _body(frame: Frame, w: _Writer) -> FrameType:
    match frame:
        case Hello():
            # The token bit says whether a token follows: it is set exactly when there is one.
            features = frame.features & ~FEATURE_TOKEN
            if frame.token is not None:
                features |= FEATURE_TOKEN
            w.u16(frame.min_version)
            w.u16(frame.max_version)
            w.u64(features)
            w.bytes16(_truncate_utf8(frame.client_name, CLIENT_NAME_BYTES_MAX))
            if frame.token is not None:
                w.bytes16(frame.token)
            return FrameType.HELLO
        case HelloOk():
            limits = frame.limits
            w.u16(frame.version)
            w.u64(frame.features)
            w.u32(limits.max_frame_bytes)
            w.u32(limits.max_batch_records)
            w.u32(limits.max_payload_bytes)
            w.u16(limits.max_key_bytes)
            w.u16(limits.max_name_bytes)
            w.u32(limits.max_shards)
            w.u32(len(frame.core_ports))
            for port in frame.core_ports:
                w.u16(port)
            w.u32(len(frame.shard_map))
            for route in frame.shard_map:
                w.str16(route.name)
                w.u8(route.kind)
                w.u32(route.shard_count)
                w.u8(route.hash)
                w.u32(len(route.shard_cores))
                for core in route.shard_cores:
                    w.u16(core)
            return FrameType.HELLO_OK
        case CreateStream():
            w.u64(frame.request_id)
            w.str16(frame.name)
            w.u32(frame.shard_count)
            w.u8(frame.kind)
            return FrameType.CREATE_STREAM
        case DescribeStream():
            w.u64(frame.request_id)
            w.str16(frame.name)
            return FrameType.DESCRIBE_STREAM
        case ListStreams():
            w.u64(frame.request_id)
            return FrameType.LIST_STREAMS
        case DeleteStream():
            w.u64(frame.request_id)
            w.str16(frame.name)
            return FrameType.DELETE_STREAM
        case StreamInfo():
            w.u64(frame.request_id)
            w.str16(frame.name)
            w.u8(frame.kind)
            w.u8(frame.hash)
            w.u32(len(frame.shards))
            for shard in frame.shards:
                w.u32(shard.shard)
                w.u16(shard.core)
                w.u64(shard.oldest_offset)
                w.u64(shard.next_offset)
            return FrameType.STREAM_INFO
        case StreamList():
            w.u64(frame.request_id)
            w.u32(len(frame.streams))
            for summary in frame.streams:
                w.str16(summary.name)
                w.u8(summary.kind)
                w.u32(summary.shard_count)
            return FrameType.STREAM_LIST
        case Done():
            w.u64(frame.request_id)
            return FrameType.DONE
        case DescribeCluster():
            w.u64(frame.request_id)
            return FrameType.DESCRIBE_CLUSTER
        case ClusterMap():
            w.u64(frame.request_id)
            w.u16(frame.member)
            w.u32(len(frame.members))
            for member in frame.members:
                w.u16(member.id)
                w.str16(member.addr)
            w.u32(len(frame.streams))
            for cluster_route in frame.streams:
                w.str16(cluster_route.name)
                w.u32(len(cluster_route.leaders))
                for leader in cluster_route.leaders:
                    w.u16(leader)
            return FrameType.CLUSTER_MAP
        case Publish():
            w.u64(frame.request_id)
            w.u8(frame.ack)
            w.str16(frame.stream)
            w.u32(len(frame.records))
            for record in frame.records:
                w.bytes16(record.key)
                w.bytes32(record.payload)
            return FrameType.PUBLISH
        case ProducerPublish():
            w.u64(frame.request_id)
            w.u8(frame.ack)
            w.str16(frame.stream)
            w.u64(frame.producer)
            w.u64(frame.sequence)
            w.u32(frame.shard)
            w.u32(len(frame.records))
            for record in frame.records:
                w.bytes16(record.key)
                w.bytes32(record.payload)
            return FrameType.PRODUCER_PUBLISH
        case Ack():
            w.u64(frame.request_id)
            w.u32(len(frame.shards))
            for ack in frame.shards:
                w.u32(ack.shard)
                w.u64(ack.first_offset)
                w.u32(ack.count)
            return FrameType.ACK
        case Subscribe():
            w.u64(frame.request_id)
            w.str16(frame.stream)
            if frame.shards is None:
                w.u8(_SHARDS_ALL)
            else:
                w.u8(_SHARDS_LIST)
                w.u32(len(frame.shards))
                for index in frame.shards:
                    w.u32(index)
            if isinstance(frame.start, Start):
                w.u8(frame.start)
            else:
                w.u8(_FROM_OFFSETS)
                _put_shard_offsets(w, frame.start)
            return FrameType.SUBSCRIBE
        case Subscribed():
            w.u64(frame.request_id)
            _put_shard_offsets(w, frame.shards)
            return FrameType.SUBSCRIBED
        case Delivery():
            w.u32(len(frame.records))
            for delivered in frame.records:
                w.u32(delivered.shard)
                w.u64(delivered.offset)
                w.u64(delivered.timestamp_us)
                w.bytes16(delivered.key)
                w.bytes32(delivered.payload)
            return FrameType.DELIVERY
        case ErrorFrame():
            w.u64(frame.request_id)
            w.u16(frame.code)
            w.u64(frame.detail)
            w.bytes16(_truncate_utf8(frame.message, ERROR_MESSAGE_BYTES_MAX))
            return FrameType.ERROR
    raise TypeError(f"not a Felix frame: {frame!r}")


def _put_shard_offsets(w: _Writer, pairs: Sequence[tuple[int, int]]) -> None:
    w.u32(len(pairs))
    for shard, offset in pairs:
        w.u32(shard)
        w.u64(offset)


def encode(frame: Frame) -> bytes:
    """The canonical encoding of `frame`, header included.

    The encoder does not check limits (use :func:`check_outgoing` first): a frame the broker
    cannot decode costs the whole QUIC stream it travels on.
    """
    w = _Writer()
    frame_type = _body(frame, w)
    body = b"".join(w.parts)
    return _HEADER.pack(len(body), frame_type, 0) + body


# ---------------------------------------------------------------------------------------------
# Outgoing checks: what the broker's decoder would refuse, refused before sending.


def _check_len(what: str, value: int, limit: int) -> None:
    if value > limit:
        raise LimitExceededError(f"{what} of {value} exceeds the limit of {limit}")


def check_outgoing(frame: Frame, limits: Limits) -> None:
    """Raises the error the broker's decoder would answer for `frame` (section 7), so that a
    bad request fails alone instead of ending the stream it would be sent on."""
    match frame:
        case Hello():
            if frame.token is not None:
                _check_len("token length", len(frame.token), TOKEN_BYTES_MAX)
        case CreateStream() | DescribeStream() | DeleteStream():
            _check_len("stream name length", len(frame.name.encode()), limits.max_name_bytes)
        case Publish() | ProducerPublish():
            _check_len("stream name length", len(frame.stream.encode()), limits.max_name_bytes)
            _check_len("record count", len(frame.records), limits.max_batch_records)
            for record in frame.records:
                _check_len("key length", len(record.key), limits.max_key_bytes)
                _check_len("payload length", len(record.payload), limits.max_payload_bytes)
        case Subscribe():
            _check_len("stream name length", len(frame.stream.encode()), limits.max_name_bytes)
            if frame.shards is not None:
                _check_len("shard count", len(frame.shards), limits.max_shards)
            if not isinstance(frame.start, Start):
                _check_len("shard count", len(frame.start), limits.max_shards)
        case _:
            pass


def encoded_publish_len(stream: str, records: Sequence[Record]) -> int:
    """Body length of a ``Publish`` of `records` (15 + n + sum(6 + k + p))."""
    return 15 + len(stream.encode()) + sum(6 + len(r.key) + len(r.payload) for r in records)


def encoded_producer_publish_len(stream: str, records: Sequence[Record]) -> int:
    """Body length of a ``ProducerPublish`` of `records` (35 + n + sum(6 + k + p)): a
    ``Publish`` of the same records plus :data:`PRODUCER_FIELDS_LEN`."""
    return encoded_publish_len(stream, records) + PRODUCER_FIELDS_LEN


# ---------------------------------------------------------------------------------------------
# Decoding


def _frame_type(code: int) -> FrameType:
    try:
        return FrameType(code)
    except ValueError:
        raise UnknownFrameTypeError(f"unknown frame type 0x{code:02x}") from None


def _frame_name(frame_type: FrameType) -> str:
    return "".join(part.capitalize() for part in frame_type.name.split("_"))


class _Reader:
    """Reads one frame body field by field; every failure is a typed wire error."""

    __slots__ = ("body", "pos", "frame", "limits")

    def __init__(self, body: memoryview, frame: FrameType, limits: Limits) -> None:
        self.body = body
        self.pos = 0
        self.frame = frame
        self.limits = limits

    def remaining(self) -> int:
        return len(self.body) - self.pos

    def malformed(self, reason: str) -> MalformedError:
        return MalformedError(f"malformed {_frame_name(self.frame)} frame: {reason}")

    def need(self, length: int, what: str) -> None:
        if length > self.remaining():
            raise self.malformed(f"{what}: needs {length} bytes, {self.remaining()} remain")

    def take(self, length: int, what: str) -> bytes:
        self.need(length, what)
        data = bytes(self.body[self.pos : self.pos + length])
        self.pos += length
        return data

    def _int(self, layout: struct.Struct, what: str) -> int:
        self.need(layout.size, what)
        (value,) = layout.unpack_from(self.body, self.pos)
        self.pos += layout.size
        return int(value)

    def u8(self, what: str) -> int:
        self.need(1, what)
        value = self.body[self.pos]
        self.pos += 1
        return value

    def u16(self, what: str) -> int:
        return self._int(_U16, what)

    def u32(self, what: str) -> int:
        return self._int(_U32, what)

    def u64(self, what: str) -> int:
        return self._int(_U64, what)

    def string(self, what: str, limit: int) -> str:
        length = self.u16(what)
        _check_len(what, length, limit)
        data = self.take(length, what)
        try:
            return data.decode()
        except UnicodeDecodeError as error:
            raise self.malformed(f"{what}: invalid UTF-8 ({error.reason})") from None

    def name(self) -> str:
        return self.string("stream name length", self.limits.max_name_bytes)

    def bytes16(self, what_len: str, what: str, limit: int) -> bytes:
        length = self.u16(what_len)
        _check_len(what_len, length, limit)
        return self.take(length, what)

    def key(self) -> bytes:
        return self.bytes16("key length", "key", self.limits.max_key_bytes)

    def payload(self) -> bytes:
        length = self.u32("payload length")
        _check_len("payload length", length, self.limits.max_payload_bytes)
        return self.take(length, "payload")

    def count(self, what: str, limit: int, min_item_len: int) -> int:
        """A list count, checked against its limit and the bytes remaining before any item
        is read, so a hostile count cannot make the reader loop or allocate beyond the body."""
        count = self.u32(what)
        _check_len(what, count, limit)
        needed = count * min_item_len
        if needed > self.remaining():
            raise self.malformed(
                f"{what} {count} needs at least {needed} bytes, {self.remaining()} remain"
            )
        return count

    def stream_kind(self) -> StreamKind:
        code = self.u8("stream kind")
        try:
            return StreamKind(code)
        except ValueError:
            raise self.malformed(f"unknown stream kind {code}") from None

    def hash_kind(self) -> HashKind:
        code = self.u8("hash kind")
        try:
            return HashKind(code)
        except ValueError:
            raise self.malformed(f"unknown hash kind {code}") from None

    def shard_offsets(self) -> tuple[tuple[int, int], ...]:
        count = self.count("shard count", self.limits.max_shards, _SHARD_OFFSET_LEN)
        return tuple((self.u32("shard"), self.u64("offset")) for _ in range(count))

    def finish(self) -> None:
        if self.remaining() != 0:
            raise self.malformed(f"{self.remaining()} trailing bytes")


def _decode_hello(r: _Reader) -> Hello:
    min_version = r.u16("min_version")
    max_version = r.u16("max_version")
    features = r.u64("features")
    client_name = r.string("client name length", CLIENT_NAME_BYTES_MAX)
    token = None
    if features & FEATURE_TOKEN:
        token = r.bytes16("token length", "token", TOKEN_BYTES_MAX)
    return Hello(min_version, max_version, features, client_name, token)


def _decode_hello_ok(r: _Reader) -> HelloOk:
    version = r.u16("version")
    features = r.u64("features")
    limits = Limits(
        max_frame_bytes=r.u32("max_frame_bytes"),
        max_batch_records=r.u32("max_batch_records"),
        max_payload_bytes=r.u32("max_payload_bytes"),
        max_key_bytes=r.u16("max_key_bytes"),
        max_name_bytes=r.u16("max_name_bytes"),
        max_shards=r.u32("max_shards"),
    )
    count = r.count("core port count", CORES_MAX, _CORE_PORT_LEN)
    core_ports = tuple(r.u16("core port") for _ in range(count))
    count = r.count("stream count", LISTED_STREAMS_MAX, _ROUTE_LEN_MIN)
    routes = []
    for _ in range(count):
        # The routes are limited by the limits this very frame announces.
        name = r.string("stream name length", limits.max_name_bytes)
        kind = r.stream_kind()
        shard_count = r.u32("shard_count")
        hash_kind = r.hash_kind()
        cores = r.count("shard count", limits.max_shards, _CORE_PORT_LEN)
        if cores != shard_count:
            raise r.malformed(f"route of {shard_count} shards lists {cores} shard cores")
        shard_cores = tuple(r.u16("shard core") for _ in range(cores))
        routes.append(StreamRoute(name, kind, shard_count, hash_kind, shard_cores))
    return HelloOk(version, features, limits, core_ports, tuple(routes))


def _decode_stream_info(r: _Reader) -> StreamInfo:
    request_id = r.u64("request_id")
    name = r.name()
    kind = r.stream_kind()
    hash_kind = r.hash_kind()
    count = r.count("shard count", r.limits.max_shards, _SHARD_INFO_LEN)
    shards = tuple(
        ShardInfo(r.u32("shard"), r.u16("core"), r.u64("oldest_offset"), r.u64("next_offset"))
        for _ in range(count)
    )
    return StreamInfo(request_id, name, kind, hash_kind, shards)


def _decode_stream_list(r: _Reader) -> StreamList:
    request_id = r.u64("request_id")
    count = r.count("stream count", LISTED_STREAMS_MAX, _SUMMARY_LEN_MIN)
    streams = []
    for _ in range(count):
        name = r.name()
        kind = r.stream_kind()
        streams.append(StreamSummary(name, kind, r.u32("shard_count")))
    return StreamList(request_id, tuple(streams))


def _decode_cluster_map(r: _Reader) -> ClusterMap:
    request_id = r.u64("request_id")
    member = r.u16("member")
    count = r.count("member count", CLUSTER_MEMBERS_MAX, _CLUSTER_MEMBER_LEN_MIN)
    members = []
    for _ in range(count):
        member_id = r.u16("member id")
        members.append(
            ClusterMember(member_id, r.string("member address length", CLUSTER_ADDRESS_BYTES_MAX))
        )
    count = r.count("stream count", LISTED_STREAMS_MAX, _CLUSTER_ROUTE_LEN_MIN)
    streams = []
    for _ in range(count):
        name = r.name()
        leaders_count = r.count("shard count", r.limits.max_shards, 2)
        streams.append(ClusterRoute(name, tuple(r.u16("leader") for _ in range(leaders_count))))
    return ClusterMap(request_id, member, tuple(members), tuple(streams))


def _decode_ack_mode(r: _Reader) -> AckMode:
    ack_code = r.u8("ack mode")
    try:
        return AckMode(ack_code)
    except ValueError:
        raise r.malformed(f"unknown ack mode {ack_code}") from None


def _decode_records(r: _Reader) -> tuple[Record, ...]:
    count = r.count("record count", r.limits.max_batch_records, _PUBLISH_RECORD_MIN)
    records = []
    for _ in range(count):
        key = r.key()
        records.append(Record(key, r.payload()))
    return tuple(records)


def _decode_publish(r: _Reader) -> Publish:
    request_id = r.u64("request_id")
    ack = _decode_ack_mode(r)
    stream = r.name()
    return Publish(request_id, ack, stream, _decode_records(r))


def _decode_producer_publish(r: _Reader) -> ProducerPublish:
    request_id = r.u64("request_id")
    ack = _decode_ack_mode(r)
    stream = r.name()
    producer = r.u64("producer")
    sequence = r.u64("sequence")
    shard = r.u32("shard")
    return ProducerPublish(request_id, ack, stream, producer, sequence, shard, _decode_records(r))


def _decode_ack(r: _Reader) -> Ack:
    request_id = r.u64("request_id")
    count = r.count("shard count", r.limits.max_shards, _SHARD_ACK_LEN)
    shards = tuple(
        ShardAck(r.u32("shard"), r.u64("first_offset"), r.u32("count")) for _ in range(count)
    )
    return Ack(request_id, shards)


def _decode_subscribe(r: _Reader) -> Subscribe:
    request_id = r.u64("request_id")
    stream = r.name()
    selection = r.u8("shard selection")
    shards: tuple[int, ...] | None
    if selection == _SHARDS_ALL:
        shards = None
    elif selection == _SHARDS_LIST:
        count = r.count("shard count", r.limits.max_shards, _SHARD_LEN)
        shards = tuple(r.u32("shard") for _ in range(count))
    else:
        raise r.malformed(f"unknown shard selection {selection}")
    position = r.u8("start position")
    start: Start | tuple[tuple[int, int], ...]
    if position == _FROM_OFFSETS:
        start = r.shard_offsets()
    elif position in (Start.LATEST, Start.EARLIEST):
        start = Start(position)
    else:
        raise r.malformed(f"unknown start position {position}")
    return Subscribe(request_id, stream, shards, start)


def _decode_delivery(r: _Reader) -> Delivery:
    count = r.count("record count", r.limits.max_batch_records, _DELIVERED_RECORD_MIN)
    records = []
    for _ in range(count):
        shard = r.u32("shard")
        offset = r.u64("offset")
        timestamp_us = r.u64("timestamp_us")
        key = r.key()
        records.append(DeliveredRecord(shard, offset, timestamp_us, key, r.payload()))
    return Delivery(tuple(records))


def _decode_error(r: _Reader) -> ErrorFrame:
    request_id = r.u64("request_id")
    code = r.u16("error code")
    try:
        error_code = ErrorCode(code)
    except ValueError:
        raise r.malformed(f"unknown error code {code}") from None
    detail = r.u64("detail")
    message = r.string("error message length", ERROR_MESSAGE_BYTES_MAX)
    return ErrorFrame(request_id, error_code, detail, message)


def _decode_fields(r: _Reader) -> Frame:
    match r.frame:
        case FrameType.HELLO:
            return _decode_hello(r)
        case FrameType.HELLO_OK:
            return _decode_hello_ok(r)
        case FrameType.CREATE_STREAM:
            request_id = r.u64("request_id")
            name = r.name()
            shard_count = r.u32("shard_count")
            return CreateStream(request_id, name, shard_count, r.stream_kind())
        case FrameType.DESCRIBE_STREAM:
            request_id = r.u64("request_id")
            return DescribeStream(request_id, r.name())
        case FrameType.LIST_STREAMS:
            return ListStreams(r.u64("request_id"))
        case FrameType.DELETE_STREAM:
            request_id = r.u64("request_id")
            return DeleteStream(request_id, r.name())
        case FrameType.STREAM_INFO:
            return _decode_stream_info(r)
        case FrameType.STREAM_LIST:
            return _decode_stream_list(r)
        case FrameType.DONE:
            return Done(r.u64("request_id"))
        case FrameType.DESCRIBE_CLUSTER:
            return DescribeCluster(r.u64("request_id"))
        case FrameType.CLUSTER_MAP:
            return _decode_cluster_map(r)
        case FrameType.PUBLISH:
            return _decode_publish(r)
        case FrameType.PRODUCER_PUBLISH:
            return _decode_producer_publish(r)
        case FrameType.ACK:
            return _decode_ack(r)
        case FrameType.SUBSCRIBE:
            return _decode_subscribe(r)
        case FrameType.SUBSCRIBED:
            request_id = r.u64("request_id")
            return Subscribed(request_id, r.shard_offsets())
        case FrameType.DELIVERY:
            return _decode_delivery(r)
        case FrameType.ERROR:
            return _decode_error(r)


class Decoder:
    """Decodes frames under `limits` (a client uses the broker's announced limits, and the
    protocol defaults until ``HelloOk`` arrives)."""

    __slots__ = ("limits",)

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits

    def frame_len(self, header: bytes | bytearray | memoryview) -> int:
        """Judges a 6-byte header before its body arrives (section 2): too large, unknown
        type, non-zero flags. Returns the whole frame's length."""
        body_len, type_code, flags = _HEADER.unpack_from(header)
        if body_len > self.limits.max_frame_bytes:
            raise FrameTooLargeError(
                f"frame body of {body_len} bytes exceeds the limit of "
                f"{self.limits.max_frame_bytes} bytes"
            )
        frame_type = _frame_type(type_code)
        if flags != 0:
            raise MalformedError(
                f"malformed {_frame_name(frame_type)} frame: flags 0x{flags:02x} (v1 defines none)"
            )
        return FRAME_HEADER_LEN + int(body_len)

    def decode_body(self, frame_type: int, body: bytes | bytearray | memoryview) -> Frame:
        """Decodes exactly one frame body (header already removed)."""
        r = _Reader(memoryview(body), _frame_type(frame_type), self.limits)
        frame = _decode_fields(r)
        r.finish()
        return frame

    def decode(self, buffer: bytearray) -> Frame | None:
        """Takes one whole frame off the front of `buffer`, or returns None (buffer untouched)
        if it is not all there yet. The header is judged as soon as it is present."""
        if len(buffer) < FRAME_HEADER_LEN:
            return None
        total = self.frame_len(buffer)
        if len(buffer) < total:
            return None
        # A copy of the body, so that no view pins `buffer` (it must stay resizable).
        frame = self.decode_body(buffer[4], bytes(buffer[FRAME_HEADER_LEN:total]))
        del buffer[:total]
        return frame
