//! Stable numeric error codes (never renumber) and decode errors.

/// Error codes carried in `Error` frames and used as QUIC application close codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// A frame could not be decoded (bad length, bad enum value, bad UTF-8, trailing bytes).
    Malformed = 1,
    /// No protocol version in common.
    UnsupportedVersion = 2,
    /// A frame body longer than `Limits::max_frame_bytes`.
    FrameTooLarge = 3,
    /// A frame type this version does not know.
    UnknownFrameType = 4,
    /// A valid frame in the wrong place (e.g. a publish before hello).
    ProtocolViolation = 5,
    /// A batch, key, payload, name or shard count over its limit.
    LimitExceeded = 6,
    StreamNotFound = 10,
    StreamExists = 11,
    /// A well-formed request with a bad argument (bad name, shard out of range, ...).
    InvalidArgument = 12,
    /// A `ProducerPublish` whose sequence skips ahead of the producer's next one on that
    /// shard (an earlier batch is missing), or that the shard no longer remembers; nothing was
    /// stored. `detail` carries the sequence the shard expects next (0: it knows no batch of
    /// the producer).
    OutOfSequence = 13,
    /// The requested position is older than what the shard still holds;
    /// `detail` carries the oldest offset still held.
    TooOld = 20,
    /// A subscriber fell too far behind live delivery and was ended; `detail` is 0 and the
    /// message lists `shard:next_offset` resume positions.
    SubscriberLagged = 21,
    /// The core's ingress queue or byte budget is full
    /// (message: "publish ingress byte budget exhausted").
    IngressBudgetExhausted = 30,
    /// The durable log's disk is full; nothing of the publish was acked.
    StorageFull = 31,
    /// The durable log cannot store the publish.
    StorageFailed = 32,
    /// The broker is shutting down.
    ShuttingDown = 40,
    /// A replicated shard could not take or commit the publish in time: no leader or no
    /// quorum reachable, or this broker holds no copy (docs/cluster.md). The records may
    /// still commit: publish them again.
    Unavailable = 41,
    /// The connection has no valid credential: a required one is missing, or the token
    /// presented is wrong, unknown or revoked. The connection is closed with this code.
    Unauthenticated = 60,
    /// The principal may not do this operation on this stream; the message names both.
    PermissionDenied = 61,
    /// A broker defect; the message says what.
    Internal = 50,
}

impl ErrorCode {
    /// All codes, for tests and documentation.
    pub const ALL: [ErrorCode; 20] = [
        ErrorCode::Malformed,
        ErrorCode::UnsupportedVersion,
        ErrorCode::FrameTooLarge,
        ErrorCode::UnknownFrameType,
        ErrorCode::ProtocolViolation,
        ErrorCode::LimitExceeded,
        ErrorCode::StreamNotFound,
        ErrorCode::StreamExists,
        ErrorCode::InvalidArgument,
        ErrorCode::OutOfSequence,
        ErrorCode::TooOld,
        ErrorCode::SubscriberLagged,
        ErrorCode::IngressBudgetExhausted,
        ErrorCode::StorageFull,
        ErrorCode::StorageFailed,
        ErrorCode::ShuttingDown,
        ErrorCode::Unavailable,
        ErrorCode::Unauthenticated,
        ErrorCode::PermissionDenied,
        ErrorCode::Internal,
    ];

    #[must_use]
    pub fn from_u16(value: u16) -> Option<ErrorCode> {
        ErrorCode::ALL
            .into_iter()
            .find(|code| *code as u16 == value)
    }

    /// Stable snake_case name, used in metrics labels and logs.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Malformed => "malformed",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::UnknownFrameType => "unknown_frame_type",
            ErrorCode::ProtocolViolation => "protocol_violation",
            ErrorCode::LimitExceeded => "limit_exceeded",
            ErrorCode::StreamNotFound => "stream_not_found",
            ErrorCode::StreamExists => "stream_exists",
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::OutOfSequence => "out_of_sequence",
            ErrorCode::TooOld => "too_old",
            ErrorCode::SubscriberLagged => "subscriber_lagged",
            ErrorCode::IngressBudgetExhausted => "ingress_budget_exhausted",
            ErrorCode::StorageFull => "storage_full",
            ErrorCode::StorageFailed => "storage_failed",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::Internal => "internal",
        }
    }
}

/// Why a byte sequence is not a valid frame. Every variant maps to an [`ErrorCode`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame body of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: u64, max: u32 },
    #[error("unknown frame type 0x{0:02x}")]
    UnknownFrameType(u8),
    #[error("malformed {frame} frame: {reason}")]
    Malformed { frame: &'static str, reason: String },
    #[error("{what} of {value} exceeds the limit of {max}")]
    LimitExceeded {
        what: &'static str,
        value: u64,
        max: u64,
    },
}

impl WireError {
    #[must_use]
    pub fn code(&self) -> ErrorCode {
        match self {
            WireError::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            WireError::UnknownFrameType(_) => ErrorCode::UnknownFrameType,
            WireError::Malformed { .. } => ErrorCode::Malformed,
            WireError::LimitExceeded { .. } => ErrorCode::LimitExceeded,
        }
    }
}
