//! felix-storage: the durable log of one data-plane core.
//!
//! Owns the on-disk format of durable streams (record framing, segment files, recovery,
//! retention), the in-memory per-shard index, group commit and the IO backends that carry it
//! out (io_uring, a pwrite writer thread, and a fault-injecting backend for tests). It does
//! not know streams, acks or subscribers: the broker maps (stream, shard) to a log-local
//! `u32` shard id, appends, and acts on the [`LogEvent`]s. It also owns the log's integrity
//! tools: commit marks (which tell damage inside synced data from a torn write), sidecar
//! indexes of closed segments (recovery time independent of the log's size), the quarantine of
//! damaged ranges, the release of deleted streams' shards, the directory lock, and the offline
//! `check`, `repair` and `compact` commands (`offline.rs`).
//!
//! Threads: one [`Log`] per data-plane core, created and driven on that core's
//! single-threaded event loop, and kept there (`append`, `drive` and `poll_event` never block).
//! The io_uring backend adds the kernel's io-wq workers; the pwrite backend adds one writer
//! thread per log. Catch-up reads (`Log::try_read`) never block the core's thread on the disk:
//! what the page cache does not hold is read by the log's reader thread (`felix-log-reader`,
//! spawned at the first such read) and the read is answered later (`reader.rs`); the
//! blocking `Log::read` (tests, tools) preads on the calling thread. The offline commands run on
//! the caller's thread with the directory locked. The format is specified in
//! `docs/storage-format.md`.

mod ahead;
mod backend;
mod config;
mod counters;
pub mod direct;
mod error;
pub mod frame;
mod index;
mod lock;
mod log;
pub mod offline;
pub mod quarantine;
mod reader;
mod recovery;
mod scan;
pub mod segment;
pub mod sidecar;

pub use ahead::AheadMode;
pub use backend::{
    Backend, EventFd, FaultBackend, FaultHandle, PowerCut, PwriteBackend, ROUNDS_IN_FLIGHT_MAX,
    RoundCompletion, RoundFailure, RoundRequest, SystemBackend, UringBackend, wait_readable,
};
pub use config::{
    BackendChoice, DEFAULT_FSYNC_INTERVAL, DEFAULT_MAX_PENDING_BYTES, DEFAULT_MAX_ROUND_BYTES,
    DEFAULT_SEGMENT_BYTES, FsyncMode, LogConfig, SEGMENT_BYTES_MAX, SEGMENT_BYTES_MIN,
};
pub use counters::{Counters, LATENCY_BUCKETS, LatencyHistogram};
pub use error::{CorruptLog, ErrorChain, StorageError, repair_command};
pub use index::{DEFAULT_INDEX_INTERVAL_BYTES, IndexEntry};
pub use lock::{DirLock, LOCK_FILE};
pub use log::{
    Log, LogEvent, MARK_DELAY, READ_CHUNK_BYTES, ReadOutcome, ReadResume, Record, ReleaseReport,
    RetentionReport, ShardOffsets, ShardRange,
};
pub use quarantine::{Quarantine, QuarantineRange, Released};
pub use reader::{FETCHED_KEPT_MAX, FETCHES_IN_FLIGHT_MAX, HeldReads};
pub use recovery::{RecoveryReport, ShardRecovery, TAIL_COUNT_WINDOW_BYTES, Truncation};
pub use scan::{MARK_SEARCH_WINDOW_BYTES, RESYNC_WINDOW_BYTES, SCAN_CHUNK_BYTES};
