//! The crate's one error type.

use std::io;
use std::sync::Arc;

/// Everything that can go wrong in the durable log.
///
/// `Clone` because a failed log repeats its fatal error to every later caller and because
/// [`crate::LogEvent::Rejected`] hands the same error to every range of a rejected round; IO
/// errors are therefore held in an `Arc`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StorageError {
    /// An fdatasync failed. Fatal: the log is failed for good, nothing after the last
    /// successful sync may be acknowledged, and the process must restart and recover.
    #[error(
        "fdatasync of segment {segment} failed (errno {errno}); the log is failed, restart and recover"
    )]
    SyncFailed { segment: u64, errno: i32 },
    /// A write failed with an error other than ENOSPC (e.g. EIO). Fatal, like `SyncFailed`.
    #[error(
        "write to segment {segment} failed (errno {errno}); the log is failed, restart and recover"
    )]
    WriteFailed { segment: u64, errno: i32 },
    /// The disk is full (ENOSPC on write). The round's appends, and every append queued after
    /// them, were rejected and are not in the log; the log stays usable.
    #[error("disk full: the round's appends were rejected")]
    DiskFull,
    /// An append whose offset is not the shard's next offset (offsets are dense per shard).
    #[error("shard {shard}: append offset {got} is not the next offset {expected}")]
    OffsetNotNext { shard: u32, expected: u64, got: u64 },
    /// A record larger than the frame format allows.
    #[error(
        "record too large: key {key_bytes} bytes (max {max_key_bytes}), body {body_bytes} bytes (max {max_body_bytes})"
    )]
    RecordTooLarge {
        key_bytes: usize,
        max_key_bytes: usize,
        body_bytes: usize,
        max_body_bytes: usize,
    },
    /// Appends are waiting for the disk beyond `LogConfig::max_pending_bytes`.
    #[error("log append queue full: {pending_bytes} bytes pending, limit {max_pending_bytes}")]
    PendingFull {
        pending_bytes: usize,
        max_pending_bytes: usize,
    },
    /// A read asked for an offset that retention already deleted.
    #[error("shard {shard}: offset {requested} is older than the oldest stored offset {oldest}")]
    OffsetTooOld {
        shard: u32,
        requested: u64,
        oldest: u64,
    },
    /// A committed record read back from disk failed validation. The process must stop.
    #[error("corrupt record in segment {segment} at position {position}: {reason}")]
    Corrupt {
        segment: u64,
        position: u64,
        reason: String,
    },
    /// A configuration value out of range; the message names the field or variable.
    #[error("invalid storage configuration: {0}")]
    Config(String),
    /// A filesystem operation failed outside a commit round (open, create, read, delete).
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: Arc<io::Error>,
    },
}

/// Displays an error and then each of its sources, `: `-separated (what `{:#}` does for an
/// `anyhow::Error`). Errors here say only their own part and leave the cause to
/// `source()`, so a log line or message that shows one uses this to show the whole chain once.
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}

impl std::fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl StorageError {
    /// Wraps an IO error with what was being done.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        StorageError::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// True for errors after which the log refuses all further work.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            StorageError::SyncFailed { .. }
                | StorageError::WriteFailed { .. }
                | StorageError::Corrupt { .. }
        )
    }
}
