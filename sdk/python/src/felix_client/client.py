"""The Felix client: connect, stream admin, publish and subscribe."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, TypeAlias, TypeVar

from . import wire
from ._transport import Budget, Connection, RequestStream, error_from_code, error_from_frame
from .config import PUBLISH_RETRY_BACKOFF_MAX, ClientConfig
from .errors import (
    ErrorCode,
    FelixConnectionError,
    FelixError,
    InvalidArgumentError,
    LimitExceededError,
    MalformedError,
    ProtocolViolationError,
    SubscriberLaggedError,
)
from .hash import shard_for_key
from .wire import DeliveredRecord, Record, ShardAck, Start, StreamInfo, StreamKind, StreamSummary

_log = logging.getLogger("felix_client")
_F = TypeVar("_F", bound=wire.Frame)

#: Something to publish: a :class:`Record`, or a ``(key, payload)`` pair of bytes or str
#: (str is sent as UTF-8).
RecordLike: TypeAlias = Record | tuple[bytes | str, bytes | str]
#: Where a subscription starts: :attr:`Start.LATEST`, :attr:`Start.EARLIEST`, or a mapping of
#: shard -> first offset to deliver (selected shards not listed start at latest).
StartLike: TypeAlias = Start | Mapping[int, int]

LATEST: Final = Start.LATEST
EARLIEST: Final = Start.EARLIEST

# QUIC application code that stops a subscription: 0, a normal end.
_STOP_CODE: Final = 0
# Bytes of one delivered record beyond its key and payload.
_DELIVERED_RECORD_OVERHEAD: Final = 26


def _record_cost(item: DeliveredRecord) -> int:
    return _DELIVERED_RECORD_OVERHEAD + len(item.key) + len(item.payload)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _as_record(item: RecordLike) -> Record:
    if isinstance(item, Record):
        return item
    key, payload = item
    return Record(_as_bytes(key), _as_bytes(payload))


def record(key: bytes | str, payload: bytes | str) -> Record:
    """A record to publish; `key` picks the shard (str is sent as UTF-8)."""
    return Record(_as_bytes(key), _as_bytes(payload))


_U64_MAX: Final = (1 << 64) - 1


def random_producer_id() -> int:
    """A random non-zero 64-bit producer id (docs/semantics.md, "Idempotent producers": two
    of `n` live producers collide with probability about n^2 / 2^65)."""
    while True:
        producer = secrets.randbits(64)
        if producer != 0:
            return producer


class _Producer:
    """An idempotent producer's numbering: per (stream, shard), the producer id its batches
    carry and the last sequence given."""

    def __init__(self, producer_id: int) -> None:
        self.id = producer_id
        self._shards: dict[tuple[str, int], tuple[int, int]] = {}

    def next(self, stream: str, shard: int) -> tuple[int, int]:
        """The producer id and the next sequence (1, 2, 3, ...) of `stream`'s `shard`."""
        producer, last = self._shards.get((stream, shard), (self.id, 0))
        self._shards[(stream, shard)] = (producer, last + 1)
        return producer, last + 1

    def current(self, stream: str, shard: int, producer: int) -> bool:
        """Whether `stream`'s `shard` still goes out as `producer`."""
        entry = self._shards.get((stream, shard))
        return entry is not None and entry[0] == producer

    def abandon(self, stream: str, shard: int, producer: int) -> None:
        """A batch of `producer` on this shard ended in an error: its sequence is a gap the
        broker would refuse every later batch for, so the shard's later batches go out under
        a fresh random id from sequence 1 (unless that happened already). Batches pipelined
        behind it under the old id are refused (``out_of_sequence``), not retried."""
        if self.current(stream, shard, producer):
            self._shards[(stream, shard)] = (random_producer_id(), 0)

    def forget(self, stream: str) -> None:
        """`stream` was deleted: a stream created again under its name knows no producer."""
        for key in [key for key in self._shards if key[0] == stream]:
            del self._shards[key]


def _retryable(answer: wire.ErrorFrame, sequence: int) -> bool:
    """Whether an idempotent batch answered `answer` is worth sending again as it is: the
    broker took nothing of it (``ingress_budget_exhausted``), its original is still being
    stored or a replicated shard did not commit it in time (``unavailable`` naming its
    sequence: a retry is applied once either way), or an earlier batch of the producer on
    that shard is still missing (``out_of_sequence`` naming a sequence below this one: the
    earlier batch's own retry fills the gap)."""
    match answer.code:
        case ErrorCode.INGRESS_BUDGET_EXHAUSTED:
            return True
        case ErrorCode.UNAVAILABLE:
            return answer.detail != 0
        case ErrorCode.OUT_OF_SEQUENCE:
            return 0 != answer.detail < sequence
    return False


def _check_u64(what: str, value: int) -> None:
    if not 0 <= value <= _U64_MAX:
        raise InvalidArgumentError(f"{what} {value} is not a 64-bit unsigned integer")


def _check_config(config: ClientConfig) -> None:
    """Refuses producer settings the client cannot use, before connecting."""
    if config.producer_id is not None and not 0 < config.producer_id <= _U64_MAX:
        raise InvalidArgumentError(
            f"producer_id {config.producer_id} is not a non-zero 64-bit unsigned integer"
        )
    if config.publish_retries < 0:
        raise InvalidArgumentError(f"publish_retries {config.publish_retries} is negative")
    if config.publish_retry_backoff < 0:
        raise InvalidArgumentError(
            f"publish_retry_backoff {config.publish_retry_backoff} is negative"
        )


@dataclass(frozen=True, slots=True)
class _SentBatch:
    """One sent ``ProducerPublish``: what a retry needs to send the same bytes again."""

    conn: Connection
    data: bytes
    stream: str
    shard: int
    producer: int
    sequence: int
    answer: asyncio.Future[wire.Frame]


# Where an encoded frame's request id is: right after the header (every request's first field).
_REQUEST_ID_AT: Final = wire.FRAME_HEADER_LEN


def _with_request_id(data: bytes, request_id: int) -> bytes:
    """The encoded request `data` with its request id replaced."""
    return b"".join(
        (data[:_REQUEST_ID_AT], request_id.to_bytes(8, "little"), data[_REQUEST_ID_AT + 8 :])
    )


class Client:
    """A connection to a Felix broker.

    Use :meth:`connect`, then ``async with client:`` (or :meth:`close`). Core-aware (the
    default), the client also opens, on first use, one connection per data-plane core on that
    core's own port, and sends each shard's records to (and subscribes on) the core that owns
    the shard, as the Rust client does.
    """

    def __init__(self, config: ClientConfig, primary: Connection) -> None:
        self._config = config
        self._primary = primary
        hello = primary.hello
        assert hello is not None
        self._hello = hello
        self._cores: dict[int, Connection] = {}
        self._core_opening: dict[int, asyncio.Task[Connection]] = {}
        self._routes: dict[str, tuple[int, ...]] = {
            route.name: route.shard_cores for route in hello.shard_map
        }
        self._budget = Budget(config.publish_inflight_bytes)
        self._request_ids = itertools.count(1)
        self._subscriptions: set[Subscription] = set()
        self._closed = False
        # Routing needs the cores' own ports; a broker that announces none is one endpoint.
        self._core_aware = config.core_aware and bool(hello.core_ports)
        # Idempotent publishing: configured, and the broker echoed the feature.
        self._producer: _Producer | None = None
        if config.idempotent and hello.features & wire.FEATURE_PRODUCER:
            producer_id = config.producer_id
            self._producer = _Producer(random_producer_id() if producer_id is None else producer_id)
        # Retries of idempotent batches still running (cancelled by close).
        self._settling: set[asyncio.Task[list[ShardAck]]] = set()

    @classmethod
    async def connect(cls, config: ClientConfig | None = None) -> Client:
        """Connects to ``config.host:config.port`` (TLS 1.3, ALPN ``felix/1``) and performs
        the ``Hello`` handshake (with the token, if any)."""
        config = config or ClientConfig()
        _check_config(config)
        primary = await Connection.open(config, config.host, config.port)
        return cls(config, primary)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def hello(self) -> wire.HelloOk:
        """The broker's handshake answer: limits, core ports, shard map at connect time."""
        return self._hello

    @property
    def limits(self) -> wire.Limits:
        """The broker's announced limits."""
        return self._hello.limits

    @property
    def producer_id(self) -> int | None:
        """This client's producer id when it publishes as an idempotent producer (configured,
        and the broker echoed ``PRODUCER``); None when its publishes are plain."""
        return None if self._producer is None else self._producer.id

    def core_connections(self) -> int:
        """Per-core connections opened so far (core-aware clients)."""
        return len(self._cores)

    def _next_request_id(self) -> int:
        return next(self._request_ids)

    async def _conn(self, core: int | None) -> Connection:
        """The primary connection, or `core`'s own-port connection (opened on first use)."""
        ports = self._hello.core_ports
        if core is None or not self._core_aware or core >= len(ports):
            return self._primary
        conn = self._cores.get(core)
        if conn is not None:
            if conn.protocol.terminated is None:
                return conn
            # Lost (e.g. idle timeout): its socket goes, a new connection replaces it.
            conn.abort()
        # One opening per core even when many callers want it at once.
        opening = self._core_opening.get(core)
        if opening is None:
            opening = asyncio.ensure_future(
                Connection.open(self._config, self._config.host, ports[core])
            )
            self._core_opening[core] = opening
        try:
            conn = await asyncio.shield(opening)
        finally:
            if opening.done():
                self._core_opening.pop(core, None)
        self._cores[core] = conn
        return conn

    # -- admin ------------------------------------------------------------------------------

    async def _admin(self, frame: wire.Frame, request_id: int) -> wire.Frame:
        wire.check_outgoing(frame, self.limits)
        return await self._primary.request_stream().request(frame, request_id)

    def _remember(self, info: StreamInfo) -> StreamInfo:
        self._routes[info.name] = tuple(shard.core for shard in info.shards)
        return info

    async def create_stream(
        self, name: str, shard_count: int, kind: StreamKind = StreamKind.IN_MEMORY
    ) -> StreamInfo:
        """Creates a stream of `shard_count` shards."""
        request_id = self._next_request_id()
        answer = await self._admin(
            wire.CreateStream(request_id, name, shard_count, kind), request_id
        )
        return self._remember(_expect(answer, wire.StreamInfo))

    async def describe_stream(self, name: str) -> StreamInfo:
        """A stream's kind and each shard's owning core and offsets."""
        request_id = self._next_request_id()
        answer = await self._admin(wire.DescribeStream(request_id, name), request_id)
        return self._remember(_expect(answer, wire.StreamInfo))

    async def list_streams(self) -> list[StreamSummary]:
        """Every stream the connection's principal may see."""
        request_id = self._next_request_id()
        answer = await self._admin(wire.ListStreams(request_id), request_id)
        return list(_expect(answer, wire.StreamList).streams)

    async def delete_stream(self, name: str) -> None:
        """Deletes a stream; its subscribers get ``StreamNotFoundError``."""
        request_id = self._next_request_id()
        answer = await self._admin(wire.DeleteStream(request_id, name), request_id)
        _expect(answer, wire.Done)
        self._routes.pop(name, None)
        if self._producer is not None:
            self._producer.forget(name)

    async def _route(self, stream: str) -> tuple[int, ...] | None:
        """Owning core per shard of `stream`, describing it once if unknown; None if the
        broker cannot describe it (the request then goes to the primary connection, whose
        answer says why)."""
        known = self._routes.get(stream)
        if known is not None:
            return known
        try:
            info = await self.describe_stream(stream)
        except FelixError:
            return None
        return tuple(shard.core for shard in info.shards)

    # -- publish ----------------------------------------------------------------------------

    def _check_batch(self, stream: str, records: Sequence[Record]) -> None:
        if not records:
            raise InvalidArgumentError("a publish needs at least one record")
        wire.check_outgoing(
            wire.Publish(0, wire.AckMode.ACKED, stream, tuple(records)), self.limits
        )

    async def _parts(
        self, stream: str, records: Sequence[Record]
    ) -> list[tuple[int | None, list[Record]]]:
        """The batch split by owning core, batch order kept within each part."""
        self._check_batch(stream, records)
        route = await self._route(stream) if self._core_aware else None
        if not route:
            return [(None, list(records))]
        parts: dict[int, list[Record]] = {}
        for item in records:
            core = route[shard_for_key(item.key, len(route))]
            parts.setdefault(core, []).append(item)
        return list(parts.items())

    def _encode(
        self, request_id: int, ack: wire.AckMode, stream: str, records: Sequence[Record]
    ) -> bytes:
        body_len = wire.encoded_publish_len(stream, records)
        if body_len > self.limits.max_frame_bytes:
            raise LimitExceededError(
                f"a publish of {body_len} bytes exceeds the broker's frame limit of "
                f"{self.limits.max_frame_bytes}; send smaller batches"
            )
        return wire.encode(wire.Publish(request_id, ack, stream, tuple(records)))

    async def publish_pipelined(self, stream: str, records: Iterable[RecordLike]) -> PendingAck:
        """Sends an acked publish and returns once it is sent; await the result for the acks.
        Keep several in flight for throughput: the in-flight byte budget
        (``publish_inflight_bytes``) makes this wait when too much is outstanding.

        As an idempotent producer (:attr:`producer_id` not None) the batch goes out as one
        ``ProducerPublish`` per shard, each with the shard's next sequence, and a retryable
        answer is retried with the same producer id, sequence and records
        (``ClientConfig.publish_retries``), so the batch is stored once."""
        batch = [_as_record(item) for item in records]
        if self._producer is not None:
            self._check_batch(stream, batch)
            route = await self._route(stream)
            if route:
                return await self._publish_produced(self._producer, stream, batch, route)
            # Unknown routing (no such stream, say): a plain publish, which the broker answers.
        answers: list[asyncio.Future[wire.Frame]] = []
        for core, part in await self._parts(stream, batch):
            conn = await self._conn(core)
            request_id = self._next_request_id()
            data = self._encode(request_id, wire.AckMode.ACKED, stream, part)
            held = await self._budget.acquire(len(data))
            publish = conn.publish_stream()
            try:
                answer = publish.expect(request_id)
                publish.send(data)
            except BaseException:
                publish.pending.pop(request_id, None)
                self._budget.release(held)
                raise
            answer.add_done_callback(functools.partial(self._release_on_answer, held))
            answers.append(answer)
        return PendingAck(answers)

    async def _publish_produced(
        self, producer: _Producer, stream: str, batch: list[Record], route: tuple[int, ...]
    ) -> PendingAck:
        """One ``ProducerPublish`` per shard of the batch (batch order kept within each), each
        settled (retried as needed) by a task of its own."""
        by_shard: dict[int, list[Record]] = {}
        for item in batch:
            by_shard.setdefault(shard_for_key(item.key, len(route)), []).append(item)
        # Every part is checked before the first is sent: a publish is refused whole.
        for part in by_shard.values():
            self._check_produced_len(stream, part)
        settling: list[asyncio.Task[list[ShardAck]]] = []
        for shard, part in by_shard.items():
            conn = await self._conn(route[shard] if self._core_aware else None)
            sent = await self._send_produced(conn, stream, shard, part, producer)
            task = asyncio.ensure_future(self._settle(producer, sent))
            # Held here so that the task lives even if the PendingAck is dropped.
            self._settling.add(task)
            task.add_done_callback(self._settled)
            settling.append(task)
        return PendingAck([], settling)

    def _settled(self, task: asyncio.Task[list[ShardAck]]) -> None:
        self._settling.discard(task)
        # Retrieved, so that a PendingAck nobody awaits logs no "exception never retrieved".
        if not task.cancelled():
            task.exception()

    def _check_produced_len(self, stream: str, records: Sequence[Record]) -> int:
        """The body length of a ``ProducerPublish`` of `records`, refused over the broker's
        frame limit."""
        body_len = wire.encoded_producer_publish_len(stream, records)
        if body_len > self.limits.max_frame_bytes:
            raise LimitExceededError(
                f"a publish of {body_len} bytes exceeds the broker's frame limit of "
                f"{self.limits.max_frame_bytes}; send smaller batches"
            )
        return body_len

    async def _send_produced(
        self,
        conn: Connection,
        stream: str,
        shard: int,
        records: Sequence[Record],
        numbering: _Producer | tuple[int, int],
    ) -> _SentBatch:
        """Sends `records` (all of `shard`) as one acked ``ProducerPublish``: the producer's
        next sequence on the shard, or the given (producer, sequence)."""
        body_len = self._check_produced_len(stream, records)
        held = await self._budget.acquire(wire.FRAME_HEADER_LEN + body_len)
        # No await from here on: a sequence is taken only for a frame that goes out (one taken
        # and not sent would be a gap the broker refuses later batches for), and the shard's
        # batches go out on the connection's one publish stream in sequence order.
        taken: tuple[int, int] | None = None
        publish: RequestStream | None = None
        request_id = self._next_request_id()
        try:
            publish = conn.publish_stream()
            if isinstance(numbering, _Producer):
                taken = producer_id, sequence = numbering.next(stream, shard)
            else:
                producer_id, sequence = numbering
            frame = wire.ProducerPublish(
                request_id,
                wire.AckMode.ACKED,
                stream,
                producer_id,
                sequence,
                shard,
                tuple(records),
            )
            data = wire.encode(frame)
            answer = publish.expect(request_id)
            publish.send(data)
        except BaseException:
            if publish is not None:
                publish.pending.pop(request_id, None)
            self._budget.release(held)
            if taken is not None and isinstance(numbering, _Producer):
                numbering.abandon(stream, shard, taken[0])
            raise
        answer.add_done_callback(functools.partial(self._release_on_answer, held))
        return _SentBatch(conn, data, stream, shard, producer_id, sequence, answer)

    async def _settle(self, producer: _Producer, sent: _SentBatch) -> list[ShardAck]:
        """Waits for a batch's ack, sending the batch again (same producer, sequence and
        records; a new request id) after a retryable answer, at most ``publish_retries``
        times with a doubling backoff. A batch that fails for good leaves its shard to a fresh
        producer id (see :meth:`_Producer.abandon`)."""
        try:
            return await self._attempts(producer, sent)
        except BaseException:
            producer.abandon(sent.stream, sent.shard, sent.producer)
            raise

    async def _attempts(self, producer: _Producer, sent: _SentBatch) -> list[ShardAck]:
        answer = sent.answer
        wait = self._config.publish_retry_backoff
        attempts = 0
        while True:
            frame = await answer
            if not isinstance(frame, wire.ErrorFrame):
                return list(_expect(frame, wire.Ack).shards)
            # Another batch of the shard failed for good: the shard went on under a new id.
            abandoned = not producer.current(sent.stream, sent.shard, sent.producer)
            if (
                attempts >= self._config.publish_retries
                or abandoned
                or not _retryable(frame, sent.sequence)
            ):
                raise error_from_frame(frame)
            attempts += 1
            _log.debug(
                "retrying batch %d of producer %#x on %s shard %d after %s (attempt %d)",
                sent.sequence,
                sent.producer,
                sent.stream,
                sent.shard,
                frame.code.wire_name,
                attempts,
            )
            await asyncio.sleep(wait)
            wait = min(wait * 2, PUBLISH_RETRY_BACKOFF_MAX)
            request_id = self._next_request_id()
            publish = sent.conn.publish_stream()
            answer = publish.expect(request_id)
            try:
                publish.send(_with_request_id(sent.data, request_id))
            except BaseException:
                publish.pending.pop(request_id, None)
                raise

    async def publish_sequenced(
        self,
        stream: str,
        records: Iterable[RecordLike],
        *,
        producer: int,
        sequence: int,
        shard: int | None = None,
    ) -> list[ShardAck]:
        """Publishes `records`, every one of `shard` of `stream` (None: the first record's
        shard), as batch `sequence` of idempotent producer `producer`, and waits for the ack;
        sent once, never retried here, and independent of this client's own producer id and
        numbering.

        For applications that number their own batches: a batch whose outcome is unknown (its
        connection or broker went) is sent again with the same producer and sequence, by any
        client, and is stored once (the broker answers with the original ack). Keep one
        producer's sequences per shard dense from 1 (a gap is refused with
        :class:`~felix_client.OutOfSequenceError`).

        Raises :class:`InvalidArgumentError` when the broker did not echo ``PRODUCER`` (also
        with ``idempotent=False``, which does not ask for it) or a record belongs to another
        shard; the broker's refusal otherwise."""
        if not self._hello.features & wire.FEATURE_PRODUCER:
            raise InvalidArgumentError(
                "the broker does not take idempotent producers (PRODUCER not in HelloOk)"
            )
        _check_u64("producer id", producer)
        _check_u64("sequence", sequence)
        batch = [_as_record(item) for item in records]
        self._check_batch(stream, batch)
        route = self._routes.get(stream)
        if not route:
            # Raises the broker's refusal (e.g. StreamNotFoundError).
            info = await self.describe_stream(stream)
            route = tuple(shard_info.core for shard_info in info.shards)
        if shard is None:
            shard = shard_for_key(batch[0].key, len(route))
        if any(shard_for_key(item.key, len(route)) != shard for item in batch):
            raise InvalidArgumentError(
                f"a record of the batch is not on shard {shard} of the {len(route)} of {stream!r}"
            )
        conn = await self._conn(route[shard] if self._core_aware else None)
        sent = await self._send_produced(conn, stream, shard, batch, (producer, sequence))
        frame = await sent.answer
        if isinstance(frame, wire.ErrorFrame):
            raise error_from_frame(frame)
        return list(_expect(frame, wire.Ack).shards)

    def _release_on_answer(self, held: int, _answer: asyncio.Future[wire.Frame]) -> None:
        self._budget.release(held)

    async def publish(
        self, stream: str, records: Iterable[RecordLike], *, ack: bool = True
    ) -> list[ShardAck]:
        """Publishes a batch (all-or-nothing per owning core) and waits for the acks: one per
        shard touched, ascending. With ``ack=False`` (fire-and-forget) it returns ``[]`` once
        the records are queued: the broker answers nothing, not even an error."""
        if not ack:
            await self.publish_no_ack(stream, records)
            return []
        return await (await self.publish_pipelined(stream, records))

    async def publish_no_ack(self, stream: str, records: Iterable[RecordLike]) -> None:
        """Fire-and-forget publish: returns once queued. Its budget is held until the bytes
        are put on the wire."""
        batch = [_as_record(item) for item in records]
        for core, part in await self._parts(stream, batch):
            conn = await self._conn(core)
            data = self._encode(0, wire.AckMode.FIRE_AND_FORGET, stream, part)
            held = await self._budget.acquire(len(data))
            try:
                publish = conn.publish_stream()
                publish.send(data)
            except BaseException:
                self._budget.release(held)
                raise
            conn.hold_until_sent(publish, self._budget, held)

    # -- subscribe --------------------------------------------------------------------------

    async def subscribe(
        self,
        stream: str,
        *,
        shards: Iterable[int] | None = None,
        start: StartLike = Start.LATEST,
        resume_on_lag: bool = False,
    ) -> Subscription:
        """Opens a subscription to `shards` (None: every shard) of `stream`.

        Iterate it with ``async for``; records come in per-shard offset order. When the broker
        ends it as lagged, the iteration raises :class:`SubscriberLaggedError` carrying
        ``resume_positions``; with ``resume_on_lag=True`` the subscription instead subscribes
        again from exactly those positions and carries on (nothing lost, nothing repeated).
        """
        selected = None if shards is None else tuple(shards)
        subscription = Subscription(self, stream, selected, resume_on_lag)
        await subscription._open(start)
        self._subscriptions.add(subscription)
        return subscription

    async def _subscribe_parts(
        self, stream: str, shards: tuple[int, ...] | None, start: StartLike, notify: asyncio.Event
    ) -> list[_SubscriptionPart]:
        route = await self._route(stream) if self._core_aware else None
        offsets = {} if isinstance(start, Start) else dict(start)
        if not route or (shards is not None and not shards):
            # Not core-aware, or a stream/selection the broker will refuse: one subscription
            # on the primary connection, whose answer says why.
            targets: list[tuple[int | None, tuple[int, ...] | None]] = [(None, shards)]
        else:
            selected = range(len(route)) if shards is None else shards
            # Split by core, an offset for a shard outside the selection would silently go
            # nowhere: refuse it as the broker would.
            stray = sorted(set(offsets) - set(selected))
            if stray:
                raise InvalidArgumentError(
                    f"a start offset for shard {stray[0]}, which the subscription does not select"
                )
            by_core: dict[int, list[int]] = {}
            for shard in selected:
                # An out-of-range shard goes to core 0, whose answer names the problem.
                owner = route[shard] if 0 <= shard < len(route) else 0
                by_core.setdefault(owner, []).append(shard)
            targets = [(owner, tuple(listed)) for owner, listed in by_core.items()]
        parts: list[_SubscriptionPart] = []
        try:
            for core, listed in targets:
                part_start: Start | tuple[tuple[int, int], ...]
                if isinstance(start, Start):
                    part_start = start
                else:
                    part_start = tuple(
                        sorted(
                            (shard, offset)
                            for shard, offset in offsets.items()
                            if listed is None or shard in listed
                        )
                    )
                frame = wire.Subscribe(self._next_request_id(), stream, listed, part_start)
                wire.check_outgoing(frame, self.limits)
                conn = await self._conn(core)
                part = _SubscriptionPart(
                    conn, frame, self._config.subscription_window_bytes, notify
                )
                parts.append(part)
                await part.subscribed()
        except BaseException:
            for part in parts:
                part.stop()
            raise
        return parts

    async def close(self) -> None:
        """Ends every subscription and closes every connection (code 0)."""
        if self._closed:
            return
        self._closed = True
        for subscription in list(self._subscriptions):
            subscription.close()
        for task in self._core_opening.values():
            task.cancel()
        # Retries of idempotent batches stop; their PendingAcks raise FelixConnectionError.
        for settling in list(self._settling):
            settling.cancel()
        for conn in [*self._cores.values(), self._primary]:
            await conn.close()


def _expect(frame: wire.Frame, kind: type[_F]) -> _F:
    if not isinstance(frame, kind):
        raise ProtocolViolationError(f"expected {kind.__name__}, got {type(frame).__name__}")
    return frame


class PendingAck(Awaitable[list[ShardAck]]):
    """The acks of a pipelined publish: await it for one :class:`ShardAck` per shard touched
    (ascending), or the publish's typed error. An idempotent publish's retries go on whether
    or not it is awaited (and cancelling the wait does not stop them)."""

    def __init__(
        self,
        answers: list[asyncio.Future[wire.Frame]],
        settling: Sequence[asyncio.Task[list[ShardAck]]] = (),
    ) -> None:
        self._answers = answers
        self._settling = list(settling)

    def __await__(self) -> Generator[object, None, list[ShardAck]]:
        return self._collect().__await__()

    async def _collect(self) -> list[ShardAck]:
        # Every part settles before the first error is raised, so nothing is left unawaited.
        results = await asyncio.gather(
            *self._answers,
            *(asyncio.shield(task) for task in self._settling),
            return_exceptions=True,
        )
        acks: list[ShardAck] = []
        for result in results:
            if isinstance(result, asyncio.CancelledError):
                # A settling task cancelled by Client.close().
                raise FelixConnectionError("the client was closed before the ack")
            if isinstance(result, BaseException):
                raise result
            if isinstance(result, list):
                acks.extend(result)
            elif isinstance(result, wire.ErrorFrame):
                raise error_from_frame(result)
            else:
                acks.extend(_expect(result, wire.Ack).shards)
        acks.sort(key=lambda ack: ack.shard)
        return acks


class _SubscriptionPart:
    """One subscription stream on one connection: its raw bytes, decoded lazily as the
    application reads, so what it holds stays within the flow-control window."""

    def __init__(
        self, conn: Connection, frame: wire.Subscribe, window: int, notify: asyncio.Event
    ) -> None:
        self.conn = conn
        self.frame = frame
        self.notify = notify
        self.buffer = bytearray()
        self.records: deque[DeliveredRecord] = deque()
        self.ended = False
        self.stopped = False
        self.error: FelixError | None = None
        self.start: dict[int, int] = {}
        # The window must hold one whole frame of the largest size the broker sends.
        self.window = max(window, conn.limits.max_frame_bytes + wire.FRAME_HEADER_LEN)
        self.consumed = 0
        self.granted = 0
        self.stream_id = conn.open_stream(lambda _: self)
        conn.quic.windows[self.stream_id] = (0, self.window)
        conn.quic.lenient_resets.add(self.stream_id)
        self.conn.quic.send_stream_data(self.stream_id, wire.encode(frame))
        conn.protocol.schedule_transmit()

    async def subscribed(self) -> None:
        """Waits for ``Subscribed`` (or raises the broker's refusal)."""
        while True:
            self.notify.clear()
            frame = self._decode()
            if isinstance(frame, wire.Subscribed):
                self.start = dict(frame.shards)
                return
            if isinstance(frame, wire.ErrorFrame):
                self.stop()
                raise error_from_frame(frame)
            if frame is not None:
                self.stop()
                raise ProtocolViolationError(f"expected Subscribed, got {type(frame).__name__}")
            if self.error is not None:
                raise self.error
            if self.ended:
                raise FelixConnectionError("the broker finished the subscription stream")
            await self.notify.wait()

    def _decode(self) -> wire.Frame | None:
        before = len(self.buffer)
        try:
            frame = self.conn.decoder.decode(self.buffer)
        except FelixError as error:
            self.stop()
            self.error = error
            return None
        if frame is not None:
            taken = before - len(self.buffer)
            if isinstance(frame, wire.Delivery):
                # A delivery's records are credited as the application takes them.
                taken -= sum(_record_cost(item) for item in frame.records)
            self._credit(taken)
        return frame

    def _credit(self, amount: int) -> None:
        self.consumed += amount
        # Grant in steps of an eighth of the window: a MAX_STREAM_DATA per record would cost
        # more than the records.
        if self.consumed - self.granted >= self.window // 8:
            self.granted = self.consumed
            if self.stream_id in self.conn.quic.windows:
                self.conn.quic.windows[self.stream_id] = (self.consumed, self.window)
                self.conn.protocol.schedule_transmit()

    def poll(self) -> DeliveredRecord | None:
        """The next record if one is here; None when none is (see `done` and `error`).
        Records already received are handed out before an error or the end is reported."""
        while True:
            if self.records:
                item = self.records.popleft()
                self._credit(_record_cost(item))
                return item
            frame = self._decode()
            if frame is None:
                if self.ended and self.error is None and self.buffer:
                    self.error = MalformedError(
                        "malformed truncated frame: the subscription ended inside a frame"
                    )
                return None
            if isinstance(frame, wire.Delivery):
                self.records.extend(frame.records)
            elif isinstance(frame, wire.ErrorFrame):
                self.stop()
                self.error = error_from_frame(frame)
                return None
            else:
                self.stop()
                self.error = ProtocolViolationError(
                    f"unexpected {type(frame).__name__} frame on a subscription"
                )
                return None

    @property
    def done(self) -> bool:
        """Nothing more will come: ended or failed, and every complete frame handed out."""
        return (self.ended or self.error is not None) and not self.records

    def stop(self) -> None:
        """Ends the stream both ways (the broker then forgets the subscription)."""
        self.ended = True
        if not self.stopped:
            self.stopped = True
            self.conn.abort_stream(self.stream_id, _STOP_CODE)

    # StreamHandler: called by the connection's protocol.

    def on_data(self, data: bytes, end: bool) -> None:
        self.buffer += data
        if end:
            self.ended = True
            self.conn.quic.windows.pop(self.stream_id, None)
            self.conn.quic.lenient_resets.discard(self.stream_id)
        self.notify.set()

    def on_reset(self, code: int) -> None:
        # A Felix code (a stalled subscriber's lag, section 10) is that error; the complete
        # frames already received still come first.
        self.ended = True
        self.conn.quic.windows.pop(self.stream_id, None)
        self.error = error_from_code(code, "the broker reset the subscription stream")
        self.notify.set()

    def on_closed(self, error: FelixError) -> None:
        self.ended = True
        if self.error is None:
            self.error = error
        self.notify.set()


class Subscription(AsyncIterator[DeliveredRecord]):
    """Records of a subscription, in per-shard offset order; one stream per owning core
    (core-aware), merged. ``async for`` ends when the broker finishes the subscription, and
    raises the typed error that ended it otherwise. Close it with :meth:`close` or
    ``async with``."""

    def __init__(
        self, client: Client, stream: str, shards: tuple[int, ...] | None, resume_on_lag: bool
    ) -> None:
        self._client = client
        self.stream = stream
        self._shards = shards
        self.resume_on_lag = resume_on_lag
        self._parts: list[_SubscriptionPart] = []
        self._notify = asyncio.Event()
        self._next_part = 0
        self._closed = False
        #: Per shard, the offset of the next record this subscription will yield.
        self.positions: dict[int, int] = {}
        #: How many times the subscription resumed after being lagged.
        self.resumes = 0

    async def _open(self, start: StartLike) -> None:
        self._parts = await self._client._subscribe_parts(
            self.stream, self._shards, start, self._notify
        )
        self._next_part = 0
        for part in self._parts:
            for shard, offset in part.start.items():
                self.positions.setdefault(shard, offset)

    @property
    def start(self) -> dict[int, int]:
        """Per subscribed shard, the first offset the broker said it would deliver."""
        return {shard: offset for part in self._parts for shard, offset in part.start.items()}

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> DeliveredRecord:
        while True:
            if self._closed:
                raise StopAsyncIteration
            item = self._poll()
            if item is not None:
                self.positions[item.shard] = item.offset + 1
                return item
            failed = next((part for part in self._parts if part.done and part.error), None)
            if failed is not None:
                await self._failed(failed)
                continue
            if all(part.done for part in self._parts):
                self.close()
                raise StopAsyncIteration
            self._notify.clear()
            await self._notify.wait()

    def _poll(self) -> DeliveredRecord | None:
        # Round-robin over the parts so that no core's records starve the others.
        count = len(self._parts)
        for step in range(count):
            index = (self._next_part + step) % count
            item = self._parts[index].poll()
            if item is not None:
                self._next_part = (index + 1) % count
                return item
        return None

    async def _failed(self, part: _SubscriptionPart) -> None:
        error = part.error
        assert error is not None
        for other in self._parts:
            other.stop()
        if not isinstance(error, SubscriberLaggedError):
            self._closed = True
            raise error
        # Resume exactly after what this subscription yielded; the other parts' unread
        # records come again. For the lagged part the broker's list (when complete) says the
        # same, and is what the protocol promises: it wins if they ever differ.
        positions = dict(self.positions)
        announced, complete = error.announced_positions()
        if complete:
            for shard, offset in announced.items():
                if shard not in positions:
                    continue
                if positions[shard] != offset:
                    _log.warning(
                        "lagged shard %d: the broker says resume from %d, the client counted %d",
                        shard,
                        offset,
                        positions[shard],
                    )
                positions[shard] = offset
        error.resume_positions = positions
        if not self.resume_on_lag:
            self._closed = True
            raise error
        _log.info("subscription to %s lagged; resuming from %s", self.stream, positions)
        self.resumes += 1
        await self._open(positions)

    def close(self) -> None:
        """Stops the subscription: the broker forgets it and frees its queues."""
        self._closed = True
        for part in self._parts:
            part.stop()
        self._client._subscriptions.discard(self)
        # Wakes an iteration waiting for records: it ends.
        self._notify.set()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
