//! The log's typed configuration.

use std::path::PathBuf;
use std::time::Duration;

use crate::StorageError;

/// Default segment size: 1 GiB. Large enough that segment creation (a few ms, on the
/// calling thread) happens about once a second at the disk's ~1.5 GB/s.
pub const DEFAULT_SEGMENT_BYTES: u64 = 1 << 30;
/// Smallest segment: one header page and a few records; only tests go this low.
pub const SEGMENT_BYTES_MIN: u64 = 16 << 10;
/// Largest segment: 64 GiB keeps a deleted segment a bounded amount of retention.
pub const SEGMENT_BYTES_MAX: u64 = 64 << 30;
/// Default largest round: 4 MiB. docs/design/machine.md (Disk): one write + fdatasync of 1 MiB
/// (256 x 4 KiB) already reaches 1.6-2.5 GB/s; bigger rounds add latency to their first
/// records for little throughput.
pub const DEFAULT_MAX_ROUND_BYTES: usize = 4 << 20;
/// Default bound on bytes appended but not yet written: 64 MiB, ~40 ms of the disk's rate,
/// so a stalled disk pushes back on the broker instead of growing memory without bound.
pub const DEFAULT_MAX_PENDING_BYTES: usize = 64 << 20;
/// Default periodic fsync interval (FELIX_DURABLE_FSYNC_INTERVAL_MS = 250; docs/semantics.md,
/// 3 Publishing).
pub const DEFAULT_FSYNC_INTERVAL: Duration = Duration::from_millis(250);

/// When written records are made durable with fdatasync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncMode {
    /// Every round is a write linked with an fdatasync; records are reported written and
    /// synced together. Nothing reported synced is lost on power failure.
    OnCommit,
    /// Rounds are writes only; an fdatasync runs once written data is `interval` old (or on
    /// [`crate::Log::sync_now`]). A process crash loses nothing written; a power loss can lose
    /// up to one interval (plus one round) of written records.
    Periodic { interval: Duration },
}

/// Which IO backend [`crate::SystemBackend`] should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// io_uring, falling back to pwrite (with a warning) where the ring cannot be set up.
    IoUring,
    /// A writer thread doing pwrite + fdatasync.
    Pwrite,
}

impl BackendChoice {
    /// Reads FELIX_STORAGE_IO_URING: unset or `1` = io_uring, `0` = pwrite; anything else is
    /// an error naming the variable.
    pub fn from_env() -> Result<Self, StorageError> {
        match std::env::var("FELIX_STORAGE_IO_URING") {
            Err(std::env::VarError::NotPresent) => Ok(BackendChoice::IoUring),
            Ok(v) if v == "1" => Ok(BackendChoice::IoUring),
            Ok(v) if v == "0" => Ok(BackendChoice::Pwrite),
            Ok(v) => Err(StorageError::Config(format!(
                "FELIX_STORAGE_IO_URING must be 0 or 1, got {v:?}"
            ))),
            Err(e) => Err(StorageError::Config(format!("FELIX_STORAGE_IO_URING: {e}"))),
        }
    }
}

/// Configuration of one log (one per data-plane core). All fields need a restart to change.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// Directory holding this log's segments (one directory per core).
    pub dir: PathBuf,
    /// Preallocated size of each segment file. Default 1 GiB; range 16 KiB..=64 GiB.
    pub segment_bytes: u64,
    /// Fsync mode. Default periodic every 250 ms (docs/semantics.md, 3 Publishing).
    pub fsync: FsyncMode,
    /// A round is cut when it would grow past this. Default 4 MiB; range 4 KiB..=segment_bytes/2.
    pub max_round_bytes: usize,
    /// Bound on appended, not yet submitted bytes (on-disk frame bytes). The caller checks
    /// `Log::has_room` and holds back what does not fit until a round is submitted (a slow
    /// disk makes appends wait); an append past it is refused with `PendingFull`, except into
    /// an empty log. Default 64 MiB; at least `max_round_bytes`.
    pub max_pending_bytes: usize,
    /// Delete the oldest segments while the log's files exceed this many bytes. Default none.
    pub retention_bytes: Option<u64>,
    /// Delete the oldest segments whose newest record is older than this. Default none.
    pub retention_age: Option<Duration>,
    /// Log bytes between two index entries of one shard (see `index.rs`). Default 4 MiB;
    /// range 4 KiB..=1 GiB. Smaller = faster read starts, more memory.
    pub index_interval_bytes: u64,
    /// Write rounds with O_DIRECT (`direct.rs`): no page-cache copy, no writeback at
    /// fdatasync. Default true; where the file system refuses O_DIRECT the log warns once
    /// and writes buffered.
    pub direct_io: bool,
    /// Write rounds in flight at once, 1 or 2 (`backend::ROUNDS_IN_FLIGHT_MAX`). With 2, the
    /// next records round is written while the previous round's fdatasync runs (once that
    /// round's write finished). Default 2.
    pub rounds_in_flight: usize,
}

impl LogConfig {
    /// Defaults for a log in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LogConfig {
            dir: dir.into(),
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            fsync: FsyncMode::Periodic {
                interval: DEFAULT_FSYNC_INTERVAL,
            },
            max_round_bytes: DEFAULT_MAX_ROUND_BYTES,
            max_pending_bytes: DEFAULT_MAX_PENDING_BYTES,
            retention_bytes: None,
            retention_age: None,
            index_interval_bytes: crate::index::DEFAULT_INDEX_INTERVAL_BYTES,
            direct_io: true,
            rounds_in_flight: crate::backend::ROUNDS_IN_FLIGHT_MAX,
        }
    }

    /// Checks every range; the error names the field.
    pub fn validate(&self) -> Result<(), StorageError> {
        let bad = |msg: String| Err(StorageError::Config(msg));
        if !(SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&self.segment_bytes) {
            return bad(format!(
                "segment_bytes {} outside {SEGMENT_BYTES_MIN}..={SEGMENT_BYTES_MAX}",
                self.segment_bytes
            ));
        }
        if self.max_round_bytes < 4096 || self.max_round_bytes as u64 > self.segment_bytes / 2 {
            return bad(format!(
                "max_round_bytes {} outside 4096..={} (half a segment)",
                self.max_round_bytes,
                self.segment_bytes / 2
            ));
        }
        if self.max_pending_bytes < self.max_round_bytes {
            return bad(format!(
                "max_pending_bytes {} below max_round_bytes {}",
                self.max_pending_bytes, self.max_round_bytes
            ));
        }
        if let FsyncMode::Periodic { interval } = self.fsync
            && interval.is_zero()
        {
            return bad("fsync interval must be above zero (use on_commit instead)".into());
        }
        if !(4096..=1 << 30).contains(&self.index_interval_bytes) {
            return bad(format!(
                "index_interval_bytes {} outside 4096..=1073741824",
                self.index_interval_bytes
            ));
        }
        if !(1..=crate::backend::ROUNDS_IN_FLIGHT_MAX).contains(&self.rounds_in_flight) {
            return bad(format!(
                "rounds_in_flight {} outside 1..={}",
                self.rounds_in_flight,
                crate::backend::ROUNDS_IN_FLIGHT_MAX
            ));
        }
        if self.retention_bytes == Some(0) {
            return bad("retention_bytes must be above zero when set".into());
        }
        Ok(())
    }
}
