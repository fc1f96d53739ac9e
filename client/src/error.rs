//! The client's single error type.

use std::net::SocketAddr;

use felix_wire::{ErrorCode, ErrorFrame};

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The QUIC/TLS connection could not be set up.
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    /// The TLS configuration is unusable (unreadable CA file, bad PEM, ...).
    #[error("TLS: {0}")]
    Tls(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The broker answered with an `Error` frame; code, detail and message as sent.
    #[error("{message} ({}, code {})", code.name(), *code as u16)]
    Server {
        code: ErrorCode,
        /// Code-specific number, e.g. the oldest offset still held for `TooOld`.
        detail: u64,
        message: String,
    },
    /// The broker sent something protocol v1 does not allow here.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The connection or stream is gone.
    #[error("connection closed: {0}")]
    Closed(String),
    /// A request refused before sending (empty batch, over the broker's limits, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl ClientError {
    pub(crate) fn from_error_frame(frame: ErrorFrame) -> ClientError {
        ClientError::Server {
            code: frame.code,
            detail: frame.detail,
            message: frame.message,
        }
    }

    /// The broker's error code, when the broker refused the request.
    #[must_use]
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// A failure shared by every request waiting on one stream (cloneable, unlike `ClientError`).
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    Server {
        code: ErrorCode,
        detail: u64,
        message: String,
    },
    Protocol(String),
    Closed(String),
}

impl Failure {
    pub(crate) fn to_error(&self) -> ClientError {
        match self {
            Failure::Server {
                code,
                detail,
                message,
            } => ClientError::Server {
                code: *code,
                detail: *detail,
                message: message.clone(),
            },
            Failure::Protocol(reason) => ClientError::Protocol(reason.clone()),
            Failure::Closed(reason) => ClientError::Closed(reason.clone()),
        }
    }
}
