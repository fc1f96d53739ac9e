//! Raft's durable state for one Raft group (log entries, hard state, conf state and the latest
//! snapshot) kept in a Felix log (`felix_storage::Log`, `storage/src/log.rs`), with raft-rs's
//! [`raft::Storage`] read side served from memory.
//!
//! # Records
//!
//! The storage log is append-only with dense per-shard offsets and no truncation
//! (`storage/src/log.rs`, `Log::append`), so Raft's rewrites are expressed as appends:
//!
//! - **Entries**: one record per entry in the generation's entries shard; the payload is the
//!   protobuf-encoded [`Entry`] (it carries its index and term), the key is empty. Replaying
//!   the records in order with the Raft rule rebuilds the log: an entry with index `i` replaces
//!   the entry held at `i` *and every entry after it*. A follower that overwrites a conflicting
//!   suffix therefore simply appends the new entries.
//! - **State**: records in the generation's state shard, key `h` (protobuf [`HardState`]),
//!   key `c` (protobuf [`ConfState`]) or key `g` (the generation's seal, see below); the last
//!   `h` and the last `c` read back win. Entries and hard state live in the same Felix log, so
//!   one fdatasync (on_commit fsync, `storage/src/config.rs`) covers both; entries are appended
//!   before the hard state, so a torn write never leaves a commit index above the entries.
//! - **Snapshot**: at most one record in the generation's snapshot shard: the protobuf-encoded
//!   [`Snapshot`] (metadata and data).
//!
//! # Generations
//!
//! Generation `k` uses the log shards `3k` (entries), `3k + 1` (state) and `3k + 2`
//! (snapshot); generation 0 is therefore shard 0 for entries and shard 1 for state. Every
//! change of the snapshot ([`RaftLog::compact`], [`RaftLog::apply_snapshot`]) starts a new
//! generation: its snapshot record, conf state, hard state, the entries that stay live, and
//! last a seal record (key `g`, payload the generation number, little-endian `u32`) are
//! appended and fdatasynced together; only then are all older generations' shards released
//! (`Log::release_shards`, `storage/src/log.rs`), which gives back every closed segment left
//! without a live record. Generation numbers only grow: a released shard id is never used
//! again (`storage/src/quarantine.rs`, `Released`), so the next generation is one past the
//! highest shard id the log knows or has released.
//!
//! Recovery ([`RaftLog::open`]) opens the Felix log (`storage/src/recovery.rs`: a torn tail is
//! cut), then picks the newest *sealed* generation present (generation 0 needs no seal: it
//! is the one a fresh log starts in). A crash during a switch leaves either an unsealed newer
//! generation (ignored and released: the old one is still complete) or a sealed newer one
//! next to the old (the old one is released). Records of a generation's entries shard must
//! start right after its snapshot and never rewrite an index at or below it; recovery refuses
//! a log that breaks this ([`RaftLogError::Corrupt`]).
//!
//! # Shared logs
//!
//! A member's shard groups keep their Raft logs in one Felix log per fsync mode
//! ([`SharedLog`], `groups.rs`): each group's generations are triples of the log's shards as
//! above, the generation counter is the log's (a generation number belongs to one group),
//! and every generation is sealed, its seal naming the group (payload: the generation, then
//! the group id as little-endian `u64`); a group's first generation holds only its seal
//! until it writes. Recovery ([`SharedLog::open`]) takes each group's newest sealed generation
//! and releases the rest (a group's older generations, unsealed ones). A group's
//! `persist_begin` only appends; the member starts one write for all groups of a pass
//! ([`SharedLog::poll`]), so a pass costs one round and one fdatasync whatever the number of
//! groups, and goes on without waiting for it: each group learns from
//! [`RaftLog::persisted`] which of its writes are stored once the log's completions are
//! reaped (the member polls the log when its eventfd, [`SharedLog::wake_fd`], is readable).
//! A switch releases only the group's previous
//! generation ([`RaftLog::release`] all of a deleted group's); a segment is given back once
//! no group's live record is left in it, so a group whose generation lies
//! [`RELOCATE_AFTER_BYTES`] behind the log's head asks for a compaction
//! ([`RaftLog::relocation_due`]) and a quiet group does not pin the busy groups' segments.
//! A failure of the shared log fails every group on it.
//!
//! # Limits
//!
//! - The live entries are held in memory; the node compacts behind the applied index after
//!   10,000 entries or 64 MiB of entry data ([`RaftLog::live_bytes`],
//!   `NodeConfig::compact_after_bytes`), whichever comes first.
//! - A snapshot is one record: its encoding must fit the frame format's body limit
//!   (`felix_storage::frame::BODY_BYTES_MAX`, 64 MiB).
//! - Each generation switch rewrites the live entries (those past the snapshot) and adds three
//!   shard ids (12 bytes) to the log's `released` file.
//!
//! # Durability
//!
//! The Felix log's fsync mode decides when a write returns (`storage/src/config.rs`):
//!
//! - **on_commit** (the control plane, and replicated streams created `--fsync on_commit`):
//!   every write returns once its records are fdatasynced, so a member acknowledges an entry
//!   (an append response, the leader's own count) only once a power loss cannot take it.
//! - **periodic** (replicated streams created `--fsync periodic`): entries and commit-only
//!   hard states return once *written* (in the page cache: a killed process loses nothing,
//!   a power loss can lose the last interval); the log fdatasyncs them every interval
//!   ([`RaftLog::tick`] drives it). A hard state that changes the term or the vote, a conf
//!   state and a generation switch are fdatasynced before they return in both modes: Raft's
//!   election safety rests on a member never voting twice in a term, and that must survive
//!   a power loss. What a power loss can still cost in this mode is acknowledged entries that
//!   no member had fdatasynced yet (docs/cluster.md, "Acknowledgement modes").
//!
//! A newer commit index alone (a hard state that changes nothing else, with no entries:
//! [`RaftLog::note_commit`]) is appended only, in both modes: the group's next write (its
//! next entries, usually in the same pass under load) or the next tick carries it, never a
//! write of its own, and nothing waits for it. Its loss is harmless (Raft learns the commit
//! again from the leader, and a restarted member re-applies its committed entries from the
//! stored commit on), and waiting for it cost every acknowledged batch a second round before
//! it was applied.
//!
//! # Failure
//!
//! Any failure while writing (failed write or fdatasync, disk full, a timeout) returns the
//! error and makes every later write and [`RaftLog::persisted`] return
//! [`RaftLogError::Failed`]: what reached the disk is unknown until the directory is reopened
//! (recovery then tells). The in-memory view may already hold what a failed write carried
//! ([`RaftLog::persist_begin`] updates it at once), which is harmless: nothing counts it
//! stored, and the group stops with the log.
//!
//! Threads: used from one thread (the service's loop, on the broker's core 0; a shared log's
//! groups hold it through an `Rc`); no threads of its own beyond those the Felix log's
//! backend spawns.
//! A shared log's group writes entries and hard states without blocking
//! ([`RaftLog::persist_begin`], [`RaftLog::persisted`]); opening, [`RaftLog::persist_end`],
//! a generation switch (compaction, a snapshot installed), a conf state and an append that
//! finds the log's pending bound reached still wait for the disk.

use std::cell::{RefCell, RefMut};
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::node::NodeError;
use felix_storage::{
    Backend, BackendChoice, FsyncMode, Log, LogConfig, LogEvent, RecoveryReport, StorageError,
    SystemBackend,
};
use protobuf::Message as _;
use raft::prelude::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState};

/// Segment size of a Raft log: the control plane's log is small, so small segments let a
/// generation switch give space back soon.
pub const RAFT_LOG_SEGMENT_BYTES: u64 = 16 << 20;

/// A group in a [`SharedLog`] compacts once its generation started this many bytes of the
/// log ago ([`RaftLog::relocation_due`]), so that a group with little traffic does not keep
/// the segments of busier ones from being released.
pub const RELOCATE_AFTER_BYTES: u64 = 64 << 20;

/// How long a write waits for its fdatasync before the log counts as failed.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(60);

/// Records read per call while recovering a shard.
const READ_BATCH_RECORDS: usize = 1024;
/// Bytes read per call while recovering a shard (at least one record is always returned).
const READ_BATCH_BYTES: usize = 8 << 20;

/// Log shards per generation: entries, state, snapshot.
const SHARDS_PER_GENERATION: u32 = 3;

/// State record keys.
const KEY_HARD_STATE: &[u8] = b"h";
const KEY_CONF_STATE: &[u8] = b"c";
const KEY_SEAL: &[u8] = b"g";

/// Everything [`RaftLog`] can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RaftLogError {
    /// The Felix log failed (open, recovery, append, write, fdatasync, release).
    #[error("raft log storage: {0}")]
    Storage(#[from] StorageError),
    /// A write failed earlier; the log refuses writes until it is reopened.
    #[error("the raft log failed earlier and refuses writes until reopened: {0}")]
    Failed(String),
    /// The Felix log rejected a round (disk full): the write is not durable.
    #[error("the storage log rejected the write: {0}")]
    Rejected(StorageError),
    /// After the flush a shard was not synced (or, for a write that needs no fdatasync,
    /// written) up to what was appended (never expected).
    #[error("shard {shard} is stored up to offset {stored}, below the appended {next}")]
    NotStored { shard: u32, stored: u64, next: u64 },
    /// A record could not be encoded or decoded as protobuf.
    #[error("protobuf: {0}")]
    Protobuf(#[from] protobuf::ProtobufError),
    /// The records on disk break the rules of the module documentation.
    #[error("raft log is corrupt: {0}")]
    Corrupt(String),
    /// Entries passed to `persist` do not have consecutive indexes.
    #[error("entries are not consecutive: index {got} follows {previous}")]
    NotConsecutive { previous: u64, got: u64 },
    /// An append would rewrite compacted entries (raft-rs `MemStorage` panics there).
    #[error("append at index {index} rewrites compacted entries (first index {first_index})")]
    AppendCompacted { index: u64, first_index: u64 },
    /// An append would leave a gap after the last entry (raft-rs `MemStorage` panics there).
    #[error("append at index {index} leaves a gap after the last index {last_index}")]
    AppendGap { index: u64, last_index: u64 },
    /// `compact` past the last entry (raft-rs `MemStorage` panics there).
    #[error("compact to {upto} beyond the last index {last_index}")]
    CompactBeyondLast { upto: u64, last_index: u64 },
    /// `compact` past the commit index: uncommitted entries may still be rewritten.
    #[error("compact to {upto} beyond the commit index {commit}")]
    CompactBeyondCommit { upto: u64, commit: u64 },
    /// `apply_snapshot` of a snapshot older than the log (raft-rs `SnapshotOutOfDate`).
    #[error("snapshot at index {index} is older than the first index {first_index}")]
    SnapshotOutOfDate { index: u64, first_index: u64 },
}

/// Result of [`RaftLog`]'s operations.
pub type Result<T> = std::result::Result<T, RaftLogError>;

/// The Felix log under one Raft log (its own) or under many ([`SharedLog`]), with what its
/// Raft logs share: the generation counter, a failure, the bytes appended so far.
struct Cell<B: Backend> {
    log: Log<B>,
    /// The next generation to write (past every shard id known or released).
    next_generation: u32,
    /// Set by a failed write: later writes of every Raft log on it are refused.
    failed: Option<String>,
    /// Bytes of records appended since the log was opened (keys, payloads and frame
    /// headers): where a generation starts ([`RaftLog::relocation_due`]).
    appended: u64,
    /// A shared log's groups and the generation each holds (none for a log of its own).
    owners: BTreeMap<u64, u32>,
    /// [`RELOCATE_AFTER_BYTES`] unless a test set less ([`SharedLog::set_relocate_after`]).
    relocate_after: u64,
    /// A group's [`RaftLog::persist_begin`] appended records no round took yet: the next
    /// [`SharedLog::poll`] starts one (a commit index noted alone must not start a round of
    /// its own).
    undriven: bool,
}

impl<B: Backend> Cell<B> {
    /// The next generation number, taken (never handed out twice).
    fn take_generation(&mut self) -> u32 {
        let generation = self.next_generation;
        self.next_generation += 1;
        generation
    }

    /// Releases the shards of `group`'s generation `generation` (the log gives back each
    /// segment left without a live record once no other group's records hold it) and forgets
    /// the group.
    fn release_group(&mut self, group: u64, generation: u32) -> Result<()> {
        self.log
            .release_shards(|id| generation_of(id) != generation)?;
        self.owners.remove(&group);
        Ok(())
    }
}

/// Bytes of a record's frame besides its key and payload, as counted in [`Cell::appended`]
/// (close to `felix_storage::frame`'s header; only used to tell how far the log has moved).
const FRAME_OVERHEAD_BYTES: u64 = 32;

/// One Raft group's durable log, hard state, conf state and latest snapshot (see the module
/// documentation for the records and the generation scheme).
pub struct RaftLog<B: Backend = SystemBackend> {
    cell: Rc<RefCell<Cell<B>>>,
    /// The group when the Felix log is a [`SharedLog`] (its generations' seals name it, and
    /// only its own generations are released); `None` for a log of its own.
    group: Option<u64>,
    /// The current generation.
    generation: u32,
    /// [`Cell::appended`] when the current generation started.
    generation_at: u64,
    /// The latest snapshot (index 0 = none).
    snapshot: Snapshot,
    hard_state: HardState,
    conf_state: ConfState,
    /// Live entries, consecutive, the first at `snapshot.index + 1`.
    entries: Vec<Entry>,
    /// Bytes of the live entries' data ([`RaftLog::live_bytes`]).
    entries_bytes: u64,
    /// Nothing was ever stored.
    is_new: bool,
    /// The log's fsync mode is periodic: entries are counted once written (module docs).
    periodic: bool,
    /// The writes [`RaftLog::persist_begin`] started that are not known stored yet, oldest
    /// first.
    in_flight: VecDeque<InFlight>,
    /// Writes [`RaftLog::persist_begin`] started since the log was opened: each write's
    /// number ([`RaftLog::persisted`]).
    writes: u64,
    /// What the Felix log's recovery found at open.
    recovery: RecoveryReport,
}

impl<B: Backend> std::fmt::Debug for RaftLog<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = self
            .cell
            .try_borrow()
            .map(|cell| cell.log.config().dir.clone())
            .unwrap_or_default();
        f.debug_struct("RaftLog")
            .field("dir", &dir)
            .field("group", &self.group)
            .field("generation", &self.generation)
            .field("snapshot_index", &self.snapshot.get_metadata().index)
            .field("first_index", &self.first())
            .field("last_index", &self.last())
            .field("hard_state", &self.hard_state)
            .finish()
    }
}

fn entries_shard(generation: u32) -> u32 {
    generation * SHARDS_PER_GENERATION
}

fn state_shard(generation: u32) -> u32 {
    generation * SHARDS_PER_GENERATION + 1
}

fn snapshot_shard(generation: u32) -> u32 {
    generation * SHARDS_PER_GENERATION + 2
}

fn generation_of(shard: u32) -> u32 {
    shard / SHARDS_PER_GENERATION
}

/// A seal's payload: the generation (little-endian `u32`), then in a [`SharedLog`] the group
/// (little-endian `u64`).
fn seal_payload(generation: u32, group: Option<u64>) -> Vec<u8> {
    let mut payload = generation.to_le_bytes().to_vec();
    if let Some(group) = group {
        payload.extend_from_slice(&group.to_le_bytes());
    }
    payload
}

/// Microseconds since the Unix epoch (record timestamps and retention ages).
pub(crate) fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The configuration [`RaftLog::open`] uses for `dir`: on_commit fsync (every write is
/// fdatasynced before it returns) and [`RAFT_LOG_SEGMENT_BYTES`] segments. A replicated
/// stream created with periodic acknowledgements sets `fsync` to periodic (module docs).
pub fn raft_log_config(dir: &Path) -> LogConfig {
    let mut config = LogConfig::new(dir);
    config.fsync = FsyncMode::OnCommit;
    config.segment_bytes = RAFT_LOG_SEGMENT_BYTES;
    config
}

/// A Felix log opened and recovered for Raft logs, with its generations.
struct Opened<B: Backend> {
    log: Log<B>,
    report: RecoveryReport,
    /// The highest generation any shard id the log knows or released belongs to.
    highest_generation: Option<u32>,
    /// The generations of the shards present, ascending.
    generations: Vec<u32>,
}

/// Opens and recovers the Felix log under one or more Raft logs (a torn tail cut is logged).
fn open_log<B: Backend>(config: LogConfig, backend: B) -> Result<Opened<B>> {
    let (log, report) = Log::open(config, backend)?;
    if !report.truncations.is_empty() {
        tracing::warn!(
            dir = %log.config().dir.display(),
            truncated_bytes = report.truncated_bytes,
            "raft log recovery cut a torn tail"
        );
    }
    let ids = log.shard_ids();
    let highest_generation = ids
        .iter()
        .copied()
        .chain(log.released().shards())
        .max()
        .map(generation_of);
    let mut generations: Vec<u32> = ids.iter().map(|id| generation_of(*id)).collect();
    generations.sort_unstable();
    generations.dedup();
    Ok(Opened {
        log,
        report,
        highest_generation,
        generations,
    })
}

/// One Felix log holding the Raft logs of many groups (a member's shard groups of one fsync
/// mode): each group's generations are triples of the log's shards like a log of its own
/// ([`RaftLog::open_shared`]), every generation sealed with the group's id. A pass appends
/// every group's records and writes them in one round with one fdatasync
/// ([`SharedLog::poll`]), whatever the number of groups (module documentation, "Shared
/// logs"). Used from one thread.
pub struct SharedLog<B: Backend = SystemBackend> {
    cell: Rc<RefCell<Cell<B>>>,
    periodic: bool,
    recovery: RecoveryReport,
}

impl<B: Backend> std::fmt::Debug for SharedLog<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cell = self.cell.try_borrow();
        f.debug_struct("SharedLog")
            .field(
                "dir",
                &cell.as_ref().map(|c| c.log.config().dir.clone()).ok(),
            )
            .field("groups", &cell.as_ref().map(|c| c.owners.len()).ok())
            .finish()
    }
}

impl<B: Backend> SharedLog<B> {
    /// Opens (creating if needed) and recovers the shared log: each group's newest sealed
    /// generation is its current one; older generations of a group (a switch a crash
    /// interrupted) and unsealed ones (a switch or a group's start a crash interrupted)
    /// are released. A seal without a group is [`RaftLogError::Corrupt`]. Blocks.
    pub fn open(config: LogConfig, backend: B) -> Result<Self> {
        let periodic = matches!(config.fsync, FsyncMode::Periodic { .. });
        let Opened {
            mut log,
            report,
            highest_generation,
            generations,
        } = open_log(config, backend)?;
        let next_generation = highest_generation.map_or(0, |g| g + 1);
        let mut owners: BTreeMap<u64, u32> = BTreeMap::new();
        let mut stale: Vec<u32> = Vec::new();
        for generation in generations {
            let state = read_state(&log, generation)?;
            match (state.sealed, state.group) {
                (true, Some(group)) => {
                    if let Some(older) = owners.insert(group, generation) {
                        stale.push(older);
                    }
                }
                (true, None) => {
                    return Err(RaftLogError::Corrupt(format!(
                        "generation {generation} of a shared raft log is sealed without its group"
                    )));
                }
                (false, _) => stale.push(generation),
            }
        }
        if !stale.is_empty() {
            let report = log.release_shards(|id| !stale.contains(&generation_of(id)))?;
            tracing::debug!(
                shards = ?report.shards,
                "shared raft log released generations a crash left behind"
            );
        }
        Ok(SharedLog {
            cell: Rc::new(RefCell::new(Cell {
                log,
                next_generation,
                failed: None,
                appended: 0,
                owners,
                relocate_after: RELOCATE_AFTER_BYTES,
                undriven: false,
            })),
            periodic,
            recovery: report,
        })
    }

    /// The groups with a generation in the log.
    #[must_use]
    pub fn groups(&self) -> Vec<u64> {
        self.cell.borrow().owners.keys().copied().collect()
    }

    /// Whether `group` has a generation in the log.
    #[must_use]
    pub fn holds(&self, group: u64) -> bool {
        self.cell.borrow().owners.contains_key(&group)
    }

    /// Releases group `group`'s generation, found in the log but no longer wanted (its stream
    /// was deleted while this member was down), without opening a [`RaftLog`] on it: the
    /// caller makes sure none is open. Returns whether the log held the group.
    pub fn release_orphan(&self, group: u64) -> Result<bool> {
        let mut cell = self.cell.borrow_mut();
        if let Some(why) = &cell.failed {
            return Err(RaftLogError::Failed(why.clone()));
        }
        let Some(generation) = cell.owners.get(&group).copied() else {
            return Ok(false);
        };
        cell.release_group(group, generation)?;
        Ok(true)
    }

    /// Moves the log on without blocking: reaps its finished rounds (its groups'
    /// [`RaftLog::persisted`] then tell what is stored) and starts one round, one fdatasync,
    /// for what the groups' [`RaftLog::persist_begin`]s appended since the last round began
    /// (a commit index noted alone starts none: it waits for the next write or tick). A
    /// rejected round (disk full) fails every group on the log. The member calls it around
    /// each pass and whenever [`SharedLog::wake_fd`] is readable. Returns whether a round
    /// was reaped.
    pub fn poll(&self, now: Instant) -> Result<bool> {
        let mut cell = self.cell.borrow_mut();
        if let Some(why) = &cell.failed {
            return Err(RaftLogError::Failed(why.clone()));
        }
        let mut reaped = false;
        let mut moved = cell.log.reap(now).map(|rounds| reaped = rounds > 0);
        if moved.is_ok() {
            moved = Self::start(&mut cell, now);
        }
        let mut failure = moved.err().map(RaftLogError::from);
        while let Some(event) = cell.log.poll_event() {
            if let LogEvent::Rejected { error, .. } = event {
                failure.get_or_insert(RaftLogError::Rejected(error));
            }
        }
        match failure {
            Some(error) => {
                tracing::error!(%error, dir = %cell.log.config().dir.display(), "shared raft log write failed; refusing further writes");
                cell.failed.get_or_insert_with(|| error.to_string());
                Err(error)
            }
            None => Ok(reaped),
        }
    }

    /// Starts a round for what the groups' [`RaftLog::persist_begin`]s appended since the
    /// last round began, without reaping ([`SharedLog::poll`] after a pass's writes: a round
    /// that finished since is announced by the wake fd). A failure is [`SharedLog::poll`]'s
    /// to report.
    pub fn start_rounds(&self, now: Instant) -> Result<()> {
        let mut cell = self.cell.borrow_mut();
        if let Some(why) = &cell.failed {
            return Err(RaftLogError::Failed(why.clone()));
        }
        Self::start(&mut cell, now).map_err(RaftLogError::from)
    }

    fn start(cell: &mut Cell<B>, now: Instant) -> std::result::Result<(), StorageError> {
        if cell.undriven {
            cell.log.start_rounds(now)?;
            // Two rounds may be in flight: what neither took starts once one completes.
            cell.undriven = cell.log.pending_bytes() > 0;
        }
        Ok(())
    }

    /// An eventfd that becomes readable when a round of the log completes: the owner then
    /// calls [`SharedLog::poll`] (a copy of the log's own descriptor, for an event loop to
    /// wait on).
    pub fn wake_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.cell.borrow().log.wake_fd().try_clone_to_owned()
    }

    /// Groups ask for a compaction once their generation lies `bytes` behind the log's head
    /// instead of [`RELOCATE_AFTER_BYTES`] (tests).
    pub fn set_relocate_after(&self, bytes: u64) {
        self.cell.borrow_mut().relocate_after = bytes;
    }

    /// Bytes of the log's segment files (every group's records).
    #[must_use]
    pub fn disk_bytes(&self) -> u64 {
        self.cell.borrow().log.total_bytes()
    }

    /// Whether entries are stored once written rather than once fdatasynced.
    #[must_use]
    pub fn is_periodic(&self) -> bool {
        self.periodic
    }

    /// What the Felix log's recovery found when it was opened.
    #[must_use]
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// The error that made the log refuse writes, if one did.
    #[must_use]
    pub fn failure(&self) -> Option<String> {
        self.cell.borrow().failed.clone()
    }
}

impl RaftLog<SystemBackend> {
    /// Opens (creating if needed) the Raft log in `dir` with [`raft_log_config`] and the
    /// system backend (io_uring, or the pwrite writer thread; FELIX_STORAGE_IO_URING picks,
    /// `storage/src/config.rs`), and recovers it; the directory is created if missing (the
    /// log's lock does it, `storage/src/lock.rs`). Blocks.
    pub fn open(dir: &Path) -> Result<Self> {
        let backend = SystemBackend::open(BackendChoice::from_env()?)?;
        Self::open_with(raft_log_config(dir), backend)
    }
}

impl<B: Backend> RaftLog<B> {
    /// Opens the Raft log with an explicit Felix log configuration and backend (tests use
    /// small segments and the fault-injecting backend). `config.fsync` decides when writes
    /// return (module documentation, "Durability").
    pub fn open_with(config: LogConfig, backend: B) -> Result<Self> {
        let periodic = matches!(config.fsync, FsyncMode::Periodic { .. });
        let Opened {
            log,
            report,
            highest_generation,
            generations,
        } = open_log(config, backend)?;
        let next_generation = highest_generation.map_or(1, |g| g + 1);

        let mut chosen: Option<(u32, StateRecords)> = None;
        for &generation in generations.iter().rev() {
            let state = read_state(&log, generation)?;
            if generation == 0 || state.sealed {
                chosen = Some((generation, state));
                break;
            }
        }
        let (generation, state) = match chosen {
            Some(c) => c,
            None => {
                // No sealed generation: only generation 0 can be current, and only if it was
                // never released (releasing it needs a sealed newer one).
                if log.released().shards().any(|id| generation_of(id) == 0) {
                    return Err(RaftLogError::Corrupt(
                        "generation 0 was released but no sealed generation is left".into(),
                    ));
                }
                (0, StateRecords::default())
            }
        };
        let snapshot = read_snapshot(&log, generation)?;
        let entries = read_entries(&log, generation, snapshot.get_metadata().index)?;
        let is_new = generation == 0
            && snapshot.get_metadata().index == 0
            && state.hard_state.is_none()
            && state.conf_state.is_none()
            && entries.is_empty();
        let mut raft_log = RaftLog {
            cell: Rc::new(RefCell::new(Cell {
                log,
                next_generation,
                failed: None,
                appended: 0,
                owners: BTreeMap::new(),
                relocate_after: RELOCATE_AFTER_BYTES,
                undriven: false,
            })),
            group: None,
            generation,
            generation_at: 0,
            snapshot,
            hard_state: state.hard_state.unwrap_or_default(),
            conf_state: state.conf_state.unwrap_or_default(),
            entries_bytes: data_bytes(&entries),
            entries,
            is_new,
            periodic,
            in_flight: VecDeque::new(),
            writes: 0,
            recovery: report,
        };
        if generations.iter().any(|g| *g != generation) {
            // Left by a switch a crash interrupted: an older generation not yet released, or
            // an unsealed newer one.
            raft_log.release_other_generations(None)?;
        }
        Ok(raft_log)
    }

    /// Opens group `group`'s Raft log in `shared`: its current generation when the log holds
    /// one, else a new generation holding only its seal (written and fdatasynced before this
    /// returns, so a vote or an entry stored later is never taken for a crash's leftover).
    pub fn open_shared(shared: &SharedLog<B>, group: u64) -> Result<Self> {
        let current = shared.cell.borrow().owners.get(&group).copied();
        let mut raft_log = RaftLog {
            cell: Rc::clone(&shared.cell),
            group: Some(group),
            generation: 0,
            generation_at: shared.cell.borrow().appended,
            snapshot: Snapshot::default(),
            hard_state: HardState::default(),
            conf_state: ConfState::default(),
            entries: Vec::new(),
            entries_bytes: 0,
            is_new: true,
            periodic: shared.periodic,
            in_flight: VecDeque::new(),
            writes: 0,
            recovery: shared.recovery.clone(),
        };
        raft_log.check_failed()?;
        match current {
            Some(generation) => {
                let (state, snapshot, entries) = {
                    let cell = shared.cell.borrow();
                    let state = read_state(&cell.log, generation)?;
                    let snapshot = read_snapshot(&cell.log, generation)?;
                    let entries =
                        read_entries(&cell.log, generation, snapshot.get_metadata().index)?;
                    (state, snapshot, entries)
                };
                raft_log.generation = generation;
                raft_log.hard_state = state.hard_state.unwrap_or_default();
                raft_log.conf_state = state.conf_state.unwrap_or_default();
                raft_log.is_new = snapshot.get_metadata().index == 0
                    && raft_log.hard_state == HardState::default()
                    && raft_log.conf_state == ConfState::default()
                    && entries.is_empty();
                raft_log.snapshot = snapshot;
                raft_log.entries_bytes = data_bytes(&entries);
                raft_log.entries = entries;
            }
            None => {
                let generation = shared.cell.borrow_mut().take_generation();
                raft_log.generation = generation;
                let seal = (
                    state_shard(generation),
                    KEY_SEAL,
                    seal_payload(generation, Some(group)),
                );
                raft_log.write(&[seal], true)?;
                shared.cell.borrow_mut().owners.insert(group, generation);
            }
        }
        Ok(raft_log)
    }

    /// Moves `legacy` (a group's Raft log of its own, as releases before the shared logs
    /// kept one per group) into `shared` as group `group`'s: its snapshot, states and live
    /// entries become the group's generation there, sealed and fdatasynced before this
    /// returns. The caller then removes the old directory. A group `shared` already holds
    /// is refused (the old directory is a leftover of an earlier move: remove it).
    pub fn import(shared: &SharedLog<B>, group: u64, legacy: RaftLog<B>) -> Result<Self> {
        if shared.holds(group) {
            return Err(RaftLogError::Corrupt(format!(
                "group {group} is in the shared raft log already"
            )));
        }
        let mut raft_log = RaftLog::open_shared(shared, group)?;
        raft_log.switch_generation(
            legacy.snapshot.clone(),
            legacy.hard_state.clone(),
            legacy.conf_state.clone(),
            legacy.entries.clone(),
        )?;
        raft_log.is_new = legacy.is_new;
        Ok(raft_log)
    }

    /// A deleted group's end in a [`SharedLog`]: what it queued is written, then its shards
    /// are released (the log gives back each segment left without a live record once no
    /// other group's records hold it). A log of its own is just closed; its directory is the
    /// caller's to remove.
    pub fn release(mut self) -> Result<()> {
        let Some(group) = self.group else {
            return self.close();
        };
        self.flush()?;
        let mine = self.generation;
        let released = self.cell.borrow_mut().release_group(group, mine);
        released.map_err(|e| self.fail(e))
    }

    /// True when nothing was ever stored (a fresh directory): the node must be bootstrapped.
    pub fn initial_state_is_new(&self) -> bool {
        self.is_new
    }

    /// The hard state as last persisted.
    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    /// The conf state as last persisted.
    pub fn conf_state(&self) -> &ConfState {
        &self.conf_state
    }

    /// The latest snapshot (metadata index 0 when there is none).
    pub fn latest_snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The current generation (see the module documentation).
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// What the Felix log's recovery found when this log was opened (torn tails cut, ...).
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// Bytes of the Felix log's segment files.
    /// A [`SharedLog`]'s files hold every group's records: this counts them all.
    pub fn disk_bytes(&self) -> u64 {
        self.log().total_bytes()
    }

    /// Whether entries are stored once written rather than once fdatasynced (module
    /// documentation, "Durability").
    pub fn is_periodic(&self) -> bool {
        self.periodic
    }

    /// Whether records of the current generation are written but not fdatasynced yet
    /// (periodic mode, or a commit index on its way).
    pub fn has_unsynced(&self) -> bool {
        let log = self.log();
        [entries_shard(self.generation), state_shard(self.generation)]
            .into_iter()
            .filter_map(|shard| log.shard_offsets(shard))
            .any(|o| o.synced != o.next)
    }

    /// Bytes of entry data held in memory: the live entries behind the snapshot.
    pub fn live_bytes(&self) -> u64 {
        self.entries_bytes
    }

    /// The error that made the log refuse writes, if one did (on a [`SharedLog`], any of its
    /// groups' writes).
    pub fn failure(&self) -> Option<String> {
        self.cell.borrow().failed.clone()
    }

    /// The group this log keeps in a [`SharedLog`], `None` for a log of its own.
    pub fn group(&self) -> Option<u64> {
        self.group
    }

    /// Whether the current generation of a group in a [`SharedLog`] started more than
    /// [`RELOCATE_AFTER_BYTES`] of the log ago: its records then keep old segments of every
    /// group from being released, so the group should compact (which starts a generation at
    /// the log's head) even though it holds few entries. Never for a log of its own.
    pub fn relocation_due(&self) -> bool {
        let cell = self.cell.borrow();
        self.group.is_some() && cell.appended - self.generation_at > cell.relocate_after
    }

    /// The Felix log, borrowed for one call.
    fn log(&self) -> RefMut<'_, Log<B>> {
        RefMut::map(self.cell.borrow_mut(), |cell| &mut cell.log)
    }

    fn first(&self) -> u64 {
        self.entries
            .first()
            .map_or(self.snapshot.get_metadata().index + 1, |e| e.index)
    }

    fn last(&self) -> u64 {
        self.entries
            .last()
            .map_or(self.snapshot.get_metadata().index, |e| e.index)
    }

    fn term_of(&self, index: u64) -> Option<u64> {
        let meta = self.snapshot.get_metadata();
        if index == meta.index {
            return Some(meta.term);
        }
        let first = self.first();
        if index < first || index > self.last() {
            return None;
        }
        usize::try_from(index - first)
            .ok()
            .and_then(|at| self.entries.get(at))
            .map(|e| e.term)
    }

    /// Appends `entries` (which replace the entries held at and after their first index, as
    /// raft-rs `MemStorage::append` does) and `hard_state` if given, and returns once both
    /// are stored (fdatasynced; in periodic mode written, unless the term or the vote
    /// changes: module documentation, "Durability"; a hard state alone that only moves the
    /// commit index is [`RaftLog::note_commit`]'s, not waited for). Entries must be
    /// consecutive, start no lower than the first index and leave no gap after the last index
    /// (errors, not writes, where `MemStorage` panics).
    pub fn persist(&mut self, entries: &[Entry], hard_state: Option<&HardState>) -> Result<()> {
        self.persist_begin(entries, hard_state)?;
        self.persist_end()
    }

    /// Starts what [`RaftLog::persist`] does without waiting: checks, appends the records,
    /// starts their write (a log of its own; a [`SharedLog`]'s owner starts one write for all
    /// its groups, [`SharedLog::poll`]), and updates the view served through
    /// [`raft::Storage`] at once, as raft-rs's asynchronous persistence asks
    /// (`RawNode::advance_append_async`: the entries must be readable before they are
    /// stored). Further writes may begin before this one is stored. Returns the write's
    /// number: [`RaftLog::persisted`] tells when it is stored, [`RaftLog::persist_end`] waits
    /// for it. Nothing to write (a commit-only hard state, noted for the next write) returns
    /// the number of the write before, so it counts as stored once that one is.
    pub fn persist_begin(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<u64> {
        self.check_failed()?;
        if entries.is_empty()
            && let Some(hs) = hard_state
            && hs.term == self.hard_state.term
            && hs.vote == self.hard_state.vote
        {
            // Only the commit index moved: written in the background (`note_commit`).
            self.note_commit(hs.commit)?;
            return Ok(self.writes);
        }
        if let Some(first) = entries.first() {
            let first_index = self.first();
            let last_index = self.last();
            if first.index < first_index {
                return Err(RaftLogError::AppendCompacted {
                    index: first.index,
                    first_index,
                });
            }
            if first.index > last_index + 1 {
                return Err(RaftLogError::AppendGap {
                    index: first.index,
                    last_index,
                });
            }
            for pair in entries.windows(2) {
                if pair[1].index != pair[0].index + 1 {
                    return Err(RaftLogError::NotConsecutive {
                        previous: pair[0].index,
                        got: pair[1].index,
                    });
                }
            }
        }
        let mut records = Vec::with_capacity(entries.len() + 1);
        for e in entries {
            records.push((entries_shard(self.generation), &[][..], e.write_to_bytes()?));
        }
        if let Some(hs) = hard_state {
            records.push((
                state_shard(self.generation),
                KEY_HARD_STATE,
                hs.write_to_bytes()?,
            ));
        }
        if records.is_empty() {
            return Ok(self.writes);
        }
        let sync = !self.periodic
            || hard_state.is_some_and(|hs| {
                hs.term != self.hard_state.term || hs.vote != self.hard_state.vote
            });
        let started = self.append_records(&records).and_then(|shards| {
            if sync && self.periodic {
                // The round that starts now carries the fdatasync (term and vote changes).
                self.log().sync_now();
            }
            if self.group.is_none() {
                self.log().drive(Instant::now())?;
            } else {
                // A log of its own starts the write now; a shared log's owner starts one
                // write for every group's records once all have begun (`SharedLog::poll`).
                // Only these appends ask for it: a commit index noted alone waits for the
                // next write or tick (`note_commit`), or it would cost a round of its own.
                self.cell.borrow_mut().undriven = true;
            }
            Ok(shards)
        });
        let shards = started.map_err(|e| self.fail(e))?;
        let targets = {
            let log = self.log();
            shards
                .iter()
                .map(|&shard| (shard, log.shard_offsets(shard).map_or(0, |o| o.next)))
                .collect()
        };
        self.writes += 1;
        self.in_flight.push_back(InFlight {
            number: self.writes,
            targets,
            sync,
        });
        if let Some(first) = entries.first() {
            let keep = usize::try_from(first.index - self.first()).unwrap_or(usize::MAX);
            if let Some(replaced) = self.entries.get(keep..) {
                self.entries_bytes -= data_bytes(replaced);
            }
            self.entries.truncate(keep);
            self.entries_bytes += data_bytes(entries);
            self.entries.extend_from_slice(entries);
        }
        if let Some(hs) = hard_state {
            self.hard_state = hs.clone();
        }
        self.is_new = false;
        Ok(self.writes)
    }

    /// The number of the newest write [`RaftLog::persist_begin`] started that is stored, and
    /// every write before it: what the Felix log's completions reaped so far tell
    /// ([`SharedLog::poll`], [`RaftLog::tick`]), without waiting. Writes are stored in the
    /// order they began.
    pub fn persisted(&mut self) -> Result<u64> {
        self.check_failed()?;
        self.reap_stored();
        Ok(self.in_flight.front().map_or(self.writes, |w| w.number - 1))
    }

    /// An eventfd that becomes readable when a round of the Felix log under this Raft log
    /// completes (a copy of the log's own descriptor, for an event loop to wait on): the
    /// owner of a log of its own then reaps it ([`RaftLog::tick`]) and asks
    /// [`RaftLog::persisted`]; a shared log's owner uses [`SharedLog::wake_fd`].
    pub fn wake_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.log().wake_fd().try_clone_to_owned()
    }

    /// Drops the writes in flight that are stored, oldest first.
    fn reap_stored(&mut self) {
        while let Some(front) = self.in_flight.front() {
            if !self.targets_stored(&front.targets, front.sync) {
                break;
            }
            self.in_flight.pop_front();
        }
    }

    /// Waits until every write [`RaftLog::persist_begin`] started is stored (nothing in
    /// flight: returns at once).
    pub fn persist_end(&mut self) -> Result<()> {
        self.check_failed()?;
        self.reap_stored();
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let sync = self.in_flight.iter().any(|w| w.sync);
        self.wait(sync).map_err(|e| self.fail(e))?;
        self.reap_stored();
        if let Some(left) = self.in_flight.front() {
            let (shard, next) = left.targets.first().copied().unwrap_or_default();
            let stored = self.log().shard_offsets(shard).map_or(0, |o| o.synced);
            return Err(self.fail(RaftLogError::NotStored {
                shard,
                stored,
                next,
            }));
        }
        Ok(())
    }

    /// Records a newer commit index without writing it: the hard state record is appended
    /// and goes with the log's next round (the next entries, or [`RaftLog::tick`]'s write;
    /// any later write that waits covers it). The view's commit moves at once. Its loss to a
    /// crash is harmless: Raft learns the commit index again, and compaction stores its own.
    /// An index at or below the stored one does nothing.
    pub fn note_commit(&mut self, commit: u64) -> Result<()> {
        self.check_failed()?;
        if commit <= self.hard_state.commit {
            return Ok(());
        }
        let mut hard_state = self.hard_state.clone();
        hard_state.commit = commit;
        let record = (
            state_shard(self.generation),
            KEY_HARD_STATE,
            hard_state.write_to_bytes()?,
        );
        let result = self.append_records(std::slice::from_ref(&record));
        result.map_err(|e| self.fail(e))?;
        self.hard_state = hard_state;
        self.is_new = false;
        // Not written here: the next write (the group's next entries, usually within the
        // same pass under load) or the next tick carries it, so a commit costs no write of
        // its own (a lone publish paid ~0.6 writes more per member for it).
        Ok(())
    }

    /// Reaps finished rounds and starts the next ones without blocking: writes what
    /// [`RaftLog::note_commit`] left queued, and in periodic mode runs the fdatasync once
    /// written data is an interval old. The owner calls it regularly (every cluster tick).
    pub fn tick(&mut self, now: Instant) -> Result<()> {
        self.check_failed()?;
        let driven = self.log().drive(now);
        if let Err(e) = driven {
            return Err(self.fail(e.into()));
        }
        loop {
            let event = self.log().poll_event();
            let Some(event) = event else { break };
            if let LogEvent::Rejected { error, .. } = event {
                return Err(self.fail(RaftLogError::Rejected(error)));
            }
        }
        Ok(())
    }

    /// Writes what is queued (a commit index [`RaftLog::note_commit`] noted since the last
    /// write) and waits for it: a clean close. Dropping the log without it is a crash, which
    /// may lose that commit index (harmless: module documentation, "Durability").
    pub fn flush(&mut self) -> Result<()> {
        self.check_failed()?;
        self.wait(false).map_err(|e| self.fail(e))
    }

    /// Stores the conf state durably (returns once fdatasynced).
    pub fn set_conf_state(&mut self, cs: ConfState) -> Result<()> {
        self.check_failed()?;
        let record = (
            state_shard(self.generation),
            KEY_CONF_STATE,
            cs.write_to_bytes()?,
        );
        self.write(&[record], true)?;
        self.conf_state = cs;
        self.is_new = false;
        Ok(())
    }

    /// Stores a snapshot received from the leader, as raft-rs `MemStorage::apply_snapshot`
    /// does: every entry is dropped, the hard state's term becomes the larger of its own and
    /// the snapshot's, its commit the snapshot's index, and the conf state the snapshot's. A
    /// snapshot below the first index is [`RaftLogError::SnapshotOutOfDate`]. Durable (a new
    /// generation) before it returns.
    pub fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<()> {
        self.check_failed()?;
        let meta = snapshot.get_metadata();
        let first_index = self.first();
        if first_index > meta.index {
            return Err(RaftLogError::SnapshotOutOfDate {
                index: meta.index,
                first_index,
            });
        }
        let mut hard_state = self.hard_state.clone();
        hard_state.term = hard_state.term.max(meta.term);
        hard_state.commit = meta.index;
        let conf_state = meta.get_conf_state().clone();
        self.switch_generation(snapshot, hard_state, conf_state, Vec::new())
    }

    /// Takes a snapshot at `upto` (its term, the current conf state, and `snapshot_data`, the
    /// application's state at `upto`) and drops the entries up to and including it: the
    /// first index becomes `upto + 1` and `term(upto)` stays answered from the snapshot.
    /// `upto` at or below the current snapshot's index does nothing (as `MemStorage::compact`
    /// does for an index already compacted); past the last index or the commit index it is an
    /// error. The caller compacts at its applied index, whose conf state is the current one.
    /// Durable (a new generation, the old one's disk space released) before it returns.
    pub fn compact(&mut self, upto: u64, snapshot_data: Vec<u8>) -> Result<()> {
        self.check_failed()?;
        if upto <= self.snapshot.get_metadata().index {
            return Ok(());
        }
        let last_index = self.last();
        if upto > last_index {
            return Err(RaftLogError::CompactBeyondLast { upto, last_index });
        }
        if upto > self.hard_state.commit {
            return Err(RaftLogError::CompactBeyondCommit {
                upto,
                commit: self.hard_state.commit,
            });
        }
        let Some(term) = self.term_of(upto) else {
            unreachable!("snapshot index < upto <= last index: the entry is held");
        };
        let mut snapshot = Snapshot::default();
        snapshot.set_data(snapshot_data.into());
        let meta = snapshot.mut_metadata();
        meta.index = upto;
        meta.term = term;
        meta.set_conf_state(self.conf_state.clone());
        let keep_from = usize::try_from(upto + 1 - self.first()).unwrap_or(usize::MAX);
        let live = self.entries.get(keep_from..).unwrap_or_default().to_vec();
        self.switch_generation(
            snapshot,
            self.hard_state.clone(),
            self.conf_state.clone(),
            live,
        )
    }

    /// A clean stop: asks for a commit mark covering everything (so the next recovery can
    /// tell damage in the last records from a torn write) and waits for it.
    pub fn close(self) -> Result<()> {
        self.check_failed()?;
        let mut log = self.log();
        log.sync_now();
        log.flush(FLUSH_TIMEOUT)?;
        while log.poll_event().is_some() {}
        Ok(())
    }

    fn check_failed(&self) -> Result<()> {
        match &self.cell.borrow().failed {
            Some(why) => Err(RaftLogError::Failed(why.clone())),
            None => Ok(()),
        }
    }

    /// Writes a new generation holding `snapshot`, the states and `entries` (which must
    /// follow the snapshot), seals it, and releases every other generation.
    fn switch_generation(
        &mut self,
        snapshot: Snapshot,
        hard_state: HardState,
        conf_state: ConfState,
        entries: Vec<Entry>,
    ) -> Result<()> {
        let generation = self.cell.borrow_mut().take_generation();
        let generation_at = self.cell.borrow().appended;
        let mut records = Vec::with_capacity(entries.len() + 4);
        records.push((
            snapshot_shard(generation),
            &[][..],
            snapshot.write_to_bytes()?,
        ));
        records.push((
            state_shard(generation),
            KEY_CONF_STATE,
            conf_state.write_to_bytes()?,
        ));
        records.push((
            state_shard(generation),
            KEY_HARD_STATE,
            hard_state.write_to_bytes()?,
        ));
        for e in &entries {
            records.push((entries_shard(generation), &[][..], e.write_to_bytes()?));
        }
        // Last: a generation counts only once everything before the seal is on disk.
        records.push((
            state_shard(generation),
            KEY_SEAL,
            seal_payload(generation, self.group),
        ));
        self.write(&records, true)?;
        let old = self.generation;
        self.generation = generation;
        self.generation_at = generation_at;
        if let Some(group) = self.group {
            self.cell.borrow_mut().owners.insert(group, generation);
        }
        self.snapshot = snapshot;
        self.hard_state = hard_state;
        self.conf_state = conf_state;
        self.entries_bytes = data_bytes(&entries);
        self.entries = entries;
        self.is_new = false;
        tracing::debug!(
            old,
            generation,
            snapshot_index = self.snapshot.get_metadata().index,
            live_entries = self.entries.len(),
            "raft log switched generation"
        );
        self.release_other_generations(Some(old))
    }

    /// Releases the shards of every generation but the current one in a log of its own; in
    /// a [`SharedLog`], those of generation `old` (this group's previous one) only.
    fn release_other_generations(&mut self, old: Option<u32>) -> Result<()> {
        let current = self.generation;
        let released = if self.group.is_some() {
            let Some(old) = old else { return Ok(()) };
            self.log().release_shards(|id| generation_of(id) != old)
        } else {
            self.log().release_shards(|id| generation_of(id) == current)
        };
        match released {
            Ok(report) => {
                tracing::debug!(
                    shards = ?report.shards,
                    bytes_freed = report.bytes_freed,
                    "raft log released old generations"
                );
                Ok(())
            }
            Err(e) => Err(self.fail(e.into())),
        }
    }

    /// Appends `records` (shard, key, payload) in order and waits until all are stored:
    /// fdatasynced when `sync` or the mode is on_commit, written otherwise. Sizes are checked
    /// before anything is appended; any later failure fails the log.
    fn write(&mut self, records: &[(u32, &[u8], Vec<u8>)], sync: bool) -> Result<()> {
        let result = self.append_records(records).and_then(|shards| {
            self.wait(sync)?;
            self.check_stored(&shards, sync)
        });
        result.map_err(|e| self.fail(e))
    }

    /// Appends `records` in order (waiting for queued writes first where the pending bound is
    /// reached) and returns the shards they went to.
    fn append_records(&mut self, records: &[(u32, &[u8], Vec<u8>)]) -> Result<Vec<u32>> {
        for (_, key, payload) in records {
            felix_storage::frame::check_sizes(key.len(), payload.len())?;
        }
        let timestamp_us = now_unix_us();
        let mut shards: Vec<u32> = Vec::new();
        for (shard, key, payload) in records {
            let full = !self.log().can_append(key.len(), payload.len());
            if full {
                // The pending bound is reached: write what is queued first.
                self.wait(false)?;
            }
            let mut cell = self.cell.borrow_mut();
            let offset = cell.log.shard_offsets(*shard).map_or(0, |o| o.next);
            cell.log
                .append(*shard, offset, timestamp_us, key, payload)?;
            cell.appended += (key.len() + payload.len()) as u64 + FRAME_OVERHEAD_BYTES;
            drop(cell);
            if !shards.contains(shard) {
                shards.push(*shard);
            }
        }
        Ok(shards)
    }

    /// Whether the records appended to each shard up to its target offset are stored:
    /// fdatasynced when `sync` or the mode is on_commit, written otherwise. A shard the log
    /// no longer has was released by a generation switch, which stored everything before it.
    fn targets_stored(&self, targets: &[(u32, u64)], sync: bool) -> bool {
        let log = self.log();
        targets.iter().all(|&(shard, target)| {
            log.shard_offsets(shard).is_none_or(|o| {
                let stored = if sync || !self.periodic {
                    o.synced
                } else {
                    o.written
                };
                stored >= target
            })
        })
    }

    /// Checks that every record appended to `shards` is stored as [`RaftLog::write`] asked.
    fn check_stored(&self, shards: &[u32], sync: bool) -> Result<()> {
        for &shard in shards {
            let offsets = self.log().shard_offsets(shard);
            if let Some(o) = offsets {
                let stored = if sync || !self.periodic {
                    o.synced
                } else {
                    o.written
                };
                if stored != o.next {
                    return Err(RaftLogError::NotStored {
                        shard,
                        stored,
                        next: o.next,
                    });
                }
            }
        }
        Ok(())
    }

    /// Waits until everything appended is written, and fdatasynced when `sync` or the mode
    /// is on_commit; a rejected round is an error.
    fn wait(&mut self, sync: bool) -> Result<()> {
        if sync && self.periodic {
            // Asks for the fdatasync now (and a commit mark after it: one more small round,
            // paid only for term, vote and conf changes and generation switches). On_commit
            // logs sync every round anyway.
            self.log().sync_now();
        }
        let mut log = self.log();
        log.flush(FLUSH_TIMEOUT)?;
        let mut rejected = None;
        while let Some(event) = log.poll_event() {
            if let LogEvent::Rejected { error, .. } = event {
                rejected = Some(error);
            }
        }
        match rejected {
            Some(error) => Err(RaftLogError::Rejected(error)),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: RaftLogError) -> RaftLogError {
        let mut cell = self.cell.borrow_mut();
        tracing::error!(error = %e, dir = %cell.log.config().dir.display(), group = ?self.group, "raft log write failed; refusing further writes");
        if cell.failed.is_none() {
            cell.failed = Some(e.to_string());
        }
        e
    }
}

/// A write [`RaftLog::persist_begin`] started and not yet known stored.
#[derive(Debug)]
struct InFlight {
    /// Its number ([`RaftLog::persisted`]).
    number: u64,
    /// Each log shard it wrote to, with the shard's next offset after its records: stored
    /// once the shard's stored offset reaches it.
    targets: Vec<(u32, u64)>,
    /// Whether it must be fdatasynced (rather than written).
    sync: bool,
}

/// What a generation's state shard holds.
#[derive(Debug, Default)]
struct StateRecords {
    hard_state: Option<HardState>,
    conf_state: Option<ConfState>,
    sealed: bool,
    /// The group a [`SharedLog`]'s seal names.
    group: Option<u64>,
}

/// Every record of `shard`, in offset order, checked dense.
fn read_shard<B: Backend>(
    log: &Log<B>,
    shard: u32,
    mut each: impl FnMut(felix_storage::Record) -> Result<()>,
) -> Result<()> {
    let Some(offsets) = log.shard_offsets(shard) else {
        return Ok(());
    };
    let mut next = offsets.oldest;
    // Bounded: each pass reads at least one record until `next` reaches the shard's end.
    while next < offsets.next {
        let records = log.read(shard, next, READ_BATCH_RECORDS, READ_BATCH_BYTES)?;
        if records.is_empty() {
            return Err(RaftLogError::Corrupt(format!(
                "shard {shard} ends at offset {next}, below its next offset {}",
                offsets.next
            )));
        }
        for record in records {
            if record.offset != next {
                return Err(RaftLogError::Corrupt(format!(
                    "shard {shard}: offset {} follows {} (skipped records)",
                    record.offset,
                    next.wrapping_sub(1)
                )));
            }
            next += 1;
            each(record)?;
        }
    }
    Ok(())
}

fn read_state<B: Backend>(log: &Log<B>, generation: u32) -> Result<StateRecords> {
    let mut state = StateRecords::default();
    let shard = state_shard(generation);
    read_shard(log, shard, |record| {
        match &record.key[..] {
            KEY_HARD_STATE => {
                state.hard_state = Some(HardState::parse_from_bytes(&record.payload)?)
            }
            KEY_CONF_STATE => {
                state.conf_state = Some(ConfState::parse_from_bytes(&record.payload)?)
            }
            KEY_SEAL => {
                let payload = &record.payload[..];
                if payload.get(..4) != Some(&generation.to_le_bytes()[..])
                    || !matches!(payload.len(), 4 | 12)
                {
                    return Err(RaftLogError::Corrupt(format!(
                        "shard {shard}: the seal names another generation than {generation}"
                    )));
                }
                state.group = payload
                    .get(4..12)
                    .and_then(|group| group.try_into().ok())
                    .map(u64::from_le_bytes);
                state.sealed = true;
            }
            other => {
                return Err(RaftLogError::Corrupt(format!(
                    "shard {shard} offset {}: unknown state key {other:?}",
                    record.offset
                )));
            }
        }
        Ok(())
    })?;
    Ok(state)
}

fn read_snapshot<B: Backend>(log: &Log<B>, generation: u32) -> Result<Snapshot> {
    let shard = snapshot_shard(generation);
    let Some(offsets) = log.shard_offsets(shard) else {
        return Ok(Snapshot::default());
    };
    if offsets.next == offsets.oldest {
        return Ok(Snapshot::default());
    }
    // Only the last record counts (a generation holds one).
    let records = log.read(shard, offsets.next - 1, 1, READ_BATCH_BYTES)?;
    match records.last() {
        Some(record) if record.offset == offsets.next - 1 => {
            Ok(Snapshot::parse_from_bytes(&record.payload)?)
        }
        _ => Err(RaftLogError::Corrupt(format!(
            "shard {shard}: the snapshot record at offset {} is missing",
            offsets.next - 1
        ))),
    }
}

/// Replays the entries shard of `generation` with the Raft rule (an entry at `i` replaces `i`
/// and everything after it) on top of a snapshot at `snapshot_index`.
fn read_entries<B: Backend>(
    log: &Log<B>,
    generation: u32,
    snapshot_index: u64,
) -> Result<Vec<Entry>> {
    let mut entries: Vec<Entry> = Vec::new();
    let shard = entries_shard(generation);
    read_shard(log, shard, |record| {
        let entry = Entry::parse_from_bytes(&record.payload)?;
        let first = snapshot_index + 1;
        let last = entries.last().map_or(snapshot_index, |e| e.index);
        if entry.index < first || entry.index > last + 1 {
            return Err(RaftLogError::Corrupt(format!(
                "shard {shard} offset {}: entry index {} outside {first}..={}",
                record.offset,
                entry.index,
                last + 1
            )));
        }
        let keep = usize::try_from(entry.index - first).unwrap_or(usize::MAX);
        entries.truncate(keep);
        entries.push(entry);
        Ok(())
    })?;
    Ok(entries)
}

fn data_bytes(entries: &[Entry]) -> u64 {
    entries.iter().map(|e| e.data.len() as u64).sum()
}

fn store_error(e: raft::StorageError) -> raft::Error {
    raft::Error::Store(e)
}

impl<B: Backend> raft::Storage for RaftLog<B> {
    /// The hard state and conf state as last persisted.
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state.clone(),
            self.conf_state.clone(),
        ))
    }

    /// Entries `[low, high)`, limited to `max_size` bytes (at least one entry), as
    /// `MemStorage::entries`: `low` below the first index is `Compacted`. Where `MemStorage`
    /// panics (`high` past the last index + 1) this returns `Unavailable`. Never
    /// asynchronous: every live entry is in memory.
    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let first = self.first();
        if low < first {
            return Err(store_error(raft::StorageError::Compacted));
        }
        if high > self.last() + 1 {
            return Err(store_error(raft::StorageError::Unavailable));
        }
        if low >= high {
            return Ok(Vec::new());
        }
        let lo = usize::try_from(low - first).unwrap_or(usize::MAX);
        let hi = usize::try_from(high - first).unwrap_or(usize::MAX);
        let mut entries = self
            .entries
            .get(lo..hi)
            .ok_or_else(|| store_error(raft::StorageError::Unavailable))?
            .to_vec();
        raft::util::limit_size(&mut entries, max_size.into());
        Ok(entries)
    }

    /// The term of entry `idx`, as `MemStorage::term`: the snapshot's index answers with the
    /// snapshot's term, below the first index is `Compacted`, past the last `Unavailable`.
    fn term(&self, idx: u64) -> raft::Result<u64> {
        let meta = self.snapshot.get_metadata();
        if idx == meta.index {
            return Ok(meta.term);
        }
        if idx < self.first() {
            return Err(store_error(raft::StorageError::Compacted));
        }
        self.term_of(idx)
            .ok_or_else(|| store_error(raft::StorageError::Unavailable))
    }

    /// The snapshot's index + 1, or the first live entry's index.
    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first())
    }

    /// The last entry's index, or the snapshot's index when no entry is live.
    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    /// The latest stored snapshot (with its data). Unlike `MemStorage`, which fabricates a
    /// data-less snapshot at the commit index, a snapshot below `request_index` (or none at
    /// all) is `SnapshotTemporarilyUnavailable`: the application compacts, then raft-rs asks
    /// again.
    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let index = self.snapshot.get_metadata().index;
        if index == 0 || index < request_index {
            return Err(store_error(
                raft::StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(self.snapshot.clone())
    }
}

/// The node's view of the store: a write is stored when it returns (module documentation,
/// "Durability"), except the commit index, carried by the next write.
impl<B: Backend> crate::node::LogStore for RaftLog<B> {
    fn bootstrap(&mut self, conf_state: ConfState) -> std::result::Result<(), NodeError> {
        self.set_conf_state(conf_state).map_err(node_error)
    }

    fn persist(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> std::result::Result<(), NodeError> {
        RaftLog::persist(self, entries, hard_state).map_err(node_error)
    }

    fn persist_begin(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> std::result::Result<u64, NodeError> {
        RaftLog::persist_begin(self, entries, hard_state).map_err(node_error)
    }

    fn persisted(&mut self) -> std::result::Result<u64, NodeError> {
        RaftLog::persisted(self).map_err(node_error)
    }

    fn persist_end(&mut self) -> std::result::Result<(), NodeError> {
        RaftLog::persist_end(self).map_err(node_error)
    }

    fn persist_commit(&mut self, commit: u64) -> std::result::Result<(), NodeError> {
        // Carried by the next write (`note_commit`): a restart re-applies up to the stored
        // commit at once, and learns the rest from the leader.
        self.note_commit(commit).map_err(node_error)
    }

    fn apply_snapshot(&mut self, snapshot: Snapshot) -> std::result::Result<(), NodeError> {
        RaftLog::apply_snapshot(self, snapshot).map_err(node_error)
    }

    fn compact(&mut self, upto: u64, data: Vec<u8>) -> std::result::Result<(), NodeError> {
        RaftLog::compact(self, upto, data).map_err(node_error)
    }

    fn live_bytes(&self) -> u64 {
        RaftLog::live_bytes(self)
    }

    fn relocation_due(&self) -> bool {
        RaftLog::relocation_due(self)
    }

    fn drive(&mut self, now: Instant) -> std::result::Result<(), NodeError> {
        self.tick(now).map_err(node_error)
    }

    fn flush(&mut self) -> std::result::Result<(), NodeError> {
        RaftLog::flush(self).map_err(node_error)
    }
}

fn node_error(error: RaftLogError) -> NodeError {
    NodeError::Store(error.to_string())
}
