//! A replicated shard's **record log** on one member (docs/cluster.md, "Retention"): the
//! committed records of the shard at the offsets the shard gave them, in a Felix log of their
//! own (`storage/src/log.rs`, the single broker's durable format), kept with the single
//! broker's retention settings (FELIX_DURABLE_RETENTION_BYTES / _SECONDS), so a replicated
//! stream keeps its records as long as a single broker's durable stream would, however far
//! the shard's Raft log is compacted.
//!
//! How it follows the shard (`groups.rs` drives it):
//!
//! - **Recording**: after every pass the records of applied batches past the log's next offset
//!   are appended, read out of the shard's Raft log entries ([`ShardRecords::catch_up`]).
//!   Only applied (committed) batches have offsets, so the log holds committed records only,
//!   the same at the same offsets on every member.
//! - **Compaction waits for it**: the group compacts its Raft log only behind records this log
//!   has fdatasynced ([`ShardRecords::synced`]), so no committed record is ever only in a
//!   released Raft generation. The log writes full rounds as they fill and the rest at the
//!   group's tick, and fdatasyncs every FELIX_DURABLE_FSYNC_INTERVAL_MS
//!   (periodic: the records are durable in the Raft log until then, so publishes never wait
//!   for this log).
//! - **Restart**: the log recovers its records; the member re-applies its committed entries
//!   past the Raft snapshot and appends only those past the log's next offset (by offset:
//!   nothing is written twice).
//! - **Holes**: a member that fell behind a compaction installs a snapshot and has no entries
//!   for the offsets between its log's end and the snapshot. It fetches them from a peer's
//!   record log over the peer connections ([`crate::memory::DataFrame::RecordsFetch`]) before
//!   it records anything past them; reads in the hole wait (answer nothing yet) meanwhile.
//!   When no peer holds them any more (their retention dropped them), the log starts over at
//!   the oldest offset the peers hold: a new *generation* (a new storage shard id, the old one
//!   released), as retention would have dropped them here too.
//!
//! Generation `g` is storage shard `g`; the current one is the highest the log holds.
//!
//! Threads: non-blocking reads ([`ShardRecords::try_read`]) and writes on the caller's
//! thread (the service's loop, on the broker's core 0), plus the threads the Felix log's
//! backend spawns and its reader thread (the bytes of a read not in memory).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use felix_storage::{
    Backend, BackendChoice, FsyncMode, Log, LogConfig, LogEvent, ReadOutcome, StorageError,
    SystemBackend,
};

use crate::raft_log::now_unix_us;
use crate::shard::{ReadError, ShardRecord, ShardState};

/// Segment size of a record log (retention deletes whole segments, never the active one).
pub const RECORD_LOG_SEGMENT_BYTES: u64 = 16 << 20;
/// Largest write round of a record log.
const RECORD_LOG_ROUND_BYTES: usize = 1 << 20;
/// Appended, unwritten bytes a record log holds before recording waits for its writes.
const RECORD_LOG_PENDING_BYTES: usize = 8 << 20;

/// How a member's record logs are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordsConfig {
    /// The fdatasync interval (FELIX_DURABLE_FSYNC_INTERVAL_MS).
    pub fsync_interval: Duration,
    /// Delete a shard's oldest segments while its record log exceeds this many bytes
    /// (FELIX_DURABLE_RETENTION_BYTES; `None` keeps everything).
    pub retention_bytes: Option<u64>,
    /// Delete segments whose newest record is older than this (FELIX_DURABLE_RETENTION_SECONDS).
    pub retention_age: Option<Duration>,
    /// Applied entries a shard group's Raft log keeps before it compacts behind a snapshot
    /// (FELIX_CLUSTER_RAFT_COMPACT_ENTRIES; `NodeConfig::compact_after`).
    pub compact_after: u64,
    /// Segment size of each record log ([`RECORD_LOG_SEGMENT_BYTES`]; retention deletes whole
    /// segments).
    pub segment_bytes: u64,
}

impl Default for RecordsConfig {
    fn default() -> Self {
        RecordsConfig {
            fsync_interval: Duration::from_millis(250),
            retention_bytes: None,
            retention_age: None,
            compact_after: 10_000,
            segment_bytes: RECORD_LOG_SEGMENT_BYTES,
        }
    }
}

/// Why recording failed: the log failed (fatal for the member's copy), or a Raft entry holds
/// no batch (never expected: only batches are proposed to a shard group).
#[derive(Debug, thiserror::Error)]
pub enum RecordsError {
    #[error("record log: {0}")]
    Storage(#[from] StorageError),
    #[error("raft entry {index}: {error}")]
    Entry { index: u64, error: String },
}

/// What [`ShardRecords::catch_up`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CatchUp {
    /// Every applied record is appended (or waits for room in the log's pending bytes).
    Recorded,
    /// The records from `from` are no longer in the Raft log (a snapshot was installed):
    /// they must be fetched from a peer ([`ShardRecords::fill`]).
    Hole { from: u64 },
}

/// One replicated shard's record log on this member.
pub struct ShardRecords<B: Backend = SystemBackend> {
    log: Log<B>,
    /// The storage shard holding the records now.
    generation: u32,
    /// Where an empty generation starts: offsets below were dropped (by the peers' retention)
    /// before this member could record them.
    floor: u64,
}

impl<B: Backend> std::fmt::Debug for ShardRecords<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardRecords")
            .field("dir", &self.log.config().dir)
            .field("generation", &self.generation)
            .field("next", &self.next())
            .finish_non_exhaustive()
    }
}

/// The Felix log configuration of a record log in `dir`.
#[must_use]
pub fn record_log_config(dir: &Path, config: &RecordsConfig) -> LogConfig {
    let mut log = LogConfig::new(dir);
    log.segment_bytes = config.segment_bytes;
    log.max_round_bytes =
        RECORD_LOG_ROUND_BYTES.min(usize::try_from(config.segment_bytes / 2).unwrap_or(usize::MAX));
    log.max_pending_bytes = RECORD_LOG_PENDING_BYTES;
    log.fsync = FsyncMode::Periodic {
        interval: config.fsync_interval.max(Duration::from_millis(1)),
    };
    log.retention_bytes = config.retention_bytes;
    log.retention_age = config.retention_age;
    log
}

impl ShardRecords<SystemBackend> {
    /// Opens (creating if needed) and recovers the record log in `dir` on the system backend
    /// (FELIX_STORAGE_IO_URING picks io_uring or pwrite). Blocks.
    pub fn open(dir: &Path, config: &RecordsConfig) -> Result<ShardRecords, StorageError> {
        let backend = SystemBackend::open(BackendChoice::from_env()?)?;
        Self::open_with(dir, config, backend)
    }
}

impl<B: Backend> ShardRecords<B> {
    /// Opens (creating if needed) and recovers the record log in `dir` on `backend` (the
    /// simulation's fault backend, or the system's). Blocks.
    pub fn open_with(
        dir: &Path,
        config: &RecordsConfig,
        backend: B,
    ) -> Result<ShardRecords<B>, StorageError> {
        let (mut log, report) = Log::open(record_log_config(dir, config), backend)?;
        if !report.truncations.is_empty() {
            tracing::warn!(
                dir = %dir.display(),
                truncated_bytes = report.truncated_bytes,
                "record log recovery cut a torn tail"
            );
        }
        let held = log.shard_ids().into_iter().max();
        let generation = match held {
            Some(generation) => generation,
            None => log.released().shards().max().map_or(0, |g| g + 1),
        };
        // A generation switch a crash interrupted leaves the older one behind.
        log.release_shards(|shard| shard == generation)?;
        Ok(ShardRecords {
            log,
            generation,
            floor: 0,
        })
    }

    /// The directory of this log.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.log.config().dir
    }

    fn offsets(&self) -> Option<felix_storage::ShardOffsets> {
        self.log.shard_offsets(self.generation)
    }

    /// The next offset this log records: every committed record from [`Self::oldest`] up to
    /// it is appended (written or on its way).
    #[must_use]
    pub fn next(&self) -> u64 {
        self.offsets().map_or(self.floor, |o| o.next)
    }

    /// Offsets below are fdatasynced here (or were dropped before they could be recorded).
    #[must_use]
    pub fn synced(&self) -> u64 {
        self.offsets().map_or(self.floor, |o| o.synced)
    }

    /// Offsets below are written and readable from this log.
    #[must_use]
    pub fn written(&self) -> u64 {
        self.offsets().map_or(self.floor, |o| o.written)
    }

    /// The oldest offset this member can still serve: the log's oldest record (older ones
    /// were deleted by retention), or where recording starts when the log holds none.
    #[must_use]
    pub fn oldest(&self) -> u64 {
        self.offsets().map_or(self.floor, |o| o.oldest)
    }

    /// Bytes of the log's files.
    #[must_use]
    pub fn disk_bytes(&self) -> u64 {
        self.log.total_bytes()
    }

    /// Appends the records of the batches `state` applied past [`Self::next`], reading them
    /// out of the shard's Raft log `store`, until all are appended or the log's pending bytes
    /// are full (the next call goes on). Never does IO ([`Self::drive`] writes).
    pub fn catch_up<S: raft::Storage>(
        &mut self,
        state: &ShardState,
        store: &S,
    ) -> Result<CatchUp, RecordsError> {
        loop {
            let next = self.next();
            if next >= state.next_offset() {
                return Ok(CatchUp::Recorded);
            }
            let Some((span, within)) = state.locate(next) else {
                return Ok(CatchUp::Hole { from: next });
            };
            let batch = span.batch(store).map_err(|error| RecordsError::Entry {
                index: span.index,
                error,
            })?;
            for (position, record) in batch.records.iter().enumerate().skip(within) {
                if !self.log.can_append(record.key.len(), record.payload.len()) {
                    return Ok(CatchUp::Recorded);
                }
                self.log.append(
                    self.generation,
                    span.first_offset + position as u64,
                    record.timestamp_us,
                    &record.key,
                    &record.payload,
                )?;
            }
        }
    }

    /// Records fetched from a peer for a hole: `records` in offset order from `first`. Those
    /// that do not follow [`Self::next`] are ignored (a late or repeated answer); those that
    /// do not fit the pending bytes wait for the next fetch. Returns how many were appended.
    pub fn fill(&mut self, records: &[(u64, ShardRecord)]) -> Result<usize, StorageError> {
        let mut appended = 0;
        for (offset, record) in records {
            if *offset != self.next() {
                continue;
            }
            if !self.log.can_append(record.key.len(), record.payload.len()) {
                break;
            }
            self.log.append(
                self.generation,
                *offset,
                record.timestamp_us,
                &record.key,
                &record.payload,
            )?;
            appended += 1;
        }
        Ok(appended)
    }

    /// The peers no longer hold the offsets below `oldest` (their retention dropped them):
    /// recording starts at `oldest`. A log holding records below it starts a new generation
    /// (the old one is released once written).
    pub fn skip_to(&mut self, oldest: u64) -> Result<(), StorageError> {
        if oldest <= self.next() {
            return Ok(());
        }
        if self.offsets().is_some() {
            self.generation += 1;
            let generation = self.generation;
            self.log.release_shards(|shard| shard == generation)?;
            tracing::warn!(
                dir = %self.dir().display(),
                oldest,
                "the peers no longer hold the records this member missed: its record log starts again at their oldest"
            );
        }
        self.floor = oldest;
        Ok(())
    }

    /// Whether a read from `from` finds records here: `false` from [`Self::written`] on,
    /// [`ReadError::Compacted`] below [`Self::oldest`].
    fn holds(&self, from: u64) -> Result<bool, ReadError> {
        let oldest = self.oldest();
        if from < oldest {
            return Err(ReadError::Compacted { oldest });
        }
        Ok(from < self.written())
    }

    /// [`Self::try_read`], waiting for the disk (preads on the calling thread): for tools
    /// and tests; the member never calls it.
    pub fn read(
        &self,
        from: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<(u64, ShardRecord)>, ReadError> {
        if !self.holds(from)? {
            return Ok(Vec::new());
        }
        let records = self
            .log
            .read(self.generation, from, max_records, max_bytes)
            .map_err(|error| ReadError::Failed(format!("record log: {error}")))?;
        Ok(records.into_iter().map(shard_record).collect())
    }

    /// Reads committed records from `from` out of this log: `(offset, record)` in offset
    /// order, at most `max_records` and about `max_bytes` of keys and payloads (at least one
    /// record), empty from [`Self::written`] on. Never blocks on the disk (`Log::try_read`):
    /// `Ok(None)` when the bytes it needs first are being fetched by the log's reader thread;
    /// ask again once [`Self::poll_reads`] took them in (the log's [`Self::wake_fd`] wakes the
    /// owner). A read that gathered some records before such bytes returns those.
    pub fn try_read(
        &self,
        from: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Option<Vec<(u64, ShardRecord)>>, ReadError> {
        if !self.holds(from)? {
            return Ok(Some(Vec::new()));
        }
        let outcome = self
            .log
            .try_read(self.generation, from, max_records, max_bytes, None)
            .map_err(|error| ReadError::Failed(format!("record log: {error}")))?;
        Ok(match outcome {
            ReadOutcome::Records(records) => Some(records.into_iter().map(shard_record).collect()),
            ReadOutcome::Pending(_) => None,
        })
    }

    /// Takes in the chunks the reader thread fetched; how many arrived (reads that answered
    /// `None` may complete now). Never blocks.
    pub fn poll_reads(&self) -> usize {
        self.log.poll_reads()
    }

    /// Fetches on their way for [`Self::try_read`].
    #[must_use]
    pub fn reads_outstanding(&self) -> usize {
        self.log.reads_outstanding()
    }

    /// A copy of the eventfd the log's reader thread (and its write completions) make
    /// readable.
    pub fn wake_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.log.wake_fd().try_clone_to_owned()
    }

    /// Asks for an fdatasync as soon as possible (a compaction waits for it).
    pub fn sync_now(&mut self) {
        self.log.sync_now();
    }

    /// [`Self::drive`] once a full write round is appended; otherwise the appends wait for
    /// the next call of [`Self::drive`] (the group's tick, every 100 ms). Nothing waits for
    /// these writes (the records are durable in the Raft log and read from it until written
    /// here), so gathering them into full rounds saves the member a write per batch.
    pub fn drive_if_full(&mut self, now: Instant) -> Result<(), StorageError> {
        if self.log.pending_bytes() >= self.log.config().max_round_bytes {
            self.drive(now)?;
        }
        Ok(())
    }

    /// Writes and fdatasyncs what is due (never blocks); a rejected round (disk full) is
    /// appended again by the next [`Self::catch_up`] (the log's next offset went back). An
    /// error is the log's failure: fatal.
    pub fn drive(&mut self, now: Instant) -> Result<(), StorageError> {
        self.log.drive(now)?;
        while let Some(event) = self.log.poll_event() {
            if let LogEvent::Rejected { error, .. } = event {
                tracing::warn!(dir = %self.dir().display(), %error, "a record log write was refused; recording waits");
            }
        }
        Ok(())
    }

    /// Retention: deletes whole oldest segments past the byte or age bound, and releases
    /// an older generation left by [`Self::skip_to`] once written.
    pub fn apply_retention(&mut self) -> Result<(), StorageError> {
        let generation = self.generation;
        self.log.release_shards(|shard| shard == generation)?;
        let report = self.log.apply_retention(now_unix_us())?;
        if !report.segments_deleted.is_empty() {
            tracing::debug!(
                dir = %self.dir().display(),
                segments = report.segments_deleted.len(),
                bytes = report.bytes_deleted,
                "record log retention"
            );
        }
        Ok(())
    }

    /// Writes and fdatasyncs everything appended (shutdown, tests). Blocks up to `timeout`.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), StorageError> {
        self.log.sync_now();
        self.log.flush(timeout)?;
        while self.log.poll_event().is_some() {}
        Ok(())
    }
}

fn shard_record(r: felix_storage::Record) -> (u64, ShardRecord) {
    (
        r.offset,
        ShardRecord {
            timestamp_us: r.timestamp_us,
            key: r.key,
            payload: r.payload,
        },
    )
}

/// The directory of shard group `group`'s record log under the member's `records` directory.
#[must_use]
pub fn records_dir(records: &Path, group: u64) -> PathBuf {
    records.join(group.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u64) -> ShardRecord {
        ShardRecord {
            timestamp_us: n,
            key: bytes::Bytes::from(format!("k{n}")),
            payload: bytes::Bytes::from(format!("record {n}")),
        }
    }

    /// A read whose bytes are not in memory answers `None` at once (the member's thread never
    /// waits for the disk), and the records once the reader thread fetched them.
    #[test]
    fn a_read_that_misses_the_page_cache_waits_for_its_fetch_without_blocking() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut log =
            ShardRecords::open(&dir.path().join("7"), &RecordsConfig::default()).expect("opens");
        let records: Vec<(u64, ShardRecord)> = (0..100).map(|n| (n, record(n))).collect();
        assert_eq!(log.fill(&records).expect("appended"), 100);
        log.flush(Duration::from_secs(30)).expect("written");
        assert_eq!(log.written(), 100);

        log.log.force_read_misses(true);
        assert!(
            log.try_read(10, 50, usize::MAX).expect("a read").is_none(),
            "a miss waits for its fetch"
        );
        assert_eq!(log.reads_outstanding(), 1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while log.poll_reads() == 0 {
            assert!(Instant::now() < deadline, "the fetch never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        let read = log
            .try_read(10, 50, usize::MAX)
            .expect("a read")
            .expect("the fetched bytes answer it");
        assert_eq!(read, records[10..60].to_vec());
        // Past what is written: nothing, at once; below the oldest: compacted.
        assert_eq!(
            log.try_read(100, 10, usize::MAX).expect("a read"),
            Some(Vec::new())
        );
    }
}
