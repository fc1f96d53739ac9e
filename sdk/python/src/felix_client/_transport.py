"""QUIC connections on aioquic: the handshake, request streams matched by request id,
subscription streams with consumption-driven flow control, and the publish byte budget.

Everything runs on the caller's asyncio event loop; aioquic calls back into the protocol from
the loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from aioquic._buffer import Buffer
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder

from . import wire
from .config import ClientConfig
from .errors import (
    ErrorCode,
    FelixConnectionError,
    FelixError,
    ProtocolViolationError,
    error_for_code,
)

_log = logging.getLogger("felix_client")

# aioquic's own bound on a MAX_STREAM_DATA frame (type + two varints).
_MAX_STREAM_DATA_FRAME_CAPACITY = 1 + 2 * 8
# TLS alerts arrive as QUIC transport errors 0x100 + alert (RFC 9001 section 4.8).
_CRYPTO_ERROR_BASE = 0x100
_CRYPTO_ERROR_END = 0x200
# Keep-alive pings per idle timeout: enough that one lost ping does not let the timer expire.
_PINGS_PER_IDLE_TIMEOUT = 3
# The smallest FELIX_MAX_FRAME_BYTES a broker accepts: no stream starts with less credit.
_MIN_STREAM_WINDOW = 64 * 1024
# Time allowed for a graceful close before the socket is dropped anyway.
_CLOSE_TIMEOUT = 1.0


def error_from_frame(frame: wire.ErrorFrame) -> FelixError:
    return error_for_code(frame.code, frame.message, frame.detail)


def error_from_code(code: int, message: str) -> FelixError:
    """A close or reset code as an error: the typed error when it is a Felix code."""
    try:
        known = ErrorCode(code)
    except ValueError:
        return FelixConnectionError(f"{message} with code {code}", close_code=code)
    return error_for_code(known, f"{message} with {known.wire_name}")


def _termination_error(event: events.ConnectionTerminated) -> FelixError:
    if event.frame_type is None:
        # An application close: 0 is normal, anything else a Felix error code.
        if event.error_code == 0:
            return FelixConnectionError("the connection was closed", close_code=0)
        return error_from_code(event.error_code, "the broker closed the connection")
    code = event.error_code
    reason = f": {event.reason_phrase}" if event.reason_phrase else ""
    if _CRYPTO_ERROR_BASE <= code < _CRYPTO_ERROR_END:
        return FelixConnectionError(
            f"TLS handshake failed (alert {code - _CRYPTO_ERROR_BASE}){reason}", close_code=code
        )
    return FelixConnectionError(f"QUIC connection error 0x{code:x}{reason}", close_code=code)


def server_decode_limits(announced: wire.Limits) -> wire.Limits:
    """Limits for decoding what the broker sends: its announced values, but never below the
    protocol defaults (section 6: clients decode server frames with at least the defaults)."""
    default = wire.DEFAULT_LIMITS
    return wire.Limits(
        max_frame_bytes=max(announced.max_frame_bytes, default.max_frame_bytes),
        max_batch_records=max(announced.max_batch_records, default.max_batch_records),
        max_payload_bytes=max(announced.max_payload_bytes, default.max_payload_bytes),
        max_key_bytes=max(announced.max_key_bytes, default.max_key_bytes),
        max_name_bytes=max(announced.max_name_bytes, default.max_name_bytes),
        max_shards=max(announced.max_shards, default.max_shards),
    )


class Budget:
    """Bytes of publishes outstanding, handed out first come first served."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.available = self.capacity
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()

    async def acquire(self, wanted: int) -> int:
        """Takes `wanted` bytes (the whole budget for a publish larger than it); returns what
        was taken, to be given back with :meth:`release`."""
        wanted = min(max(wanted, 1), self.capacity)
        if not self._waiters and self.available >= wanted:
            self.available -= wanted
            return wanted
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((waiter, wanted))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Granted just as the caller gave up: hand it on.
                self.release(wanted)
            raise
        return wanted

    def release(self, amount: int) -> None:
        self.available += amount
        while self._waiters:
            waiter, wanted = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self.available < wanted:
                break
            self._waiters.popleft()
            self.available -= wanted
            waiter.set_result(None)


class StreamHandler(Protocol):
    def on_data(self, data: bytes, end: bool) -> None: ...

    def on_reset(self, code: int) -> None: ...

    def on_closed(self, error: FelixError) -> None: ...


class _FlowControlledConnection(QuicConnection):
    """A QuicConnection whose subscription streams grant the broker credit only as the
    application consumes deliveries.

    aioquic doubles a stream's receive window as data arrives, whether or not anyone reads it;
    a subscriber that stops reading would then buffer without bound. For the streams in
    `windows` (stream id -> (bytes consumed, window)) the credit is instead `consumed +
    window`: a subscriber that stops reading stops the broker, which ends it as lagged.
    """

    def __init__(self, *, configuration: QuicConfiguration) -> None:
        super().__init__(configuration=configuration)
        self.windows: dict[int, tuple[int, int]] = {}
        # Subscription streams whose reset may announce more than the credit granted (below).
        self.lenient_resets: set[int] = set()

    def _handle_reset_stream_frame(self, context: Any, frame_type: int, buf: Buffer) -> None:
        # The broker's QUIC stack (s2n-quic) counts the bytes it buffered for a stalled stream
        # in the final size of its RESET_STREAM, beyond the credit this side granted; aioquic
        # rightly calls that a flow-control violation and closes the whole connection. A
        # subscription stream is being discarded anyway: raise its limits to the final size so
        # that the reset ends only that stream (and its error code, e.g. subscriber_lagged,
        # reaches the subscription).
        start = buf.tell()
        stream_id = buf.pull_uint_var()
        buf.pull_uint_var()
        final_size = buf.pull_uint_var()
        buf.seek(start)
        stream = self._streams.get(stream_id)
        if stream is not None and stream_id in self.lenient_resets:
            self.lenient_resets.discard(stream_id)
            stream.max_stream_data_local = max(stream.max_stream_data_local, final_size)
            newly_received = max(0, final_size - stream.receiver.highest_offset)
            connection = self._local_max_data
            connection.value = max(connection.value, connection.used + newly_received)
        super()._handle_reset_stream_frame(context, frame_type, buf)

    def _write_stream_limits(self, builder: QuicPacketBuilder, space: Any, stream: Any) -> None:
        window = self.windows.get(stream.stream_id)
        if window is None:
            super()._write_stream_limits(builder, space, stream)
            return
        consumed, size = window
        # Credit never shrinks (QUIC forbids it).
        stream.max_stream_data_local = max(stream.max_stream_data_local, consumed + size)
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=_MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local


class _Protocol(QuicConnectionProtocol):
    """Routes QUIC events to the handler of each stream and releases fire-and-forget budget
    once its bytes have been put on the wire."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None) -> None:
        super().__init__(quic, stream_handler)
        self.handlers: dict[int, StreamHandler] = {}
        self.terminated: FelixError | None = None
        # Per stream: (stream offset that must be sent, budget, bytes) in offset order.
        self.releases: dict[int, deque[tuple[int, Budget, int]]] = {}
        self._transmit_pending = False

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            handler = self.handlers.get(event.stream_id)
            if handler is not None:
                handler.on_data(event.data, event.end_stream)
        elif isinstance(event, events.StreamReset):
            handler = self.handlers.get(event.stream_id)
            if handler is not None:
                handler.on_reset(event.error_code)
        elif isinstance(event, events.ConnectionTerminated):
            self.terminated = _termination_error(event)
            handlers = list(self.handlers.values())
            self.handlers.clear()
            for handler in handlers:
                handler.on_closed(self.terminated)
            self._release_all()

    def schedule_transmit(self) -> None:
        """Sends soon, once for everything queued in this turn of the loop."""
        if not self._transmit_pending:
            self._transmit_pending = True
            self._loop.call_soon(self._transmit_now)

    def _transmit_now(self) -> None:
        self._transmit_pending = False
        self.transmit()

    def transmit(self) -> None:
        super().transmit()
        self._release_sent()

    def _release_sent(self) -> None:
        if not self.releases:
            return
        # aioquic has no public view of a stream's send progress; its sender's highest_offset
        # is the end of what has been put into packets.
        streams = getattr(self._quic, "_streams", {})
        for stream_id in list(self.releases):
            pending = self.releases[stream_id]
            stream = streams.get(stream_id)
            sent = stream.sender.highest_offset if stream is not None else None
            while pending and (sent is None or pending[0][0] <= sent):
                _, budget, amount = pending.popleft()
                budget.release(amount)
            if not pending:
                del self.releases[stream_id]

    def release_stream(self, stream_id: int) -> None:
        """Gives back the budget held for a stream that will send nothing more."""
        for _, budget, amount in self.releases.pop(stream_id, ()):
            budget.release(amount)

    def _release_all(self) -> None:
        for stream_id in list(self.releases):
            self.release_stream(stream_id)


class RequestStream:
    """A client-initiated stream carrying requests; answers are matched by request id."""

    def __init__(self, conn: Connection, stream_id: int, decoder: wire.Decoder) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.decoder = decoder
        self.buffer = bytearray()
        self.pending: dict[int, asyncio.Future[wire.Frame]] = {}
        self.failed: FelixError | None = None
        # Set while waiting for HelloOk: the first frame answers it, whatever its type.
        self.handshake: asyncio.Future[wire.Frame] | None = None
        self.written = 0

    def send(self, data: bytes) -> None:
        if self.failed is not None:
            raise self.failed
        try:
            self.conn.quic.send_stream_data(self.stream_id, data)
        except Exception as error:  # aioquic raises assorted errors for a dead stream
            raise self.conn.closed_error(f"cannot send: {error}") from None
        self.written += len(data)
        self.conn.protocol.schedule_transmit()

    async def request(self, frame: wire.Frame, request_id: int) -> wire.Frame:
        """Sends `frame` and waits for the answer carrying `request_id` (an ``Error`` answer
        is raised as its typed error)."""
        answer = self.expect(request_id)
        self.send(wire.encode(frame))
        result = await answer
        if isinstance(result, wire.ErrorFrame):
            raise error_from_frame(result)
        return result

    def expect(self, request_id: int) -> asyncio.Future[wire.Frame]:
        if self.failed is not None:
            raise self.failed
        future: asyncio.Future[wire.Frame] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        return future

    def fail(self, error: FelixError) -> None:
        if self.failed is None:
            self.failed = error
        self.conn.protocol.handlers.pop(self.stream_id, None)
        self.conn.protocol.release_stream(self.stream_id)
        waiting = list(self.pending.values())
        if self.handshake is not None:
            waiting.append(self.handshake)
            self.handshake = None
        self.pending.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(error)

    def on_data(self, data: bytes, end: bool) -> None:
        self.buffer += data
        try:
            # Bounded: each pass takes one whole frame off the buffer.
            while (frame := self.decoder.decode(self.buffer)) is not None:
                self._route(frame)
        except FelixError as error:
            _log.warning("request stream %d failed: %s", self.stream_id, error)
            self.conn.abort_stream(self.stream_id, error.code)
            self.fail(error)
            return
        if end:
            self.fail(FelixConnectionError("the broker finished the request stream"))

    def _route(self, frame: wire.Frame) -> None:
        if self.handshake is not None:
            handshake, self.handshake = self.handshake, None
            if not handshake.done():
                handshake.set_result(frame)
            return
        match frame:
            case wire.ErrorFrame(request_id=0):
                # About the stream itself: every request on it is lost.
                raise error_from_frame(frame)
            case (
                wire.StreamInfo()
                | wire.StreamList()
                | wire.Done()
                | wire.Ack()
                | wire.ClusterMap()
                | wire.ErrorFrame()
            ):
                future = self.pending.pop(frame.request_id, None)
                if future is None:
                    _log.warning("answer for unknown request id %d ignored", frame.request_id)
                elif not future.done():
                    future.set_result(frame)
            case _:
                raise ProtocolViolationError(
                    f"unexpected {type(frame).__name__} frame on a request stream"
                )

    def on_reset(self, code: int) -> None:
        self.fail(error_from_code(code, "the broker reset the request stream"))

    def on_closed(self, error: FelixError) -> None:
        self.fail(error)


class Connection:
    """One QUIC connection to one broker address (the shared port or a core's own port)."""

    def __init__(
        self,
        protocol: _Protocol,
        quic: _FlowControlledConnection,
        transport: asyncio.DatagramTransport,
        config: ClientConfig,
    ) -> None:
        self.protocol = protocol
        self.quic = quic
        self.transport = transport
        self.config = config
        self.hello: wire.HelloOk | None = None
        self.decoder = wire.Decoder()
        self.admin: RequestStream | None = None
        self._publish: RequestStream | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._ping_id = 0

    @classmethod
    async def open(cls, config: ClientConfig, host: str, port: int) -> Connection:
        """Connects (QUIC + TLS, ALPN ``felix/1``) and performs the ``Hello`` handshake."""
        loop = asyncio.get_running_loop()
        configuration = _quic_configuration(config)
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as error:
            raise FelixConnectionError(f"cannot resolve {host}: {error}") from None
        family, _, _, _, addr = infos[0]
        quic = _FlowControlledConnection(configuration=configuration)
        local = ("::", 0) if family == socket.AF_INET6 else ("0.0.0.0", 0)
        try:
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: _Protocol(quic), local_addr=local, family=family
            )
        except OSError as error:
            raise FelixConnectionError(f"cannot connect to {host}:{port}: {error}") from None
        conn = cls(protocol, quic, transport, config)
        try:
            async with asyncio.timeout(config.connect_timeout):
                await conn._handshake(addr)
        except TimeoutError:
            conn.abort()
            raise FelixConnectionError(
                f"cannot connect to {host}:{port}: no answer within {config.connect_timeout} s"
            ) from None
        except OSError as error:
            conn.abort()
            raise FelixConnectionError(f"cannot connect to {host}:{port}: {error}") from None
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _handshake(self, addr: Any) -> None:
        self.protocol.connect(addr)
        try:
            await self.protocol.wait_connected()
        except ConnectionError:
            raise self.closed_error("the QUIC handshake failed") from None
        stream = RequestStream(self, self.quic.get_next_available_stream_id(), self.decoder)
        self.protocol.handlers[stream.stream_id] = stream
        stream.handshake = asyncio.get_running_loop().create_future()
        answer = stream.handshake
        token = self.config.token.encode() if self.config.token is not None else None
        # PRODUCER asks to publish as an idempotent producer; HelloOk echoes it if the broker
        # takes ProducerPublish (older brokers ignore the bit).
        features = wire.FEATURE_PRODUCER if self.config.idempotent else 0
        hello = wire.Hello(
            wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION, features, self.config.client_name, token
        )
        wire.check_outgoing(hello, wire.DEFAULT_LIMITS)
        stream.send(wire.encode(hello))
        frame = await answer
        if isinstance(frame, wire.ErrorFrame):
            raise error_from_frame(frame)
        if not isinstance(frame, wire.HelloOk):
            raise ProtocolViolationError(f"expected HelloOk, got {type(frame).__name__}")
        if frame.version != wire.PROTOCOL_VERSION:
            raise ProtocolViolationError(f"the broker chose protocol version {frame.version}")
        self.hello = frame
        self.decoder.limits = server_decode_limits(frame.limits)
        self.admin = stream
        self._schedule_keepalive()

    def _schedule_keepalive(self) -> None:
        interval = self.config.idle_timeout / _PINGS_PER_IDLE_TIMEOUT
        self._keepalive = asyncio.get_running_loop().call_later(interval, self._ping)

    def _ping(self) -> None:
        if self.protocol.terminated is not None:
            return
        self._ping_id += 1
        self.quic.send_ping(self._ping_id)
        self.protocol.transmit()
        self._schedule_keepalive()

    @property
    def limits(self) -> wire.Limits:
        assert self.hello is not None, "used only after the handshake"
        return self.hello.limits

    def closed_error(self, fallback: str) -> FelixError:
        if self.protocol.terminated is not None:
            return self.protocol.terminated
        return FelixConnectionError(fallback)

    def request_stream(self) -> RequestStream:
        """The admin request stream: the hello stream, or a new stream once a broken answer
        or a broker error about the stream itself has ended the previous one."""
        assert self.admin is not None, "used only after the handshake"
        if self.admin.failed is not None and self.protocol.terminated is None:
            self.admin = self.open_request_stream()
        return self.admin

    def publish_stream(self) -> RequestStream:
        """The connection's publish stream (opened on first use). One stream keeps every
        shard's records in publish order, pipelined publishes included."""
        if self._publish is None or self._publish.failed is not None:
            self._publish = self.open_request_stream()
        return self._publish

    def open_request_stream(self) -> RequestStream:
        if self.protocol.terminated is not None:
            raise self.protocol.terminated
        stream = RequestStream(self, self.quic.get_next_available_stream_id(), self.decoder)
        self.protocol.handlers[stream.stream_id] = stream
        return stream

    def open_stream(self, handler_factory: Callable[[int], StreamHandler]) -> int:
        if self.protocol.terminated is not None:
            raise self.protocol.terminated
        stream_id = self.quic.get_next_available_stream_id()
        self.protocol.handlers[stream_id] = handler_factory(stream_id)
        return stream_id

    def hold_until_sent(self, stream: RequestStream, budget: Budget, amount: int) -> None:
        """Keeps `amount` of `budget` until everything written so far on `stream` is sent."""
        pending = self.protocol.releases.setdefault(stream.stream_id, deque())
        pending.append((stream.written, budget, amount))

    def abort_stream(self, stream_id: int, code: int) -> None:
        """Stops and resets a stream (either may already be gone: that is the goal)."""
        self.protocol.handlers.pop(stream_id, None)
        self.quic.windows.pop(stream_id, None)
        for stop in (self.quic.stop_stream, self.quic.reset_stream):
            try:
                stop(stream_id, code)
            except Exception:  # aioquic refuses for a stream already finished
                _log.debug("stream %d already ended", stream_id)
        self.protocol.schedule_transmit()

    def abort(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        self.protocol.close()
        self.transport.close()

    async def close(self) -> None:
        """Closes with code 0, waiting (bounded) for the broker to see it."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        self.protocol.close()
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self.protocol.wait_closed()
        except TimeoutError:
            _log.debug("the broker did not confirm the close in time")
        self.transport.close()


def _quic_configuration(config: ClientConfig) -> QuicConfiguration:
    configuration = QuicConfiguration(
        is_client=True,
        alpn_protocols=[wire.ALPN],
        server_name=config.server_name,
        idle_timeout=config.idle_timeout,
        # Every stream's initial receive credit, and so a floor of the subscription window
        # (the broker's smallest frame limit, so a frame always fits).
        max_stream_data=max(config.subscription_window_bytes, _MIN_STREAM_WINDOW),
    )
    try:
        if config.insecure:
            _log.warning("TLS certificate verification is OFF (insecure): development only")
            configuration.verify_mode = ssl.CERT_NONE
        elif config.ca is not None:
            configuration.load_verify_locations(cafile=str(config.ca))
        if config.client_cert is not None or config.client_key is not None:
            if config.client_cert is None:
                raise FelixConnectionError("a client key needs its client_cert")
            configuration.load_cert_chain(
                str(config.client_cert),
                None if config.client_key is None else str(config.client_key),
            )
    except (OSError, ValueError) as error:
        raise FelixConnectionError(f"unusable TLS files: {error}") from None
    return configuration
