//! The engine's one error type and the messages it carries.

use felix_wire::{ErrorCode, ErrorFrame};

/// Longest message an [`EngineError`] carries: the limit of an `Error` frame's text, the wire
/// crate's own bound (one constant, not a copy). Longer messages are cut at a character
/// boundary.
pub use felix_wire::ERROR_MESSAGE_BYTES_MAX;

/// Why a request failed; becomes an `Error` frame on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct EngineError {
    pub code: ErrorCode,
    /// Code-specific detail (oldest offset held for `TooOld`), else 0.
    pub detail: u64,
    pub message: String,
}

impl EngineError {
    /// The wire form, answering request `request_id`.
    #[must_use]
    pub fn to_frame(&self, request_id: u64) -> ErrorFrame {
        ErrorFrame {
            request_id,
            code: self.code,
            detail: self.detail,
            message: self.message.clone(),
        }
    }

    /// An error whose message is cut to [`ERROR_MESSAGE_BYTES_MAX`] (at a character
    /// boundary). Public so a shell raising errors of its own bounds them the same way.
    #[must_use]
    pub fn new(code: ErrorCode, detail: u64, mut message: String) -> EngineError {
        if message.len() > ERROR_MESSAGE_BYTES_MAX {
            let mut end = ERROR_MESSAGE_BYTES_MAX;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
        }
        assert!(message.len() <= ERROR_MESSAGE_BYTES_MAX);
        EngineError {
            code,
            detail,
            message,
        }
    }

    #[must_use]
    pub(crate) fn invalid(message: String) -> EngineError {
        EngineError::new(ErrorCode::InvalidArgument, 0, message)
    }

    /// `StreamNotFound` for the stream called `name` (the engine's wording, so a shell that
    /// looks a stream up itself answers as the engine does).
    #[must_use]
    pub fn stream_not_found(name: &str) -> EngineError {
        EngineError::new(
            ErrorCode::StreamNotFound,
            0,
            format!("stream {name:?} does not exist"),
        )
    }
}
