//! The per-core log: group commit over a [`Backend`], commit marks, segments (and their
//! sidecar indexes), the index, reads (skipping quarantined ranges), retention and the release
//! of deleted streams' segments. Recovery (`Log::open`) lives in `recovery.rs`, the offline
//! commands in `offline.rs`.
//!
//! Threads: the core's event-loop thread (see [`Log`]).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::ahead::Ahead;
use crate::backend::{
    Backend, ROUNDS_IN_FLIGHT_MAX, RoundCompletion, RoundFailure, RoundRequest, wait_readable,
};
use crate::counters::Counters;
use crate::direct::{self, AlignedBuf, DIRECT_ALIGN, DirectWrite};
use crate::frame::{self, Decoded, HEADER_BYTES, MARK_BYTES};
use crate::index::{IndexEntry, ShardIndex};
use crate::lock::DirLock;
use crate::quarantine::{Quarantine, Released};
use crate::reader::{Chunk, Reads};
use crate::sidecar::{self, Sidecar, SidecarShard};
use crate::{FsyncMode, LogConfig, StorageError, segment};

/// Bytes read per pread when a subscriber catches up: 256 KiB amortises the syscall over
/// many records while one read of a 48-shard interleaved log still stays cache-sized.
pub const READ_CHUNK_BYTES: u64 = 256 << 10;
/// Completions reaped per `drive` call. At most two rounds are in flight
/// (`ROUNDS_IN_FLIGHT_MAX`), so more than two in one call would be a backend bug; 4 leaves
/// slack without looping unboundedly.
const DRIVE_REAPS_MAX: usize = 4;
/// Spare round buffers kept for reuse: one being filled, two in flight, one spare.
const SPARE_BUFFERS_MAX: usize = 4;
/// How long an on_commit log waits, idle, after a completed fdatasync before it writes a
/// commit mark of its own (one 28-byte write + fdatasync). While records keep coming, each
/// round carries the mark for the previous ones at no cost; after a burst the last round's
/// records stay unproven (recovery would treat damage in them as a torn write) for at most
/// this long. 20 ms: a publisher sending more often than 50 times a second never pays for a
/// mark round, and the window stays far below any restart. Periodic logs wait one fsync
/// interval instead (their power-loss window).
pub const MARK_DELAY: Duration = Duration::from_millis(20);

/// Offsets `first..end` (end exclusive) of one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRange {
    pub shard: u32,
    pub first: u64,
    pub end: u64,
}

impl ShardRange {
    pub fn len(&self) -> u64 {
        self.end - self.first
    }
    pub fn is_empty(&self) -> bool {
        self.end == self.first
    }
}

/// What a completed round changed, drained with [`Log::poll_event`] after each `drive`.
#[derive(Debug, Clone)]
pub enum LogEvent {
    /// These records' write completed: they are in the file (page cache) and readable; a
    /// process crash no longer loses them. Emitted in both modes, before `Synced`.
    Written(Vec<ShardRange>),
    /// A completed fdatasync covers these records: a power loss no longer loses them.
    /// On `on_commit` it follows `Written` of the same round; on `periodic` it covers every
    /// record written since the previous sync.
    Synced(Vec<ShardRange>),
    /// These appends are not in the log (disk full); each shard's next offset went back to
    /// `first` of its range, so the caller can retry with the same offsets.
    Rejected {
        ranges: Vec<ShardRange>,
        error: StorageError,
    },
}

/// A record read back from the log; key and payload share one read buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub shard: u32,
    pub offset: u64,
    pub timestamp_us: u64,
    pub key: Bytes,
    pub payload: Bytes,
}

/// What [`Log::try_read`] did.
#[derive(Debug)]
pub enum ReadOutcome {
    /// The records, as [`Log::read`] would return them, or fewer: a read that gathered some
    /// records and then met bytes not in memory returns those it has (the next read goes on
    /// from there). Empty means the log holds nothing more from the offset.
    Records(Vec<Record>),
    /// Bytes the read needs first are not in memory: a fetch is on its way (or waits for a
    /// place among [`crate::FETCHES_IN_FLIGHT_MAX`]). Ask again, with the same shard and
    /// offset and this resume point, once [`Log::poll_reads`] took a fetched chunk in.
    Pending(ReadResume),
}

/// Where a read that waits for the disk goes on from (a [`ReadOutcome::Pending`]): its
/// position in the log, so a retry scans each chunk once. Valid for the same shard and
/// offset only; [`Log::try_read`] starts over when it does not match or its segment is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadResume {
    shard: u32,
    from: u64,
    segment: u64,
    pos: u64,
    expect: u64,
    last_hit: u64,
    min_read: u64,
    /// Quarantined offsets skipped before `pos` (counted when the read completes).
    skipped: u64,
}

/// Where a read's walk takes its bytes: `(segment, pos, len, need)` -> bytes from `pos`, up
/// to `len` and at least `need`, or `None` when they are not in memory yet.
type ChunkSource<'a> =
    dyn FnMut(&Segment, u64, usize, usize) -> Result<Option<Bytes>, StorageError> + 'a;

/// How a read's walk ended.
enum Walk {
    Done(Vec<Record>),
    Missed(ReadResume),
}

/// Per-shard offsets as the log sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardOffsets {
    /// Oldest offset still stored (== `written` when nothing is stored).
    pub oldest: u64,
    /// Offsets below are in the file.
    pub written: u64,
    /// Offsets below are covered by a completed fdatasync.
    pub synced: u64,
    /// The next offset `append` accepts.
    pub next: u64,
}

/// Retention pass result.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetentionReport {
    pub segments_deleted: Vec<u64>,
    pub bytes_deleted: u64,
}

/// What [`Log::release_shards`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReleaseReport {
    /// Shards released now (their records are no longer indexed or read).
    pub shards: Vec<u32>,
    /// Closed segments that held only released records: deleted (at the front of the log)
    /// or cut down to their header (elsewhere, so the sequence stays contiguous).
    pub segments: Vec<u64>,
    /// File bytes freed.
    pub bytes_freed: u64,
}

/// One shard's records in one segment (what its sidecar lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegShard {
    pub(crate) first: u64,
    pub(crate) end: u64,
    pub(crate) records: u64,
}

#[derive(Debug)]
pub(crate) struct Segment {
    pub(crate) seq: u64,
    pub(crate) file: Arc<File>,
    pub(crate) path: PathBuf,
    pub(crate) size: u64,
    /// Where the first frame starts (the header's size).
    pub(crate) data_start: u64,
    /// The header's CRC, named by the sidecar.
    pub(crate) header_crc: u32,
    /// End of the last written frame (record or commit mark).
    pub(crate) tail: u64,
    /// End of the last written record (commit marks excluded).
    pub(crate) records_end: u64,
    /// `tail` at the last completed fdatasync of this file.
    pub(crate) synced_end: u64,
    /// `records_end` at the last completed fdatasync of this file.
    pub(crate) synced_records_end: u64,
    /// Largest claim of a commit mark written to this segment, and of one covered by a
    /// completed fdatasync (what a recovery is sure to find).
    pub(crate) mark_claim_written: u64,
    pub(crate) mark_claim_durable: u64,
    /// Records per shard (released shards removed), their count and framed bytes.
    pub(crate) stats: BTreeMap<u32, SegShard>,
    pub(crate) records: u64,
    pub(crate) record_bytes: u64,
    /// Records of released shards still in the file (dropped by `felix log compact`).
    pub(crate) released_records: u64,
    /// A failed write may have left bytes up to here; the next write covers them with zeros.
    pub(crate) scrub_until: u64,
    pub(crate) max_timestamp_us: Option<u64>,
    pub(crate) created_unix_us: u64,
    /// Written since the last completed fdatasync of this file.
    pub(crate) unsynced: bool,
}

impl Segment {
    /// Synced records not yet covered by a durable commit mark.
    fn mark_needed(&self) -> bool {
        self.synced_records_end > self.mark_claim_durable
    }

    /// The claim a mark written now would make, when it would prove more than the marks
    /// already written.
    fn mark_claim(&self) -> Option<u64> {
        (self.synced_end > self.data_start && self.synced_end > self.mark_claim_written)
            .then_some(self.synced_end)
    }

    /// Notes that a record `shard` `first..end` was written.
    pub(crate) fn note_records(&mut self, shard: u32, first: u64, end: u64, records: u64) {
        self.stats
            .entry(shard)
            .and_modify(|s| {
                s.end = s.end.max(end);
                s.records += records;
            })
            .or_insert(SegShard {
                first,
                end,
                records,
            });
        self.records += records;
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ShardState {
    pub(crate) next: u64,
    pub(crate) written: u64,
    pub(crate) synced: u64,
    pub(crate) oldest: u64,
    /// The shard's offsets are fixed on disk (a written record or a checkpoint entry); an
    /// unanchored shard exists only in appends not yet written.
    pub(crate) anchored: bool,
    /// Written since the last sync (listed in `Unsynced::shards`).
    pub(crate) dirty: bool,
    /// Round id and range index of this shard's range in the newest pending round.
    open_round: u64,
    open_range: usize,
}

impl ShardState {
    pub(crate) fn anchored_at(offset: u64) -> Self {
        ShardState {
            next: offset,
            written: offset,
            synced: offset,
            oldest: offset,
            anchored: true,
            dirty: false,
            open_round: 0,
            open_range: 0,
        }
    }
}

#[derive(Debug, Default)]
struct PendingRound {
    id: u64,
    buf: Vec<u8>,
    meta: RoundMeta,
}

#[derive(Debug, Default, Clone)]
struct RoundMeta {
    records: u64,
    body_bytes: u64,
    key_bytes: u64,
    payload_bytes: u64,
    ranges: Vec<ShardRange>,
}

#[derive(Debug)]
enum RoundKind {
    /// Records (plus zero fill over a failed write's leftovers).
    Records(RoundMeta),
    /// Zero fill over leftovers and an fdatasync of the active segment before rolling.
    PreRoll,
    /// An fdatasync alone (periodic mode).
    SyncOnly,
    /// A commit mark alone + fdatasync (an idle log proving its last synced records).
    Mark,
}

#[derive(Debug)]
struct InFlight {
    id: u64,
    kind: RoundKind,
    segment: u64,
    base: u64,
    record_bytes: u64,
    /// The claim of the commit mark written right after the records, if any.
    mark: Option<u64>,
    attempted_bytes: u64,
    sync: bool,
    /// The round before it failed with ENOSPC while it was in flight: its records were
    /// rejected with that round's, and its completion only cleans up.
    doomed: bool,
}

impl InFlight {
    /// The segment's tail once this round is written: its records and its mark (zero fill
    /// over leftovers, if any, lies past it).
    fn end(&self) -> u64 {
        let mark_bytes = if self.mark.is_some() {
            MARK_BYTES as u64
        } else {
            0
        };
        self.base + self.record_bytes + mark_bytes
    }
}

#[derive(Debug, Default)]
struct Unsynced {
    records: u64,
    bytes: u64,
    shards: Vec<u32>,
}

/// A durable log of one data-plane core: every durable shard of the core interleaved in one
/// segmented file sequence, group-committed by backend `B`.
///
/// Lives on its core's event-loop thread for its whole life (shard state is per-core; the
/// fault backend makes it `!Send`, the system backends do not, but nothing moves it). `append`, `drive`, `poll_event`, `try_read` never block; `read` does a pread
/// on the calling thread (tests, tools; `try_read` leaves what the page cache lacks to the
/// log's reader thread, `reader.rs`); segment creation (once per `segment_bytes`) and retention deletes are
/// synchronous file operations of a few ms at most.
///
/// Driving it from an event loop:
/// 1. `append` the records of a turn (they join the pending round);
/// 2. `drive(now)`: reaps finished rounds and starts the next ones (a second records round
///    joins one in flight once that one's write finished, `LogConfig::rounds_in_flight`);
/// 3. drain `poll_event` (acks, subscriber releases);
/// 4. sleep until `wake_fd()` is readable (clear readiness first, then `drive`) or until
///    `next_deadline()` (periodic fsync timer).
pub struct Log<B: Backend> {
    pub(crate) config: LogConfig,
    pub(crate) backend: B,
    /// The directory's lock, held for the log's life (see `lock.rs`).
    pub(crate) lock: DirLock,
    pub(crate) quarantine: Quarantine,
    pub(crate) released: Released,
    pub(crate) segments: VecDeque<Segment>,
    /// The sequence number the next created segment takes when there is none (a fresh log
    /// makes its first segment only when something is appended or [`Log::ensure_segment`]
    /// asks: an idle broker takes no disk).
    pub(crate) first_seq: u64,
    pub(crate) shards: FxHashMap<u32, ShardState>,
    pub(crate) index: FxHashMap<u32, ShardIndex>,
    pending: VecDeque<PendingRound>,
    pending_bytes: usize,
    /// Rounds submitted and not yet applied, oldest first (at most
    /// `LogConfig::rounds_in_flight`). Each starts where the one before it ends.
    in_flight: VecDeque<InFlight>,
    /// Completions that came back before an older round's, held until that one's is
    /// applied (completions apply in round order).
    arrived: Vec<RoundCompletion>,
    events: VecDeque<LogEvent>,
    next_round_id: u64,
    failed: Option<StorageError>,
    pub(crate) counters: Counters,
    sync_due_at: Option<Instant>,
    sync_requested: bool,
    /// When an idle log writes a commit mark for its last synced records.
    pub(crate) mark_due_at: Option<Instant>,
    mark_requested: bool,
    unsynced: Unsynced,
    spare_buffers: Vec<Vec<u8>>,
    pub(crate) total_bytes: u64,
    direct: DirectState,
    /// The file work of rolls, done off this thread (`ahead.rs`). A `RefCell` so a `read`
    /// (`&self`) that finds damage can wait for it before removing a sidecar.
    ahead: RefCell<Ahead>,
    /// The read side: fetched chunks, the reader thread (`reader.rs`). A `RefCell` because
    /// reads take `&self`; the log lives on one thread.
    reads: RefCell<Reads>,
}

/// What the log keeps for direct writes (`direct.rs`).
#[derive(Debug, Default)]
struct DirectState {
    /// The active segment (by sequence number) opened with O_DIRECT.
    file: Option<(u64, Arc<File>)>,
    /// Set when the file system refused O_DIRECT: the log writes buffered from then on.
    unsupported: bool,
    /// The bytes of the active segment's last partial block before its tail, as the last
    /// round submitted leaves them: (segment, tail, bytes from the block start to the tail).
    /// Kept when a round is staged (the next round may be staged before this one completes),
    /// dropped when a round fails; read back from the file when missing (after recovery, a
    /// failed round, a buffered round).
    tail_block: Option<(u64, u64, Vec<u8>)>,
    /// Staged buffers for reuse.
    spare: Vec<AlignedBuf>,
    /// (segment, end): the active segment's bytes before `end` were written by this log (data
    /// or zeros), so writes there change no file-system extent (see [`ZERO_AHEAD_BYTES`]).
    written_until: Option<(u64, u64)>,
}

/// A small round (staged under [`ZERO_AHEAD_ROUND_MAX`]) that reaches blocks the log has not
/// written yet also writes zeros this far past its end. A preallocated segment's blocks are
/// unwritten extents: the first write into one makes the next fdatasync commit the file
/// system's journal too, which doubled a lone 4 KiB round here (~260 us against ~130 us for
/// a round into blocks already written, `examples/mark_cost.rs`). With the zeros written
/// ahead, the next small rounds land in written blocks and their fdatasync is a device flush
/// alone. Big rounds (throughput) skip it: their journal commit is shared by many records and
/// the zeros would cost disk bandwidth. At most one such extension per 256 KiB of log.
pub const ZERO_AHEAD_BYTES: usize = 256 << 10;
/// See [`ZERO_AHEAD_BYTES`].
pub const ZERO_AHEAD_ROUND_MAX: usize = 64 << 10;
/// Rounds of a periodic log smaller than this are written through the page cache even with
/// direct IO on (`Log::buffered_for_latency`): a lone publish of up to a few KiB, not the
/// rounds of a loaded log.
pub const BUFFERED_ROUND_MAX: usize = 16 << 10;

impl<B: Backend> std::fmt::Debug for Log<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log")
            .field("dir", &self.config.dir)
            .field("backend", &self.backend.name())
            .field("segments", &self.segments.len())
            .field("shards", &self.shards.len())
            .field("pending_bytes", &self.pending_bytes)
            .field("failed", &self.failed)
            .finish()
    }
}

pub(crate) fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl<B: Backend> Log<B> {
    pub(crate) fn empty(config: LogConfig, backend: B, lock: DirLock) -> Self {
        let ahead = RefCell::new(Ahead::new(config.dir.clone(), backend.ahead_mode()));
        Log {
            config,
            backend,
            lock,
            quarantine: Quarantine::default(),
            released: Released::default(),
            segments: VecDeque::new(),
            first_seq: 0,
            shards: FxHashMap::default(),
            index: FxHashMap::default(),
            pending: VecDeque::new(),
            pending_bytes: 0,
            in_flight: VecDeque::with_capacity(ROUNDS_IN_FLIGHT_MAX),
            arrived: Vec::with_capacity(ROUNDS_IN_FLIGHT_MAX),
            events: VecDeque::new(),
            next_round_id: 1,
            failed: None,
            counters: Counters::default(),
            sync_due_at: None,
            sync_requested: false,
            mark_due_at: None,
            mark_requested: false,
            unsynced: Unsynced::default(),
            spare_buffers: Vec::new(),
            total_bytes: 0,
            direct: DirectState::default(),
            ahead,
            reads: RefCell::new(Reads::default()),
        }
    }

    // ----- getters -----

    /// The configuration the log was opened with.
    pub fn config(&self) -> &LogConfig {
        &self.config
    }

    /// Counters since open.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The backend's name (`io_uring`, `pwrite`, `fault`).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// An eventfd that becomes readable when `drive` has a completion to reap. Wrap it in
    /// tokio's `AsyncFd` on a current-thread runtime; clear readiness before calling `drive`.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.backend.wake_fd()
    }

    /// When `drive` must next be called even without a wake-up (the periodic fsync timer).
    /// `None` while a round is in flight: its completion (and its write's, which lets a
    /// second round start) wakes the caller through `wake_fd`, and a due sync starts right
    /// after it.
    pub fn next_deadline(&self) -> Option<Instant> {
        if !self.in_flight.is_empty() {
            return None;
        }
        if self.sync_requested || (self.mark_requested && self.mark_possible()) {
            return Some(Instant::now());
        }
        let mark = self.mark_due_at.filter(|_| self.mark_possible());
        match (self.sync_due_at, mark) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The active segment has synced records no durable commit mark covers, and a mark
    /// round could prove them now (a claim to make, and room for the mark and any zero fill;
    /// a full segment is closed before the next records, and closed segments need no mark).
    fn mark_possible(&self) -> bool {
        self.segments.back().is_some_and(|s| {
            let leftovers = s.scrub_until.saturating_sub(s.tail);
            s.mark_needed()
                && s.mark_claim().is_some()
                && s.tail + (MARK_BYTES as u64).max(leftovers) <= s.size
        })
    }

    /// How long an idle log waits before writing a commit mark (see [`MARK_DELAY`]).
    pub(crate) fn mark_delay(&self) -> Duration {
        match self.config.fsync {
            FsyncMode::OnCommit => MARK_DELAY,
            FsyncMode::Periodic { interval } => interval,
        }
    }

    /// Quarantined ranges of this log (see `quarantine.rs`).
    pub fn quarantine(&self) -> &Quarantine {
        &self.quarantine
    }

    /// Shards released because their streams were deleted.
    pub fn released(&self) -> &Released {
        &self.released
    }

    /// Gives the directory lock back (the log is closed), for an offline command that
    /// reopens the log without letting anyone in between.
    pub fn into_lock(self) -> DirLock {
        self.lock
    }

    /// The level at which records count as committed in this log's mode: `Synced` on
    /// on_commit, `Written` on periodic (docs/semantics.md, 3 Publishing). Reads return records
    /// up to it.
    pub fn commit_is_sync(&self) -> bool {
        self.config.fsync == FsyncMode::OnCommit
    }

    /// The offsets of `shard`, or `None` for a shard the log has never stored.
    pub fn shard_offsets(&self, shard: u32) -> Option<ShardOffsets> {
        self.shards.get(&shard).map(|s| ShardOffsets {
            oldest: s.oldest,
            written: s.written,
            synced: s.synced,
            next: s.next,
        })
    }

    /// Every shard the log knows, ascending.
    pub fn shard_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.shards.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The commit watermark of `shard`: offsets below it may be acked and delivered.
    pub fn committed_offset(&self, shard: u32) -> Option<u64> {
        self.shards.get(&shard).map(|s| self.commit_watermark(s))
    }

    fn commit_watermark(&self, s: &ShardState) -> u64 {
        if self.commit_is_sync() {
            s.synced
        } else {
            s.written
        }
    }

    /// The index entries of `shard`, oldest first (for tests and diagnostics).
    pub fn index_entries(&self, shard: u32) -> Vec<IndexEntry> {
        self.index
            .get(&shard)
            .map(|ix| ix.entries().copied().collect())
            .unwrap_or_default()
    }

    /// Sequence numbers of the segments on disk, oldest first.
    pub fn segment_seqs(&self) -> Vec<u64> {
        self.segments.iter().map(|s| s.seq).collect()
    }

    /// The segment whose file is being made, or was made, ahead of its start (`ahead.rs`).
    pub fn segment_ahead(&self) -> Option<u64> {
        self.ahead.borrow().requested()
    }

    /// Total bytes of the segment files.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes appended and not yet submitted to the disk.
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// True when nothing is pending or in flight.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.in_flight.is_empty()
    }

    /// The fatal error the log failed with, if it did.
    pub fn failure(&self) -> Option<&StorageError> {
        self.failed.as_ref()
    }

    fn check_failed(&self) -> Result<(), StorageError> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: StorageError) -> StorageError {
        tracing::error!(error = %crate::ErrorChain(&e), dir = %self.config.dir.display(), "durable log failed");
        self.failed = Some(e.clone());
        e
    }

    // ----- input -----

    /// Whether the pending bound (`LogConfig::max_pending_bytes`) has room for a frame of
    /// `frame_bytes` (see [`frame::frame_len`]): always when nothing is pending, so a single
    /// record larger than the whole bound is still taken by an empty log. The caller holds
    /// back what does not fit and appends it once a round was submitted ([`Self::drive`]
    /// after the log's wake-up), so a slow disk makes appends wait instead of failing; an
    /// append past the bound is refused with `PendingFull`.
    #[must_use]
    pub fn has_room(&self, frame_bytes: usize) -> bool {
        self.pending_bytes == 0
            || self.pending_bytes.saturating_add(frame_bytes) <= self.config.max_pending_bytes
    }

    /// [`Self::has_room`] for a record of `key_bytes` and `payload_bytes`.
    #[must_use]
    pub fn can_append(&self, key_bytes: usize, payload_bytes: usize) -> bool {
        self.has_room(frame::frame_len(key_bytes, payload_bytes))
    }

    /// Encodes a record into the pending round. `offset` must be the shard's next offset
    /// (dense); a shard the log has never stored may start at any offset below `u64::MAX`.
    /// Never does IO.
    pub fn append(
        &mut self,
        shard: u32,
        offset: u64,
        timestamp_us: u64,
        key: &[u8],
        payload: &[u8],
    ) -> Result<(), StorageError> {
        self.check_failed()?;
        frame::check_sizes(key.len(), payload.len())?;
        let frame_bytes = frame::frame_len(key.len(), payload.len());
        if !self.has_room(frame_bytes) {
            return Err(StorageError::PendingFull {
                pending_bytes: self.pending_bytes,
                max_pending_bytes: self.config.max_pending_bytes,
            });
        }
        if let Some(s) = self.shards.get(&shard) {
            if s.next != offset {
                return Err(StorageError::OffsetNotNext {
                    shard,
                    expected: s.next,
                    got: offset,
                });
            }
        } else if offset == u64::MAX {
            return Err(StorageError::OffsetNotNext {
                shard,
                expected: 0,
                got: offset,
            });
        }
        let max_round = self.config.max_round_bytes;
        let need_new_round = self
            .pending
            .back()
            .is_none_or(|r| !r.buf.is_empty() && r.buf.len() + frame_bytes > max_round);
        if need_new_round {
            let id = self.next_round_id;
            self.next_round_id += 1;
            let mut buf = self.spare_buffers.pop().unwrap_or_default();
            buf.clear();
            self.pending.push_back(PendingRound {
                id,
                buf,
                meta: RoundMeta::default(),
            });
        }
        let Some(round) = self.pending.back_mut() else {
            unreachable!("a pending round was pushed above when none existed");
        };
        let state = self.shards.entry(shard).or_insert_with(|| ShardState {
            anchored: false,
            ..ShardState::anchored_at(offset)
        });
        // Room for the frame and the commit mark that may close the round: the mark then never
        // makes the round's buffer grow (a reallocation copies the whole round).
        round.buf.reserve(frame_bytes + frame::MARK_BYTES);
        frame::encode(&mut round.buf, shard, offset, timestamp_us, key, payload);
        let meta = &mut round.meta;
        meta.records += 1;
        meta.body_bytes += frame::body_len(key.len(), payload.len()) as u64;
        meta.key_bytes += key.len() as u64;
        meta.payload_bytes += payload.len() as u64;
        if state.open_round == round.id {
            let range = &mut meta.ranges[state.open_range];
            assert_eq!(range.end, offset, "ranges are contiguous within a round");
            range.end += 1;
        } else {
            state.open_round = round.id;
            state.open_range = meta.ranges.len();
            meta.ranges.push(ShardRange {
                shard,
                first: offset,
                end: offset + 1,
            });
        }
        state.next = offset + 1;
        self.pending_bytes += frame_bytes;
        Ok(())
    }

    /// Asks for an fdatasync as soon as possible (periodic mode: e.g. at shutdown), and,
    /// once everything is synced, for a commit mark covering it without waiting for
    /// [`MARK_DELAY`] (so the next recovery can tell damage in these records from a torn
    /// write). A clean shutdown calls it before its `flush`.
    pub fn sync_now(&mut self) {
        self.sync_requested = true;
        self.mark_requested = true;
    }

    /// Reaps finished rounds, if any, and starts the next ones: a round when none is in
    /// flight, a second records round when one is in flight and its write finished
    /// (`LogConfig::rounds_in_flight`). Never blocks. A returned error is fatal (`SyncFailed`, `WriteFailed`, IO on segment
    /// creation); disk-full rejections arrive as [`LogEvent::Rejected`] instead.
    pub fn drive(&mut self, now: Instant) -> Result<(), StorageError> {
        self.check_failed()?;
        self.reap_all(now)?;
        self.start_rounds(now)
    }

    /// The second half of [`Log::drive`]: starts the rounds that may start, without reaping
    /// (a round finished but not reaped still counts in flight). For an owner that reaps only
    /// when the wake fd says a round finished ([`Log::reap`]). Never blocks.
    pub fn start_rounds(&mut self, now: Instant) -> Result<(), StorageError> {
        self.check_failed()?;
        // Bounded: each pass submits a round or stops.
        for _ in 0..ROUNDS_IN_FLIGHT_MAX {
            let before = self.in_flight.len();
            self.start_round(now).map_err(|e| self.fail(e))?;
            if self.in_flight.len() == before {
                break;
            }
        }
        self.ask_ahead();
        Ok(())
    }

    /// Reaps finished rounds, if any, without starting new ones: for an owner that starts
    /// rounds only for some of its appends (a shared Raft log, `felix_cluster::raft_log`,
    /// leaves a commit index for the next write rather than paying a round for it). Never
    /// blocks; errors as [`Log::drive`]. Returns how many rounds it reaped; with no round
    /// in flight it asks the backend nothing (no system call).
    pub fn reap(&mut self, now: Instant) -> Result<usize, StorageError> {
        self.check_failed()?;
        if self.in_flight.is_empty() {
            return Ok(0);
        }
        self.reap_all(now)
    }

    /// Reaps what the backend has finished (rounds, and whatever else its completions carry).
    fn reap_all(&mut self, now: Instant) -> Result<usize, StorageError> {
        let mut reaped = 0;
        for _ in 0..DRIVE_REAPS_MAX {
            match self.backend.poll_completion() {
                Ok(Some(c)) => {
                    self.complete(c, now)?;
                    reaped += 1;
                }
                Ok(None) => break,
                Err(e) => return Err(self.fail(e)),
            }
        }
        Ok(reaped)
    }

    /// Once the active segment is half full, asks for the next one's file to be made ahead
    /// (`ahead.rs`), so the roll does not preallocate on this thread. Half a segment leaves
    /// the helper far more time than the few ms it needs, and a segment's worth of disk is
    /// taken early only for the second half of the active one's life.
    fn ask_ahead(&mut self) {
        let ahead = self.ahead.get_mut();
        ahead.poll();
        self.counters.sidecars_written += ahead.sidecars_written();
        if let Some(active) = self.segments.back()
            && (active.tail - active.data_start) * 2 >= active.size - active.data_start
        {
            ahead.request(active.seq + 1, self.config.segment_bytes);
        }
    }

    /// Next event of a completed round, in completion order.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<LogEvent> {
        self.events.pop_front()
    }

    /// Blocks the calling thread until everything appended is written (and synced when the
    /// mode is on_commit or `sync_now` was called), or `timeout` passes. For shutdown and
    /// tests; an event loop uses `drive` instead. Events stay queued for `poll_event`.
    /// After `sync_now`, it also waits for the commit mark covering everything synced.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), StorageError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.drive(Instant::now())?;
            let sync_wanted = self.sync_requested && self.unsynced.records > 0;
            let mark_wanted =
                self.mark_requested && self.unsynced.records == 0 && self.mark_possible();
            if self.is_idle() && !sync_wanted && !mark_wanted {
                self.mark_requested = false;
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StorageError::io(
                    "flush",
                    std::io::Error::from(std::io::ErrorKind::TimedOut),
                ));
            }
            if !self.in_flight.is_empty() {
                self.backend.before_wait();
                wait_readable(self.backend.wake_fd(), deadline - now)?;
            }
        }
    }

    // ----- rounds -----

    fn start_round(&mut self, now: Instant) -> Result<(), StorageError> {
        if !self.in_flight.is_empty() {
            return self.start_overlapped_round(now);
        }
        let periodic_sync_due = self.sync_requested || self.sync_due_at.is_some_and(|t| now >= t);
        if self.segments.is_empty() {
            // A fresh log: its first segment is made for its first records.
            let Some(front) = self.pending.front() else {
                // Nothing was ever written, so there is nothing to sync.
                self.sync_requested = false;
                return Ok(());
            };
            let record_bytes = front.buf.len() as u64;
            if !self.roll_or_reject(record_bytes)? {
                return Ok(());
            }
        }
        let Some(active) = self.segments.back() else {
            unreachable!("a segment exists from here on; retention keeps the active one");
        };
        if let Some(front) = self.pending.front() {
            let record_bytes = front.buf.len() as u64;
            let leftovers = active.scrub_until.saturating_sub(active.tail);
            let mark_bytes = if active.mark_claim().is_some() {
                MARK_BYTES as u64
            } else {
                0
            };
            let attempted = (record_bytes + mark_bytes).max(leftovers);
            if active.tail + attempted > active.size {
                if active.unsynced || leftovers > 0 {
                    // Before the log moves on, the old segment must end in zeros and be synced:
                    // recovery trusts a non-last segment up to its first zero header.
                    let buf = vec![0u8; leftovers as usize];
                    let base = active.tail;
                    return self.submit(RoundKind::PreRoll, buf, base, 0, None, true);
                }
                if !self.roll_or_reject(record_bytes)? {
                    return Ok(());
                }
            }
            let Some(round) = self.pending.pop_front() else {
                unreachable!("front() was Some above");
            };
            self.pending_bytes -= round.buf.len();
            let sync = match self.config.fsync {
                FsyncMode::OnCommit => true,
                FsyncMode::Periodic { .. } => periodic_sync_due,
            };
            let mut buf = round.buf;
            let Some(active) = self.segments.back() else {
                unreachable!("at least one segment");
            };
            // After a roll the new segment has nothing synced, so no mark.
            let mark = active.mark_claim();
            if let Some(claim) = mark {
                frame::encode_mark(&mut buf, claim, now_unix_us());
            }
            let leftovers = active.scrub_until.saturating_sub(active.tail);
            if leftovers > buf.len() as u64 {
                buf.resize(leftovers as usize, 0);
            }
            let base = active.tail;
            return self.submit(
                RoundKind::Records(round.meta),
                buf,
                base,
                record_bytes,
                mark,
                sync,
            );
        }
        if self.unsynced.records > 0 && periodic_sync_due {
            let base = active.tail;
            return self.submit(RoundKind::SyncOnly, Vec::new(), base, 0, None, true);
        }
        if self.sync_requested && self.unsynced.records == 0 {
            self.sync_requested = false;
        }
        let mark_due = self.mark_requested || self.mark_due_at.is_some_and(|t| now >= t);
        if mark_due && self.mark_possible() {
            let leftovers = active.scrub_until.saturating_sub(active.tail);
            let Some(claim) = active.mark_claim() else {
                unreachable!("mark_possible checked it");
            };
            let mut buf = Vec::with_capacity(MARK_BYTES.max(leftovers as usize));
            frame::encode_mark(&mut buf, claim, now_unix_us());
            if leftovers > buf.len() as u64 {
                buf.resize(leftovers as usize, 0);
            }
            self.mark_requested = false;
            let base = active.tail;
            return self.submit(RoundKind::Mark, buf, base, 0, Some(claim), true);
        }
        if mark_due {
            // Nothing to prove, or no room: a full segment is closed before the next
            // records, and closed segments need no mark.
            self.mark_requested = false;
            self.mark_due_at = None;
        }
        Ok(())
    }

    /// A second records round while one is in flight (`LogConfig::rounds_in_flight`): only
    /// when the round in flight is a records round whose write finished (only its fdatasync
    /// runs, so the two writes never race on the tail block a direct round rewrites), the next
    /// pending round goes to the same segment right after it, with room and no leftovers of
    /// a failed write to cover. Pre-roll, sync-only and mark rounds, and segment rolls, wait
    /// until nothing is in flight.
    fn start_overlapped_round(&mut self, now: Instant) -> Result<(), StorageError> {
        let allowed = self.config.rounds_in_flight.min(ROUNDS_IN_FLIGHT_MAX);
        if self.in_flight.len() >= allowed {
            return Ok(());
        }
        let (Some(last), Some(front), Some(active)) = (
            self.in_flight.back(),
            self.pending.front(),
            self.segments.back(),
        ) else {
            return Ok(());
        };
        if last.doomed
            || !matches!(last.kind, RoundKind::Records(_))
            || last.segment != active.seq
            || !self.backend.writes_idle()
        {
            return Ok(());
        }
        let base = last.end();
        if active.scrub_until > base {
            return Ok(());
        }
        // The claim covers what completed fdatasyncs made durable (`synced_end` moves only
        // when a sync's completion is applied), so never the rounds in flight; and a claim a
        // round in flight already carries is not written twice.
        let mark = active
            .mark_claim()
            .filter(|claim| self.in_flight.iter().all(|f| f.mark < Some(*claim)));
        let record_bytes = front.buf.len() as u64;
        let mark_bytes = if mark.is_some() { MARK_BYTES as u64 } else { 0 };
        if base + record_bytes + mark_bytes > active.size {
            return Ok(());
        }
        let sync = match self.config.fsync {
            FsyncMode::OnCommit => true,
            FsyncMode::Periodic { .. } => {
                self.sync_requested || self.sync_due_at.is_some_and(|t| now >= t)
            }
        };
        let Some(round) = self.pending.pop_front() else {
            unreachable!("front() was Some above");
        };
        self.pending_bytes -= round.buf.len();
        let mut buf = round.buf;
        if let Some(claim) = mark {
            frame::encode_mark(&mut buf, claim, now_unix_us());
        }
        self.counters.overlapped_rounds += 1;
        self.submit(
            RoundKind::Records(round.meta),
            buf,
            base,
            record_bytes,
            mark,
            sync,
        )
    }

    /// Submits a round writing `buf` at `base` of the active segment: its tail, or the end
    /// of the round in flight before it.
    fn submit(
        &mut self,
        kind: RoundKind,
        buf: Vec<u8>,
        base: u64,
        record_bytes: u64,
        mark: Option<u64>,
        sync: bool,
    ) -> Result<(), StorageError> {
        assert!(
            self.in_flight.len() < ROUNDS_IN_FLIGHT_MAX,
            "at most ROUNDS_IN_FLIGHT_MAX rounds in flight"
        );
        let Some(active) = self.segments.back() else {
            unreachable!("at least one segment");
        };
        let expected_base = self.in_flight.back().map_or(active.tail, InFlight::end);
        assert_eq!(
            base, expected_base,
            "a round starts where the previous one ends"
        );
        assert!(
            base + buf.len() as u64 <= active.size,
            "round fits the segment"
        );
        let id = self.next_round_id;
        self.next_round_id += 1;
        let attempted_bytes = buf.len() as u64;
        let mark_bytes = if mark.is_some() { MARK_BYTES as u64 } else { 0 };
        let direct = if self.buffered_for_latency(buf.len()) {
            None
        } else {
            self.stage_direct(&buf, base, base + record_bytes + mark_bytes)
        };
        if direct.is_none() && !buf.is_empty() {
            // Written buffered: the kept block is not what this round leaves.
            self.direct.tail_block = None;
        }
        let Some(active) = self.segments.back() else {
            unreachable!("at least one segment");
        };
        // A direct round nothing else waits behind (a lone publish, a mark) is made durable
        // by its write (RWF_DSYNC) where the backend can: nothing would overlap it anyway, and
        // it skips the fdatasync's trip through a kernel worker (~30 us of a ~80-150 us round
        // here, docs/design/durable.md). Only on_commit: there every round syncs, so no
        // buffered bytes of an earlier round wait for this one's sync (a ranged RWF_DSYNC
        // would not write them back).
        let sync_by_write = sync
            && direct.is_some()
            && self.pending.is_empty()
            && self.config.fsync == FsyncMode::OnCommit;
        if sync_by_write {
            self.counters.sync_by_write_rounds += 1;
        }
        let request = RoundRequest {
            id,
            segment: active.seq,
            file: Arc::clone(&active.file),
            file_pos: base,
            buf,
            sync,
            direct,
            sync_by_write,
        };
        self.in_flight.push_back(InFlight {
            id,
            kind,
            segment: active.seq,
            base,
            record_bytes,
            mark,
            attempted_bytes,
            sync,
            doomed: false,
        });
        self.backend.submit(request)
    }

    /// Whether a round of `bytes` goes through the page cache even with direct IO on: a small
    /// round of a periodic log. Its records are acked once written, and a buffered write is
    /// a page-cache copy (a few us) where a direct one waits for the device (~100-200 us
    /// here): a lone periodic publish's ack p50 went from 124 to 305 us with every round
    /// direct (docs/performance.md). The copy is what O_DIRECT saves, and it matters for
    /// throughput, where rounds are large; they stay direct. on_commit logs keep every round
    /// direct: their ack waits for the device either way, and a direct round's fdatasync is
    /// the cheaper one (`ZERO_AHEAD_BYTES`).
    fn buffered_for_latency(&self, bytes: usize) -> bool {
        matches!(self.config.fsync, FsyncMode::Periodic { .. }) && bytes < BUFFERED_ROUND_MAX
    }

    /// Stages `buf` (bound for `tail` of the active segment, leaving the segment's tail at
    /// `end`) for a direct write: whole blocks from the one holding `tail`, that block's
    /// bytes before `tail` first, zeros after `buf` (see `direct.rs`); keeps the block
    /// holding `end` for the next round, which may be staged before this one completes.
    /// `None` writes the round buffered: direct IO off or refused here, an empty round, a
    /// segment whose size is not whole blocks, or the tail block unreadable.
    fn stage_direct(&mut self, buf: &[u8], tail: u64, end: u64) -> Option<DirectWrite> {
        if !self.config.direct_io || self.direct.unsupported || buf.is_empty() {
            return None;
        }
        let active = self.segments.back()?;
        let seq = active.seq;
        let start = direct::align_down(tail);
        let prefix = (tail - start) as usize;
        let mut len = (prefix + buf.len()).next_multiple_of(DIRECT_ALIGN);
        if !active.size.is_multiple_of(DIRECT_ALIGN as u64) || start + len as u64 > active.size {
            return None;
        }
        let written_until = match self.direct.written_until {
            Some((s, end)) if s == seq => end,
            _ => 0,
        };
        if len < ZERO_AHEAD_ROUND_MAX && start + len as u64 > written_until {
            let room = usize::try_from(active.size - start).unwrap_or(usize::MAX);
            len = (len + ZERO_AHEAD_BYTES).min(room);
        }
        let file = match &self.direct.file {
            Some((s, f)) if *s == seq => Arc::clone(f),
            _ => match direct::open(&active.path) {
                Ok(f) => {
                    let f = Arc::new(f);
                    self.direct.file = Some((seq, Arc::clone(&f)));
                    f
                }
                Err(e) => {
                    tracing::warn!(path = %active.path.display(), error = %e, "O_DIRECT refused here; the log writes through the page cache");
                    self.direct.unsupported = true;
                    self.direct.file = None;
                    return None;
                }
            },
        };
        let mut staged = self.direct.spare.pop().unwrap_or_default();
        staged.set_len(len);
        let out = staged.as_mut_slice();
        if prefix > 0 {
            match &self.direct.tail_block {
                Some((s, t, bytes)) if *s == seq && *t == tail => {
                    out[..prefix].copy_from_slice(bytes)
                }
                _ => {
                    self.counters.direct_tail_reads += 1;
                    if let Err(e) = active.file.read_exact_at(&mut out[..prefix], start) {
                        tracing::warn!(seq, error = %e, "cannot read the tail block back; this round is written buffered");
                        self.direct.spare.push(staged);
                        return None;
                    }
                }
            }
        }
        out[prefix..prefix + buf.len()].copy_from_slice(buf);
        out[prefix + buf.len()..].fill(0);
        self.counters.direct_rounds += 1;
        self.counters.direct_padding_bytes += (len - prefix - buf.len()) as u64;
        let staged_end = start + len as u64;
        self.direct.written_until = match self.direct.written_until {
            Some((s, until)) if s == seq => Some((s, until.max(staged_end))),
            _ => Some((seq, staged_end)),
        };
        // The block holding `end`, for the next round's prefix (`end` lies within the staged
        // blocks: they reach at least to the end of `buf`, past `end`).
        let block = direct::align_down(end);
        let mut kept = self
            .direct
            .tail_block
            .take()
            .map(|(_, _, bytes)| bytes)
            .unwrap_or_default();
        kept.clear();
        kept.extend_from_slice(
            &staged.as_slice()[(block - start) as usize..(end - start) as usize],
        );
        self.direct.tail_block = Some((seq, end, kept));
        Some(DirectWrite {
            file,
            pos: start,
            buf: staged,
        })
    }

    /// After a round's completion: keeps the staged buffer for reuse. A failed round (or one
    /// rejected with the round before it) drops the kept tail block and what the log knows
    /// it wrote: the file may hold part of the round, and the next round, placed at the
    /// completed tail, reads its prefix back.
    fn finish_direct(&mut self, c: &mut RoundCompletion, failed: bool) {
        if failed {
            self.direct.tail_block = None;
            self.direct.written_until = None;
        }
        if let Some(staged) = c.direct.take()
            && self.direct.spare.len() < SPARE_BUFFERS_MAX
        {
            self.direct.spare.push(staged);
        }
    }

    /// [`Self::roll`]; on ENOSPC rejects the pending round instead (the same policy as ENOSPC
    /// on a write) and returns false.
    fn roll_or_reject(&mut self, record_bytes: u64) -> Result<bool, StorageError> {
        match self.roll(record_bytes) {
            Ok(()) => Ok(true),
            Err(StorageError::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOSPC) => {
                self.reject(Vec::new(), StorageError::DiskFull);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Creates the log's first segment if it has none yet (a durable shard arrived on this
    /// log, so it will be written). A log with segments is left as it is. An error leaves
    /// the log usable: the first append tries again (and is rejected with
    /// [`StorageError::DiskFull`] if there is still no room).
    pub fn ensure_segment(&mut self) -> Result<(), StorageError> {
        self.check_failed()?;
        if self.segments.is_empty() {
            self.roll(0)?;
        }
        Ok(())
    }

    /// Whether the log has made a segment (a fresh log has none until its first records).
    pub fn has_segments(&self) -> bool {
        !self.segments.is_empty()
    }

    /// Starts a new segment after the active one (or the first one of a fresh log), its
    /// header holding each anchored shard's next offset.
    fn roll(&mut self, record_bytes: u64) -> Result<(), StorageError> {
        let seq = self
            .segments
            .back()
            .map_or(self.first_seq, |active| active.seq + 1);
        let mut checkpoint: Vec<(u32, u64)> = self
            .shards
            .iter()
            .filter(|(_, s)| s.anchored)
            .map(|(id, s)| (*id, s.written))
            .collect();
        checkpoint.sort_unstable();
        let header_bytes = segment::header_bytes_for(checkpoint.len());
        let size = self
            .config
            .segment_bytes
            .max(segment::align_up(header_bytes + record_bytes));
        let created = now_unix_us();
        if let Some(closing) = self.segments.back() {
            // The closing segment is synced (the pre-roll round) and never written again:
            // its sidecar lets the next recovery skip scanning it. Written by the helper
            // thread (`ahead.rs`). Not fatal: without it, recovery scans the segment and
            // writes one.
            let sidecar = self.sidecar_of(closing);
            self.ahead.get_mut().write_sidecar(sidecar);
        }
        // The new segment's file is usually made already (`ahead.rs`): only the header, an
        // fsync, the rename and the directory's fsync happen here.
        let started = Instant::now();
        let ahead = self.ahead.get_mut();
        let blank = ahead.take(seq);
        self.counters.sidecars_written += ahead.sidecars_written();
        let (file, header_bytes, path) = match blank {
            Some(blank) => {
                self.counters.segments_made_ahead += 1;
                segment::finish_blank(&self.config.dir, blank, seq, size, created, &checkpoint)?
            }
            None => segment::create(&self.config.dir, seq, size, created, &checkpoint)?,
        };
        self.counters
            .segment_start_latency
            .record(started.elapsed());
        tracing::debug!(seq, size, shards = checkpoint.len(), "log segment created");
        let header_crc = segment::read_header(&file, size)
            .map(|h| h.crc)
            .map_err(|why| {
                StorageError::io(
                    format!("re-read the header of new segment {seq}"),
                    std::io::Error::other(why),
                )
            })?;
        self.push_segment(seq, file, path, size, header_bytes, header_crc, created);
        self.counters.segments_created += 1;
        Ok(())
    }

    /// The sidecar of a segment from the log's own state.
    pub(crate) fn sidecar_of(&self, seg: &Segment) -> Sidecar {
        let mut entries = Vec::new();
        let shards = seg
            .stats
            .iter()
            .map(|(shard, s)| {
                if let Some(ix) = self.index.get(shard) {
                    entries.extend(
                        ix.entries_in_segment(seg.seq)
                            .map(|e| (*shard, e.offset, e.position)),
                    );
                }
                SidecarShard {
                    shard: *shard,
                    first: s.first,
                    end: s.end,
                    records: s.records,
                }
            })
            .collect();
        Sidecar {
            seq: seg.seq,
            header_crc: seg.header_crc,
            index_interval_bytes: self.config.index_interval_bytes,
            data_end: seg.tail,
            records: seg.records,
            record_bytes: seg.record_bytes,
            max_timestamp_us: seg.max_timestamp_us,
            shards,
            entries,
        }
    }

    /// Adds an empty segment whose frames start at `data_start` (its header's size).
    #[allow(clippy::too_many_arguments)] // one call per field of a new segment, two callers
    pub(crate) fn push_segment(
        &mut self,
        seq: u64,
        file: File,
        path: PathBuf,
        size: u64,
        data_start: u64,
        header_crc: u32,
        created_unix_us: u64,
    ) {
        if let Some(last) = self.segments.back() {
            assert_eq!(last.seq + 1, seq, "segment sequence is contiguous");
        }
        self.total_bytes += size;
        self.segments.push_back(Segment {
            seq,
            file: Arc::new(file),
            path,
            size,
            data_start,
            header_crc,
            tail: data_start,
            records_end: data_start,
            synced_end: data_start,
            synced_records_end: data_start,
            mark_claim_written: 0,
            mark_claim_durable: 0,
            stats: BTreeMap::new(),
            records: 0,
            record_bytes: 0,
            released_records: 0,
            scrub_until: 0,
            max_timestamp_us: None,
            created_unix_us,
            unsynced: false,
        });
    }

    pub(crate) fn segment_index(&self, seq: u64) -> Option<usize> {
        let first = self.segments.front()?.seq;
        let at = usize::try_from(seq.checked_sub(first)?).ok()?;
        (at < self.segments.len()).then_some(at)
    }

    /// Takes a completion from the backend and applies every completion it lets through, in
    /// round order: one for a later round than the oldest in flight waits for the older
    /// one's.
    fn complete(&mut self, c: RoundCompletion, now: Instant) -> Result<(), StorageError> {
        if !self.in_flight.iter().any(|f| f.id == c.id) {
            return Err(self.fail(StorageError::io(
                "completion",
                std::io::Error::other(format!("completion of round {} not in flight", c.id)),
            )));
        }
        if self.in_flight.front().is_some_and(|f| f.id != c.id) {
            self.counters.held_completions += 1;
        }
        self.arrived.push(c);
        // Bounded by the rounds in flight: each pass applies one.
        while let Some(oldest) = self.in_flight.front().map(|f| f.id) {
            let Some(at) = self.arrived.iter().position(|c| c.id == oldest) else {
                break;
            };
            let c = self.arrived.swap_remove(at);
            let Some(inf) = self.in_flight.pop_front() else {
                unreachable!("front() was Some above");
            };
            self.apply_completion(inf, c, now)?;
        }
        Ok(())
    }

    /// Applies the completion of the oldest round in flight.
    fn apply_completion(
        &mut self,
        inf: InFlight,
        mut c: RoundCompletion,
        now: Instant,
    ) -> Result<(), StorageError> {
        let Some(seg_at) = self.segment_index(inf.segment) else {
            unreachable!("retention never deletes the segment a round is in");
        };
        let mark_bytes = if inf.mark.is_some() {
            MARK_BYTES as u64
        } else {
            0
        };
        let is_mark_round = matches!(inf.kind, RoundKind::Mark);
        if is_mark_round {
            self.counters.mark_rounds += 1;
        } else {
            self.counters.rounds += 1;
            self.counters.write_latency.record(c.write_latency);
        }
        match c.result {
            Ok(()) | Err(RoundFailure::Write(libc::ENOSPC)) if inf.doomed => {
                // Its records were rejected with the failed round before it; whatever it
                // wrote lies past that round's failed write and is zeroed over by the next
                // round (an fdatasync failure stays fatal, below).
                self.counters.doomed_rounds += 1;
                let seg = &mut self.segments[seg_at];
                seg.scrub_until = seg.scrub_until.max(inf.base + inf.attempted_bytes);
                self.finish_direct(&mut c, true);
                self.recycle(c.buf);
                return Ok(());
            }
            Ok(()) => {}
            Err(RoundFailure::Write(errno)) if errno == libc::ENOSPC => {
                self.counters.write_bytes += inf.attempted_bytes - mark_bytes;
                let seg = &mut self.segments[seg_at];
                seg.scrub_until = seg.scrub_until.max(inf.base + inf.attempted_bytes);
                let mut ranges = match inf.kind {
                    RoundKind::Records(meta) => meta.ranges,
                    RoundKind::PreRoll | RoundKind::SyncOnly | RoundKind::Mark => Vec::new(),
                };
                // A round in flight after it would leave its records past a hole: rejected
                // too, whatever its own result.
                for later in self.in_flight.iter_mut() {
                    later.doomed = true;
                    if let RoundKind::Records(meta) = &later.kind {
                        ranges.extend_from_slice(&meta.ranges);
                    }
                }
                self.reject(ranges, StorageError::DiskFull);
                self.finish_direct(&mut c, true);
                self.recycle(c.buf);
                return Ok(());
            }
            Err(RoundFailure::Write(errno)) => {
                return Err(self.fail(StorageError::WriteFailed {
                    segment: inf.segment,
                    errno,
                }));
            }
            Err(RoundFailure::Sync(errno)) => {
                return Err(self.fail(StorageError::SyncFailed {
                    segment: inf.segment,
                    errno,
                }));
            }
        }
        self.counters.write_bytes += inf.attempted_bytes - mark_bytes;
        self.counters.mark_bytes += mark_bytes;
        let seg_seq = inf.segment;
        {
            let seg = &mut self.segments[seg_at];
            assert_eq!(
                seg.tail, inf.base,
                "rounds complete in offset order, each where the previous one ended"
            );
            if inf.base + inf.attempted_bytes >= seg.scrub_until {
                seg.scrub_until = 0;
            }
        }
        if let RoundKind::Records(meta) = inf.kind {
            self.apply_written(
                seg_at,
                seg_seq,
                inf.base,
                &c.buf[..inf.record_bytes as usize],
                &meta,
            );
        }
        if let Some(claim) = inf.mark {
            let seg = &mut self.segments[seg_at];
            seg.tail = inf.base + inf.record_bytes + mark_bytes;
            seg.mark_claim_written = seg.mark_claim_written.max(claim);
            seg.unsynced = true;
        }
        if inf.sync {
            self.apply_synced(seg_at, c.sync_latency, is_mark_round, now);
        } else if self.unsynced.records > 0
            && let FsyncMode::Periodic { interval } = self.config.fsync
        {
            self.sync_due_at.get_or_insert(now + interval);
        }
        self.finish_direct(&mut c, false);
        self.recycle(c.buf);
        Ok(())
    }

    fn apply_written(
        &mut self,
        seg_at: usize,
        seg_seq: u64,
        base: u64,
        records: &[u8],
        meta: &RoundMeta,
    ) {
        let mut at = 0usize;
        let mut max_ts = None;
        while at < records.len() {
            let Some(h) = frame::decode_header(&records[at..]) else {
                unreachable!("the round buffer holds whole frames encoded by append");
            };
            let frame_bytes = HEADER_BYTES + h.body_len as usize;
            self.index.entry(h.shard).or_default().add(
                h.offset,
                seg_seq,
                base + at as u64,
                self.config.index_interval_bytes,
            );
            max_ts = max_ts.max(Some(h.timestamp_us));
            at += frame_bytes;
        }
        assert_eq!(at, records.len(), "frames tile the round");
        let seg = &mut self.segments[seg_at];
        seg.tail = base + records.len() as u64;
        seg.records_end = seg.tail;
        seg.record_bytes += records.len() as u64;
        seg.max_timestamp_us = seg.max_timestamp_us.max(max_ts);
        seg.unsynced = true;
        for r in &meta.ranges {
            seg.note_records(r.shard, r.first, r.end, r.len());
        }
        let c = &mut self.counters;
        c.records += meta.records;
        c.body_bytes += meta.body_bytes;
        c.key_bytes += meta.key_bytes;
        c.payload_bytes += meta.payload_bytes;
        c.append_bytes += records.len() as u64;
        debug_assert_eq!(
            records.len() as u64,
            meta.records * HEADER_BYTES as u64 + meta.body_bytes
        );
        self.unsynced.records += meta.records;
        self.unsynced.bytes += records.len() as u64;
        for r in &meta.ranges {
            let Some(s) = self.shards.get_mut(&r.shard) else {
                unreachable!("a shard with records in flight stays known");
            };
            assert_eq!(s.written, r.first, "writes complete in offset order");
            s.written = r.end;
            s.anchored = true;
            if !s.dirty {
                s.dirty = true;
                self.unsynced.shards.push(r.shard);
            }
        }
        self.events
            .push_back(LogEvent::Written(meta.ranges.clone()));
    }

    fn apply_synced(
        &mut self,
        seg_at: usize,
        latency: Option<std::time::Duration>,
        mark_round: bool,
        now: Instant,
    ) {
        // A mark round's fdatasync counts as one of the log's fsyncs only when it also made
        // written records durable (periodic mode); the fan-in counters stay about records.
        if !mark_round || self.unsynced.records > 0 {
            self.counters.fsyncs += 1;
            self.counters.fsync_records += self.unsynced.records;
            self.counters.fsync_bytes += self.unsynced.bytes;
            if let Some(l) = latency {
                self.counters.fsync_latency.record(l);
            }
        }
        let mut ranges = Vec::with_capacity(self.unsynced.shards.len());
        for shard in self.unsynced.shards.drain(..) {
            let Some(s) = self.shards.get_mut(&shard) else {
                continue;
            };
            if s.synced < s.written {
                ranges.push(ShardRange {
                    shard,
                    first: s.synced,
                    end: s.written,
                });
            }
            s.synced = s.written;
            s.dirty = false;
        }
        let seg = &mut self.segments[seg_at];
        seg.unsynced = false;
        seg.synced_end = seg.tail;
        seg.synced_records_end = seg.records_end;
        seg.mark_claim_durable = seg.mark_claim_written;
        let mark_needed = seg.mark_needed();
        self.mark_due_at = mark_needed.then(|| now + self.mark_delay());
        self.unsynced.records = 0;
        self.unsynced.bytes = 0;
        self.sync_due_at = None;
        // A `sync_now` made while this round was in flight may cover records appended after
        // it was submitted (still pending, or in a round in flight without an fdatasync):
        // the request stands until a later fdatasync covers those too.
        let uncovered = !self.pending.is_empty() || self.in_flight.iter().any(|round| !round.sync);
        self.sync_requested &= uncovered;
        if !ranges.is_empty() {
            self.events.push_back(LogEvent::Synced(ranges));
        }
    }

    /// Drops the failed rounds' records (`failed`: the failed round's and those of rounds
    /// in flight after it) and every pending round; shards go back to their written offset
    /// (the first rejected one: completions apply in order, so nothing after it is written).
    fn reject(&mut self, failed: Vec<ShardRange>, error: StorageError) {
        let mut ranges = failed;
        let rounds: Vec<PendingRound> = self.pending.drain(..).collect();
        for round in rounds {
            ranges.extend_from_slice(&round.meta.ranges);
            self.recycle(round.buf);
        }
        self.pending_bytes = 0;
        for r in &ranges {
            self.counters.rejected_records += r.len();
            if let Some(s) = self.shards.get_mut(&r.shard) {
                s.next = s.written;
                s.open_round = 0;
            }
        }
        self.shards.retain(|_, s| s.anchored);
        tracing::warn!(records = ranges.iter().map(ShardRange::len).sum::<u64>(), error = %crate::ErrorChain(&error), "log appends rejected");
        if !ranges.is_empty() {
            self.events.push_back(LogEvent::Rejected { ranges, error });
        }
    }

    /// Keeps a finished round's buffer for the next rounds, the largest last (`pop` takes it):
    /// a mark round's small buffer must not be the one the next records round grows from.
    fn recycle(&mut self, mut buf: Vec<u8>) {
        buf.clear();
        self.spare_buffers.push(buf);
        self.spare_buffers.sort_unstable_by_key(Vec::capacity);
        if self.spare_buffers.len() > SPARE_BUFFERS_MAX {
            self.spare_buffers.remove(0);
        }
    }

    // ----- reads -----

    /// Reads committed records of `shard` from offset `from`, in order: at most
    /// `max_records`, and at most `max_bytes` of key + payload (but always at least one
    /// record when one is available). Committed means synced on on_commit and written on
    /// periodic (see [`Log::committed_offset`]). Quarantined offsets (`quarantine.rs`) are
    /// skipped: the records returned then jump over them, and the skipped offsets are counted
    /// in `Counters::quarantine_skipped_records`. Each record's CRC is checked; a bad
    /// committed record is `Corrupt`, which is fatal (and removes the segment's sidecar, so
    /// the next recovery scans the segment and names the damage).
    ///
    /// Blocks: preads on the calling thread. For tests, tools and shutdown; the core's event
    /// loop uses [`Log::try_read`].
    pub fn read(
        &self,
        shard: u32,
        from: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<Record>, StorageError> {
        let mut pread = |seg: &Segment, pos: u64, len: usize, _need: usize| {
            let mut raw = vec![0u8; len];
            seg.file
                .read_exact_at(&mut raw, pos)
                .map_err(|e| StorageError::io(format!("read segment {}", seg.seq), e))?;
            Ok(Some(Bytes::from(raw)))
        };
        match self.read_checked(shard, from, max_records, max_bytes, None, &mut pread)? {
            Walk::Done(records) => Ok(records),
            Walk::Missed(_) => unreachable!("a blocking pread never misses"),
        }
    }

    /// [`Log::read`] without blocking on the disk: the bytes come from the page cache, read
    /// with `preadv2(RWF_NOWAIT)`, or from chunks fetched earlier; a chunk in neither is
    /// handed to the log's reader thread and the read answers [`ReadOutcome::Pending`] (or
    /// the records gathered before it). The reader thread wakes the caller through
    /// [`Log::wake_fd`]; then [`Log::poll_reads`] takes the chunk in and the read is asked
    /// again with its `resume` point. A chunk kept for a retry is dropped after a few later
    /// fetches (`reader.rs`), so retry soon after `poll_reads`. Counted in
    /// `Counters::read_cache_hits` and `Counters::read_fetches`.
    pub fn try_read(
        &self,
        shard: u32,
        from: u64,
        max_records: usize,
        max_bytes: usize,
        resume: Option<ReadResume>,
    ) -> Result<ReadOutcome, StorageError> {
        let mut reads = self.reads.borrow_mut();
        let held = self.backend.held_reads();
        let hits = &self.counters.read_cache_hits;
        let wake = || crate::backend::EventFd::duplicate(self.backend.wake_fd());
        let mut chunk = |seg: &Segment, pos: u64, len: usize, need: usize| match reads.chunk(
            held.as_ref(),
            seg.seq,
            &seg.file,
            pos,
            len,
            need,
            wake,
        )? {
            Chunk::Ready(bytes) => {
                hits.set(hits.get() + 1);
                Ok(Some(bytes))
            }
            Chunk::Pending => Ok(None),
        };
        let walk = self.read_checked(shard, from, max_records, max_bytes, resume, &mut chunk)?;
        Ok(match walk {
            Walk::Done(records) => ReadOutcome::Records(records),
            Walk::Missed(resume) => ReadOutcome::Pending(resume),
        })
    }

    /// Takes the chunks the reader thread fetched (after the caller cleared the wake-up, like
    /// `drive`); returns how many arrived: reads that answered `Pending` may complete now.
    /// Never blocks.
    pub fn poll_reads(&self) -> usize {
        let arrived = self
            .reads
            .borrow_mut()
            .poll(self.backend.held_reads().as_ref());
        let fetches = &self.counters.read_fetches;
        fetches.set(fetches.get() + arrived as u64);
        arrived
    }

    /// Fetches handed to the reader thread and not taken in by [`Log::poll_reads`] yet.
    #[must_use]
    pub fn reads_outstanding(&self) -> usize {
        self.reads.borrow().outstanding()
    }

    /// Test hook: every look at the page cache misses, so every chunk not kept from an
    /// earlier fetch goes through the reader thread (or the fault backend's held fetches).
    #[doc(hidden)]
    pub fn force_read_misses(&self, on: bool) {
        self.reads.borrow_mut().set_force_misses(on);
    }

    /// The walk and its bookkeeping: quarantine skips counted when the read completes (not
    /// while it waits), the sidecar removed on `Corrupt`.
    fn read_checked(
        &self,
        shard: u32,
        from: u64,
        max_records: usize,
        max_bytes: usize,
        resume: Option<ReadResume>,
        chunk: &mut ChunkSource<'_>,
    ) -> Result<Walk, StorageError> {
        let resume = resume.filter(|r| {
            r.shard == shard && r.from == from && self.segment_index(r.segment).is_some()
        });
        let skipped = Cell::new(resume.as_ref().map_or(0, |r| r.skipped));
        let result = self.read_inner(shard, from, max_records, max_bytes, resume, &skipped, chunk);
        if !matches!(result, Ok(Walk::Missed(_))) {
            let counted = &self.counters.quarantine_skipped_records;
            counted.set(counted.get() + skipped.get());
        }
        if let Err(StorageError::Corrupt { segment, .. }) = &result
            && self
                .segments
                .back()
                .is_some_and(|active| active.seq != *segment)
        {
            // A sidecar the helper may still write for it must not land after the removal.
            self.ahead.borrow_mut().settle();
            sidecar::remove(&self.config.dir, *segment);
        }
        result
    }

    /// The walk of a read: from the index entry at or before `from` (or from `resume`),
    /// chunk by chunk. `chunk(segment, pos, len, need)` gives bytes from `pos`: up to `len`,
    /// at least `need` (0: any), or `None` when they are not in memory yet. `skipped` counts
    /// the quarantined offsets passed (the walk's, from `resume`, plus the start's).
    #[allow(clippy::too_many_arguments)]
    fn read_inner(
        &self,
        shard: u32,
        from: u64,
        max_records: usize,
        max_bytes: usize,
        resume: Option<ReadResume>,
        skipped: &Cell<u64>,
        chunk: &mut ChunkSource<'_>,
    ) -> Result<Walk, StorageError> {
        self.check_failed()?;
        let Some(state) = self.shards.get(&shard) else {
            return Ok(Walk::Done(Vec::new()));
        };
        if from < state.oldest {
            return Err(StorageError::OffsetTooOld {
                shard,
                requested: from,
                oldest: state.oldest,
            });
        }
        let asked = from;
        let from = self.quarantine.skip(shard, asked);
        let skipped_at_start = from - asked;
        skipped.set(skipped.get() + skipped_at_start);
        // Moves past the quarantined offsets at `next`, counting those at or after `asked`.
        let skip = |next: u64| {
            let to = self.quarantine.skip(shard, next);
            if to > next {
                skipped.set(skipped.get() + to.saturating_sub(next.max(asked)));
            }
            to
        };
        let end = self.commit_watermark(state);
        let mut out = Vec::new();
        if from >= end || max_records == 0 {
            return Ok(Walk::Done(out));
        }
        let corrupt = |segment: u64, position: u64, reason: String| StorageError::Corrupt {
            segment,
            position,
            reason,
        };
        let ix = self
            .index
            .get(&shard)
            .ok_or_else(|| corrupt(0, 0, format!("shard {shard} has records but no index")))?;
        let interval = self.config.index_interval_bytes;
        let (mut expect, mut seg_seq, mut pos, mut last_hit, mut min_read) = match &resume {
            Some(r) => (r.expect, r.segment, r.pos, r.last_hit, r.min_read),
            None => {
                let entry = ix.seek(from).ok_or_else(|| {
                    corrupt(
                        0,
                        0,
                        format!("shard {shard}: no index entry at or before {from}"),
                    )
                })?;
                // Position of the shard's last record seen (or of the entry jumped to).
                (
                    entry.offset,
                    entry.segment,
                    entry.position,
                    entry.position,
                    0,
                )
            }
        };
        let mut bytes = 0usize;
        // Bounded: every pass consumes at least one frame, jumps forward to an index entry,
        // or returns; a jump never goes backwards (checked).
        loop {
            let seg_at = self
                .segment_index(seg_seq)
                .ok_or_else(|| corrupt(seg_seq, pos, "index points at a deleted segment".into()))?;
            let seg = &self.segments[seg_at];
            if pos >= seg.tail || pos - last_hit > interval {
                // The shard's next record is not within `interval` of its last one, so the
                // index has an entry for it (see `ShardIndex`); at a segment's end, the next
                // segment's first entry.
                let next = if pos >= seg.tail {
                    ix.first_in_segment_after(seg_seq)
                } else {
                    ix.seek(expect)
                };
                let Some(next) = next else {
                    if pos >= seg.tail {
                        return Ok(Walk::Done(out));
                    }
                    return Err(corrupt(
                        seg_seq,
                        pos,
                        format!("shard {shard}: no index entry for offset {expect}"),
                    ));
                };
                if next.offset != expect || (next.segment, next.position) <= (seg_seq, pos) {
                    return Err(corrupt(
                        next.segment,
                        next.position,
                        format!(
                            "shard {shard}: index entry for offset {} where {expect} was expected",
                            next.offset
                        ),
                    ));
                }
                seg_seq = next.segment;
                pos = next.position;
                last_hit = pos;
                continue;
            }
            let want = READ_CHUNK_BYTES.max(min_read).min(seg.tail - pos);
            let need = min_read.min(want);
            let len = usize::try_from(want).unwrap_or(usize::MAX);
            let Some(chunk) = chunk(seg, pos, len, usize::try_from(need).unwrap_or(len))? else {
                // Not in memory: what was gathered is an answer; else wait here.
                if !out.is_empty() {
                    return Ok(Walk::Done(out));
                }
                return Ok(Walk::Missed(ReadResume {
                    shard,
                    from: asked,
                    segment: seg_seq,
                    pos,
                    expect,
                    last_hit,
                    min_read,
                    skipped: skipped.get() - skipped_at_start,
                }));
            };
            min_read = 0;
            let mut at = 0usize;
            while at < chunk.len() {
                match frame::decode(&chunk[at..]) {
                    Decoded::Record {
                        record,
                        frame_bytes,
                    } => {
                        if record.shard == shard {
                            let here = pos + at as u64;
                            if record.offset != expect {
                                return Err(corrupt(
                                    seg_seq,
                                    here,
                                    format!(
                                        "shard {shard}: offset {} where {expect} was expected",
                                        record.offset
                                    ),
                                ));
                            }
                            expect = skip(record.offset + 1);
                            last_hit = here;
                            if record.offset >= from {
                                let body = record.key.len() + record.payload.len();
                                if !out.is_empty() && bytes + body > max_bytes {
                                    return Ok(Walk::Done(out));
                                }
                                let key_start = at + HEADER_BYTES;
                                let payload_start = key_start + record.key.len();
                                out.push(Record {
                                    shard,
                                    offset: record.offset,
                                    timestamp_us: record.timestamp_us,
                                    key: chunk.slice(key_start..payload_start),
                                    payload: chunk.slice(payload_start..at + frame_bytes),
                                });
                                bytes += body;
                                if out.len() >= max_records || expect >= end {
                                    return Ok(Walk::Done(out));
                                }
                            }
                        }
                        at += frame_bytes;
                    }
                    Decoded::Mark { .. } => at += frame::MARK_BYTES,
                    Decoded::Incomplete { frame_bytes } => {
                        if pos + at as u64 + frame_bytes as u64 > seg.tail {
                            return Err(corrupt(
                                seg_seq,
                                pos + at as u64,
                                "record crosses the written tail".into(),
                            ));
                        }
                        min_read = frame_bytes as u64;
                        break;
                    }
                    Decoded::Invalid(why) => {
                        return Err(corrupt(seg_seq, pos + at as u64, why.to_string()));
                    }
                }
            }
            pos += at as u64;
        }
    }

    // ----- retention -----

    /// Deletes whole oldest segments (never the active one) while the log exceeds
    /// `retention_bytes`, or while the oldest segment's newest record is older than
    /// `retention_age` at `now_unix_us`; moves each shard's oldest offset forward.
    pub fn apply_retention(&mut self, now_unix_us: u64) -> Result<RetentionReport, StorageError> {
        self.check_failed()?;
        let mut report = RetentionReport::default();
        // Bounded by the segment count; the active (last) segment is never deleted.
        while self.segments.len() > 1 {
            let oldest = &self.segments[0];
            let over_bytes = self
                .config
                .retention_bytes
                .is_some_and(|max| self.total_bytes > max);
            let newest_us = oldest.max_timestamp_us.unwrap_or(oldest.created_unix_us);
            let expired = self.config.retention_age.is_some_and(|age| {
                newest_us.saturating_add(u64::try_from(age.as_micros()).unwrap_or(u64::MAX))
                    < now_unix_us
            });
            if !over_bytes && !expired {
                break;
            }
            if self.in_flight.iter().any(|f| f.segment == oldest.seq) {
                break;
            }
            let Some(seg) = self.segments.pop_front() else {
                unreachable!("len > 1");
            };
            std::fs::remove_file(&seg.path).map_err(|e| {
                StorageError::io(format!("delete segment {}", seg.path.display()), e)
            })?;
            sidecar::remove(&self.config.dir, seg.seq);
            tracing::info!(
                seq = seg.seq,
                bytes = seg.size,
                over_bytes,
                expired,
                "retention deleted log segment"
            );
            self.total_bytes -= seg.size;
            self.counters.segments_deleted += 1;
            self.counters.retention_deleted_bytes += seg.size;
            report.segments_deleted.push(seg.seq);
            report.bytes_deleted += seg.size;
        }
        if !report.segments_deleted.is_empty() {
            self.front_segments_deleted();
        }
        Ok(report)
    }

    /// After the oldest segments were deleted: each shard's index loses their entries and
    /// its oldest offset moves to its first remaining record.
    fn front_segments_deleted(&mut self) {
        let Some(first) = self.segments.front().map(|s| s.seq) else {
            return;
        };
        for (shard, s) in self.shards.iter_mut() {
            let ix = self.index.entry(*shard).or_default();
            ix.drop_segments_before(first);
            let oldest = ix.first().map_or(s.written, |e| e.offset);
            s.oldest = self.quarantine.extend_down(*shard, oldest);
        }
        self.index.retain(|_, ix| ix.first().is_some());
    }

    // ----- deleted streams -----

    /// Releases every shard for which `live` is false (log shards of deleted streams): the
    /// shard is forgotten (offsets, index) and listed in the directory's `released` file, so
    /// recovery ignores its records from then on; then every closed segment left without a
    /// live record gives its space back at once (deleted when it is the oldest, else cut down
    /// to its header so the segment sequence stays contiguous). The active segment is kept.
    /// A shard with appends not yet written is left for a later call. Stream ids are never
    /// reused, so a released shard id never names records again.
    ///
    /// Runs on the calling thread: one small atomic file write (two fsyncs) when something is
    /// released, plus a truncate or unlink per freed segment.
    pub fn release_shards(
        &mut self,
        live: impl Fn(u32) -> bool,
    ) -> Result<ReleaseReport, StorageError> {
        self.check_failed()?;
        let in_flight: Vec<u32> = self
            .in_flight
            .iter()
            .filter_map(|f| match &f.kind {
                RoundKind::Records(meta) => Some(meta.ranges.iter().map(|r| r.shard)),
                _ => None,
            })
            .flatten()
            .collect();
        let mut dead: Vec<u32> = self
            .shards
            .iter()
            .filter(|(id, s)| !live(**id) && s.next == s.written && !in_flight.contains(id))
            .map(|(id, _)| *id)
            .collect();
        // Shards only segments still mention (e.g. forgotten before, or never anchored here).
        for seg in &self.segments {
            dead.extend(
                seg.stats
                    .keys()
                    .filter(|id| !live(**id) && !self.shards.contains_key(id)),
            );
        }
        dead.sort_unstable();
        dead.dedup();
        let mut report = ReleaseReport::default();
        if dead.is_empty() {
            return Ok(report);
        }
        // Segments below get new sidecars or lose theirs: the helper's older ones first.
        self.ahead.get_mut().settle();
        let mut released = self.released.clone();
        released.extend(dead.iter().copied());
        released.store(&self.config.dir)?;
        self.released = released;
        for shard in &dead {
            self.shards.remove(shard);
            self.index.remove(shard);
            for seg in self.segments.iter_mut() {
                if let Some(stats) = seg.stats.remove(shard) {
                    seg.records -= stats.records;
                    seg.released_records += stats.records;
                }
            }
        }
        report.shards = dead;
        // Closed segments without a live record: the oldest ones are deleted, the others cut
        // to their header. Bounded by the segment count; the active one is never touched.
        let closed = self.segments.len().saturating_sub(1);
        let mut freed_front = 0usize;
        for at in 0..closed {
            let seg = &mut self.segments[at];
            if !seg.stats.is_empty() {
                continue;
            }
            if at == freed_front {
                freed_front += 1;
                continue; // deleted below
            }
            if seg.size > seg.data_start {
                seg.file.set_len(seg.data_start).map_err(|e| {
                    StorageError::io(format!("release segment {}", seg.path.display()), e)
                })?;
                seg.file.sync_all().map_err(|e| {
                    StorageError::io(format!("fsync segment {}", seg.path.display()), e)
                })?;
                report.bytes_freed += seg.size - seg.data_start;
                self.total_bytes -= seg.size - seg.data_start;
                seg.size = seg.data_start;
                seg.tail = seg.data_start;
                seg.records_end = seg.data_start;
                seg.synced_end = seg.data_start;
                seg.synced_records_end = seg.data_start;
                seg.records = 0;
                seg.record_bytes = 0;
                seg.max_timestamp_us = None;
                report.segments.push(seg.seq);
                let seq = seg.seq;
                let sidecar = self.sidecar_of(&self.segments[at]);
                sidecar::write(&self.config.dir, &sidecar)?;
                tracing::info!(
                    seq,
                    "released a segment of deleted streams (cut to its header)"
                );
            }
        }
        for _ in 0..freed_front {
            let Some(seg) = self.segments.pop_front() else {
                unreachable!("freed_front counts existing closed segments");
            };
            std::fs::remove_file(&seg.path).map_err(|e| {
                StorageError::io(format!("delete segment {}", seg.path.display()), e)
            })?;
            sidecar::remove(&self.config.dir, seg.seq);
            tracing::info!(
                seq = seg.seq,
                bytes = seg.size,
                "released a segment of deleted streams (deleted)"
            );
            report.bytes_freed += seg.size;
            self.total_bytes -= seg.size;
            report.segments.push(seg.seq);
        }
        if freed_front > 0 {
            self.front_segments_deleted();
        }
        if !report.segments.is_empty() {
            segment::sync_dir(&self.config.dir)?;
        }
        self.counters.released_segments += report.segments.len() as u64;
        self.counters.released_bytes += report.bytes_freed;
        tracing::info!(
            shards = report.shards.len(),
            segments = report.segments.len(),
            bytes = report.bytes_freed,
            "released the log shards of deleted streams"
        );
        Ok(report)
    }
}
