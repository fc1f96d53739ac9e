"""Typed errors: one exception class per wire error code (docs/wire-protocol.md section 5).

Every failure the SDK reports is a :class:`FelixError`. Errors the broker sent (an ``Error``
frame, or a QUIC close / stream reset carrying a Felix code) and errors the SDK finds itself
(a frame from the broker that does not decode, a request over the broker's limits) use the
class of their wire code; transport failures without a Felix code are
:class:`FelixConnectionError`.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import ClassVar


class ErrorCode(IntEnum):
    """Stable wire error codes, carried in ``Error`` frames and as QUIC close codes."""

    MALFORMED = 1
    UNSUPPORTED_VERSION = 2
    FRAME_TOO_LARGE = 3
    UNKNOWN_FRAME_TYPE = 4
    PROTOCOL_VIOLATION = 5
    LIMIT_EXCEEDED = 6
    STREAM_NOT_FOUND = 10
    STREAM_EXISTS = 11
    INVALID_ARGUMENT = 12
    OUT_OF_SEQUENCE = 13
    TOO_OLD = 20
    SUBSCRIBER_LAGGED = 21
    INGRESS_BUDGET_EXHAUSTED = 30
    STORAGE_FULL = 31
    STORAGE_FAILED = 32
    SHUTTING_DOWN = 40
    UNAVAILABLE = 41
    INTERNAL = 50
    UNAUTHENTICATED = 60
    PERMISSION_DENIED = 61

    @property
    def wire_name(self) -> str:
        """The protocol's snake_case name, e.g. ``stream_not_found``."""
        return self.name.lower()


class FelixError(Exception):
    """Base of every SDK error.

    ``code`` is the wire error code (0 for :class:`FelixConnectionError`, which has none),
    ``detail`` the code-specific number the broker sent (e.g. the oldest offset still held for
    :class:`TooOldError`), ``message`` the human-readable text.
    """

    error_code: ClassVar[ErrorCode | None] = None

    def __init__(self, message: str, *, detail: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    @property
    def code(self) -> int:
        return 0 if self.error_code is None else int(self.error_code)

    def __str__(self) -> str:
        if self.error_code is None:
            return self.message
        return f"{self.message} ({self.error_code.wire_name}, code {self.code})"


class FelixConnectionError(FelixError, ConnectionError):
    """The connection or stream failed without a Felix error code: no answer, a TLS failure,
    a QUIC transport error, a normal close while a request was waiting.

    ``close_code`` is the QUIC close / reset code when there was one.
    """

    def __init__(self, message: str, *, close_code: int | None = None) -> None:
        super().__init__(message)
        self.close_code = close_code


class MalformedError(FelixError):
    """A frame could not be decoded."""

    error_code = ErrorCode.MALFORMED


class UnsupportedVersionError(FelixError):
    """No protocol version in common."""

    error_code = ErrorCode.UNSUPPORTED_VERSION


class FrameTooLargeError(FelixError):
    """A frame header announced a body longer than ``max_frame_bytes``."""

    error_code = ErrorCode.FRAME_TOO_LARGE


class UnknownFrameTypeError(FelixError):
    """A frame type protocol v1 does not know."""

    error_code = ErrorCode.UNKNOWN_FRAME_TYPE


class ProtocolViolationError(FelixError):
    """A valid frame in the wrong place."""

    error_code = ErrorCode.PROTOCOL_VIOLATION


class LimitExceededError(FelixError):
    """A batch, key, payload, name, list, shard count or connection limit exceeded."""

    error_code = ErrorCode.LIMIT_EXCEEDED


class StreamNotFoundError(FelixError):
    """No stream of that name (also ends the subscriptions of a deleted stream)."""

    error_code = ErrorCode.STREAM_NOT_FOUND


class StreamExistsError(FelixError):
    """``create_stream`` of a name already taken."""

    error_code = ErrorCode.STREAM_EXISTS


class InvalidArgumentError(FelixError):
    """A well-formed request with a bad argument."""

    error_code = ErrorCode.INVALID_ARGUMENT


class OutOfSequenceError(FelixError):
    """An idempotent producer's batch was refused: its sequence skips ahead, or the shard no
    longer remembers the producer (docs/wire-protocol.md section 4.16). Nothing was stored."""

    error_code = ErrorCode.OUT_OF_SEQUENCE

    @property
    def expected_sequence(self) -> int:
        """The sequence the shard expects next from the producer (the broker's ``detail``;
        1 when it does not know the producer)."""
        return self.detail


class TooOldError(FelixError):
    """The requested offset is older than the shard still holds."""

    error_code = ErrorCode.TOO_OLD

    @property
    def oldest_offset(self) -> int:
        """The oldest offset the shard still holds (the broker's ``detail``)."""
        return self.detail


_POSITION = re.compile(r"(\d+):(\d+)")
_POSITIONS_MARKER = "shard:next_offset"


class SubscriberLaggedError(FelixError):
    """The subscription fell too far behind live delivery and was ended.

    ``resume_positions`` maps every shard of the subscription to the offset to resume from
    (the offset after the last record the application received); subscribing again from
    exactly these loses and repeats nothing. The subscription fills it in before raising.
    """

    error_code = ErrorCode.SUBSCRIBER_LAGGED

    def __init__(self, message: str, *, detail: int = 0) -> None:
        super().__init__(message, detail=detail)
        self.resume_positions: dict[int, int] = {}

    def announced_positions(self) -> tuple[dict[int, int], bool]:
        """The ``shard:next_offset`` pairs the broker's message lists, and whether the list
        is complete (a list too long for the 1,024-byte message ends with `` ...``)."""
        _, marker, rest = self.message.partition(_POSITIONS_MARKER)
        if not marker:
            return {}, False
        positions = {int(m.group(1)): int(m.group(2)) for m in _POSITION.finditer(rest)}
        return positions, not rest.rstrip().endswith("...")


class IngressBudgetExhaustedError(FelixError):
    """The core's ingress queue or byte budget is full; publish again later."""

    error_code = ErrorCode.INGRESS_BUDGET_EXHAUSTED


class StorageFullError(FelixError):
    """The durable log's disk is full; nothing of the publish was stored."""

    error_code = ErrorCode.STORAGE_FULL


class StorageFailedError(FelixError):
    """The durable log cannot store the publish."""

    error_code = ErrorCode.STORAGE_FAILED


class ShuttingDownError(FelixError):
    """The broker is shutting down."""

    error_code = ErrorCode.SHUTTING_DOWN


class UnavailableError(FelixError):
    """A replicated shard could not take the publish in time; the records may still commit.
    Also an idempotent producer's retry while its original is still being stored (``detail``
    = the batch's sequence; nothing stored)."""

    error_code = ErrorCode.UNAVAILABLE


class InternalError(FelixError):
    """A broker defect."""

    error_code = ErrorCode.INTERNAL


class UnauthenticatedError(FelixError):
    """No valid credential: a required one is missing, or the token is wrong or revoked."""

    error_code = ErrorCode.UNAUTHENTICATED


class PermissionDeniedError(FelixError):
    """The connection's principal may not do this operation on this stream."""

    error_code = ErrorCode.PERMISSION_DENIED


ERROR_CLASSES: dict[ErrorCode, type[FelixError]] = {
    cls.error_code: cls
    for cls in (
        MalformedError,
        UnsupportedVersionError,
        FrameTooLargeError,
        UnknownFrameTypeError,
        ProtocolViolationError,
        LimitExceededError,
        StreamNotFoundError,
        StreamExistsError,
        InvalidArgumentError,
        OutOfSequenceError,
        TooOldError,
        SubscriberLaggedError,
        IngressBudgetExhaustedError,
        StorageFullError,
        StorageFailedError,
        ShuttingDownError,
        UnavailableError,
        InternalError,
        UnauthenticatedError,
        PermissionDeniedError,
    )
    if cls.error_code is not None
}


def error_for_code(code: ErrorCode, message: str, detail: int = 0) -> FelixError:
    """The typed exception for wire error `code`."""
    return ERROR_CLASSES[code](message, detail=detail)
