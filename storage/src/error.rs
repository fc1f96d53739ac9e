//! The crate's one error type.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::ShardRange;

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
    /// Appends are waiting for the disk beyond `LogConfig::max_pending_bytes`. A caller that
    /// checks `Log::has_room` first never sees it (the broker holds the append back instead:
    /// back-pressure, never a refused publish).
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
    /// Recovery (or an offline check) found damage inside committed data: bytes that a
    /// completed fdatasync covered no longer hold valid records. Cutting there would drop
    /// acknowledged records and hand their offsets out again, so the log refuses to open; the
    /// message names the file, the position, what it can attribute and the repair command.
    #[error("{0}")]
    CorruptLog(Box<CorruptLog>),
    /// Another process (a running broker, or an offline log command) holds the log
    /// directory's lock.
    #[error(
        "durable log {} is in use: another process holds {} (a running broker, or a `felix log` command); stop it first",
        dir.display(),
        lock_file.display()
    )]
    Locked { dir: PathBuf, lock_file: PathBuf },
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

/// Where committed data of a log is damaged, what it held, and how to proceed
/// ([`StorageError::CorruptLog`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptLog {
    /// The log directory (one data-plane core's log).
    pub dir: PathBuf,
    /// The segment's sequence number and file.
    pub segment: u64,
    pub file: PathBuf,
    /// Byte position of the first damaged byte found (0 for a damaged header).
    pub position: u64,
    /// What is wrong there.
    pub reason: String,
    /// Shard offset ranges the damaged bytes held, as far as they can be attributed (the
    /// damaged record's own header, and offsets missing before the next valid records).
    pub attributed: Vec<ShardRange>,
    /// The command that quarantines the damage so the log can open again.
    pub repair_command: String,
}

/// Most attributed ranges listed in a message (the rest are counted).
const ATTRIBUTED_SHOWN_MAX: usize = 8;

impl std::fmt::Display for CorruptLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "durable log {}: committed data is corrupt in segment file {} at byte {}: {}; ",
            self.dir.display(),
            self.file.display(),
            self.position,
            self.reason
        )?;
        if self.attributed.is_empty() {
            write!(f, "the damaged bytes cannot be attributed to a shard")?;
        } else {
            write!(f, "damaged records: ")?;
            for (i, r) in self
                .attributed
                .iter()
                .take(ATTRIBUTED_SHOWN_MAX)
                .enumerate()
            {
                let sep = if i == 0 { "" } else { ", " };
                write!(f, "{sep}shard {} offsets {}..{}", r.shard, r.first, r.end)?;
            }
            if self.attributed.len() > ATTRIBUTED_SHOWN_MAX {
                write!(
                    f,
                    " and {} more ranges",
                    self.attributed.len() - ATTRIBUTED_SHOWN_MAX
                )?;
            }
        }
        write!(
            f,
            ". Recovery stops here: acknowledged records may follow, and cutting would lose them \
             and hand their offsets out again. Stop the broker and run `{}` to quarantine the \
             damaged range (docs/storage-format.md, Corruption and repair)",
            self.repair_command
        )
    }
}

/// The `felix log repair` command for a log directory: a broker's logs live in
/// `<data_dir>/log/core-<i>`, so the data directory is two levels up; any other directory is
/// named as it is.
pub fn repair_command(dir: &Path) -> String {
    let data_dir = dir
        .parent()
        .filter(|log| log.file_name().is_some_and(|n| n == "log"))
        .filter(|_| {
            dir.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("core-"))
        })
        .and_then(Path::parent)
        .unwrap_or(dir);
    format!("felix log repair --data-dir {}", data_dir.display())
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
