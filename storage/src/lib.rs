//! felix-storage: the durable log of one data-plane core.
//!
//! Owns the on-disk format of durable streams (record framing, segment files, recovery,
//! retention), the in-memory per-shard index, group commit and the IO backends that carry it
//! out (io_uring, a pwrite writer thread, and a fault-injecting backend for tests). It does
//! not know streams, acks or subscribers: the broker maps (stream, shard) to a log-local
//! `u32` shard id, appends, and acts on the [`LogEvent`]s.
//!
//! Threads: one [`Log`] per data-plane core, created and driven on that core's
//! single-threaded event loop, and kept there (`append`, `drive` and `poll_event` never block).
//! The io_uring backend adds the kernel's io-wq workers; the pwrite backend adds one writer
//! thread per log. Reads (`Log::read`) pread on the calling thread. The format is specified in
//! `docs/storage-format.md`.

mod backend;
mod config;
mod counters;
mod error;
pub mod frame;
mod index;
mod log;
mod recovery;
pub mod segment;

pub use backend::{
    Backend, EventFd, FaultBackend, FaultHandle, PowerCut, PwriteBackend, ROUNDS_IN_FLIGHT_MAX,
    RoundCompletion, RoundFailure, RoundRequest, SystemBackend, UringBackend, wait_readable,
};
pub use config::{
    BackendChoice, DEFAULT_FSYNC_INTERVAL, DEFAULT_MAX_PENDING_BYTES, DEFAULT_MAX_ROUND_BYTES,
    DEFAULT_SEGMENT_BYTES, FsyncMode, LogConfig, SEGMENT_BYTES_MAX, SEGMENT_BYTES_MIN,
};
pub use counters::{Counters, LATENCY_BUCKETS, LatencyHistogram};
pub use error::{ErrorChain, StorageError};
pub use index::{DEFAULT_INDEX_INTERVAL_BYTES, IndexEntry};
pub use log::{Log, LogEvent, READ_CHUNK_BYTES, Record, RetentionReport, ShardOffsets, ShardRange};
pub use recovery::{RecoveryReport, SCAN_CHUNK_BYTES, ShardRecovery, Truncation};
