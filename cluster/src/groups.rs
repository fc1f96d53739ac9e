//! The replicated shards a member holds: one Raft group per shard of each durable stream
//! placed on it (`placement.rs`), each a [`Node`] applying [`ShardState`] on its Raft log, all
//! groups' Raft logs in one shared Felix log per fsync mode under
//! `<data_dir>/cluster/shards/{on_commit,periodic}/` (`raft_log.rs`, [`SharedLog`]: one write
//! and one fdatasync per pass for every group). The service (`service.rs`) owns a
//! [`Groups`], reconciles it with the control plane after every change (a group starts when
//! the stream's creation is applied here and stops, its Raft log released, when the deletion
//! is), ticks and drives every group, and routes peer frames to them by group id.
//!
//! Leadership follows placement: a group elects whichever replica Raft picks (after a failure,
//! any live replica), and its leader hands leadership back to the placed leader once that one
//! is connected and caught up, so each stream's leaders stay spread.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use felix_storage::{Backend, StorageError, SystemBackend};
use raft::prelude::Message;
use serde::{Deserialize, Serialize};

use crate::control::{ControlState, Fsync, StreamKind};
use crate::memory::{DataFrame, Fetch, FetchRefusal, Fetched};
use crate::node::{Machine, Node, NodeConfig, NodeError, Output, PeerProgress, Role};
use crate::publish::{Producer, PublishAnswer, PublishError};
use crate::raft_log::{RaftLog, SharedLog, raft_log_config};
use crate::records::{CatchUp, RecordsConfig, ShardRecords, records_dir};
use crate::shard::{ReadError, ShardApplied, ShardRecord, ShardState};

/// Group id 0 is the control plane's; a shard's group id is its stream's incarnation (the
/// control-plane index that created it) shifted over the shard number (shards < 2^16).
pub const CONTROL_GROUP: u64 = 0;

/// Segment size of the shard groups' shared Raft logs (the records live in them), and their
/// largest write round (at most half a segment, `storage/src/config.rs`).
const SHARD_LOG_SEGMENT_BYTES: u64 = 4 << 20;
const SHARD_LOG_ROUND_BYTES: usize = 1 << 20;

/// A shard groups' Raft log in `dir` (on_commit; the caller sets periodic where it applies).
fn shard_log_config(dir: &Path) -> felix_storage::LogConfig {
    let mut config = raft_log_config(dir);
    config.segment_bytes = SHARD_LOG_SEGMENT_BYTES;
    config.max_round_bytes = SHARD_LOG_ROUND_BYTES;
    config
}

/// The shared Raft logs' directories under the member's `shards` directory, by fsync mode
/// (a group's own directory there, named by its id, is an earlier release's layout and is
/// moved into the shared log when the group starts).
const SHARED_ON_COMMIT_DIR: &str = "on_commit";
const SHARED_PERIODIC_DIR: &str = "periodic";

/// The directory name of `fsync`'s shared Raft log.
fn shared_dir_name(fsync: Fsync) -> &'static str {
    match fsync {
        Fsync::OnCommit => SHARED_ON_COMMIT_DIR,
        Fsync::Periodic => SHARED_PERIODIC_DIR,
    }
}

/// Whether `dir` is one of a member's shared shard-group Raft logs
/// (`<data_dir>/cluster/shards/{on_commit,periodic}`) rather than the control plane's or a
/// record log: the simulations hold these logs' rounds, so writes stay in flight.
#[must_use]
pub fn is_shared_raft_log(dir: &Path) -> bool {
    dir.parent()
        .and_then(Path::file_name)
        .is_some_and(|name| name == "shards")
        && dir
            .file_name()
            .is_some_and(|name| name == SHARED_ON_COMMIT_DIR || name == SHARED_PERIODIC_DIR)
}

/// A replica this many entries or fewer behind the leader counts as in sync.
pub const IN_SYNC_LAG_MAX: u64 = 1_000;

/// Ticks between two checks whether a group should hand leadership to its placed leader.
const TRANSFER_CHECK_TICKS: u64 = 10;

/// Ticks between two retention passes over the record logs (1 s).
const RETENTION_TICKS: u64 = 10;

/// Ticks a member waits for a peer's answer to a fetch of missing records before it asks
/// again (the next replica in turn).
const HOLE_FETCH_RETRY_TICKS: u64 = 5;
/// Records and bytes of keys and payloads asked per fetch of missing records.
const HOLE_FETCH_RECORDS: u32 = 4_096;
const HOLE_FETCH_BYTES: u32 = 1 << 20;

/// A replica heard from within this many ticks (3 s: fifteen heartbeats) counts as alive.
/// raft-rs's own `recent_active` flag is cleared at every election timeout and set again by
/// the next answer, so a sample of it right after the clearing would call live replicas dead.
const ALIVE_TICKS: u64 = 30;

/// The group id of shard `shard` of the stream created at control-plane index `incarnation`.
#[must_use]
pub fn group_id(incarnation: u64, shard: u32) -> u64 {
    (incarnation << 16) | u64::from(shard)
}

/// One of a member's shared Raft logs (`raft_log.rs`, [`SharedLog`]) as `felix cluster
/// status` and `/metrics` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaftLogStatus {
    /// The acknowledgement mode of its groups' streams.
    pub fsync: Fsync,
    /// Bytes of its segment files (every group's entries, states and snapshots).
    pub bytes: u64,
    /// Groups with a generation in it.
    pub groups: usize,
}

/// One shard group as `felix cluster status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardStatus {
    pub stream: String,
    pub shard: u32,
    pub group: u64,
    /// The member placement chose to lead the shard.
    pub placed_leader: u64,
    /// The leader this member knows of, if any.
    pub leader: Option<u64>,
    pub role: Role,
    pub term: u64,
    pub commit: u64,
    /// The shard's next offset here: every offset below is committed and applied.
    pub next_offset: u64,
    /// The oldest offset this member's copy still holds (older ones were deleted by the
    /// record log's retention).
    #[serde(default)]
    pub oldest_offset: u64,
    /// Offsets below are in this member's record log and fdatasynced (`records.rs`).
    #[serde(default)]
    pub recorded_offset: u64,
    /// The Raft log is compacted up to this index (its entries before are in the snapshot).
    #[serde(default)]
    pub snapshot_index: u64,
    /// Bytes of this member's record log files.
    #[serde(default)]
    pub record_log_bytes: u64,
    /// Bytes of the entries this group keeps in the member's shared Raft log behind its
    /// snapshot (kept in memory too): what its next compaction releases. Bounded by
    /// FELIX_CLUSTER_RAFT_COMPACT_ENTRIES and 64 MiB; growing past that, the group cannot
    /// compact.
    #[serde(default)]
    pub raft_log_entry_bytes: u64,
    /// Where this member's record log misses records it fetches from a peer (it fell
    /// behind a compaction), if it does.
    #[serde(default)]
    pub fetching_from: Option<u64>,
    pub replicas: Vec<u64>,
    /// On the leader: each replica's progress.
    pub progress: Vec<PeerProgress>,
    /// On the leader: fewer replicas than placed are active and in sync.
    pub under_replicated: bool,
    /// This member's publishes into the shard not applied yet (`publish.rs`).
    #[serde(default)]
    pub pending: usize,
    /// When this member's copy counts an entry as stored (its log's mode).
    #[serde(default)]
    pub fsync: Fsync,
}

struct Group<B: Backend> {
    stream: String,
    shard: u32,
    placed_leader: u64,
    replicas: Vec<u64>,
    node: Node<RaftLog<B>, ShardState>,
    /// The tick each replica was last heard from in this group.
    heard: BTreeMap<u64, u64>,
    /// This member's publishes into the shard (`publish.rs`).
    producer: Producer,
    /// The shard's committed records on this member (`records.rs`).
    records: ShardRecords<B>,
    /// A compaction waiting for the record log's fdatasync: the state taken at its index.
    compact_point: Option<CompactPoint>,
    /// Records missing from the record log that a peer is asked for.
    hole: Option<Hole>,
    /// The leader this member last knew of (a change re-proposes the pending batches).
    leader: Option<u64>,
    /// As this group's leader, when followers not yet sent the commit index
    /// ([`Node::commit_untold`]) are told it: [`COMMIT_TELL_DELAY`] after that was first
    /// seen, unless an append carried it first.
    tell_due: Option<std::time::Instant>,
}

/// How long a leader waits for an append to carry a new commit index to its followers before
/// it sends heartbeats that do ([`NodeConfig::lazy_commit`]). Under load the next batch's
/// append always comes first, so a commit costs no message of its own (raft-rs's eager mode
/// sends one to every follower, and each answers); a follower's subscribers see a lone
/// publish at most this much later, and a publish forwarded by a follower is not delayed
/// (its commit is broadcast at once).
pub const COMMIT_TELL_DELAY: std::time::Duration = std::time::Duration::from_millis(2);

/// A compaction that waits until the record log has fdatasynced the records before
/// `next_offset` (the shard's next offset at `index`).
struct CompactPoint {
    index: u64,
    next_offset: u64,
    data: Vec<u8>,
}

/// A run of offsets the member's record log misses and its Raft log no longer holds.
struct Hole {
    from: u64,
    /// The fetch asked last, and the tick it was asked at (none yet: ask now).
    request: u64,
    asked_at: Option<u64>,
    /// Fetches asked so far: the replicas are asked in turn, the leader first.
    attempts: u64,
}

/// Answers this member's publishes that `output` applied and hands its messages to `send`
/// (the member queues them; how each went comes back through [`Groups::report_snapshot`] and
/// [`Groups::report_unreachable`]).
fn deliver<B: Backend>(
    id: u64,
    group: &mut Group<B>,
    output: Output<ShardApplied>,
    send: &mut dyn FnMut(u64, &Message),
) {
    for applied in &output.applied {
        group.producer.applied(applied);
    }
    for message in output.messages {
        send(id, &message);
    }
}

/// Opens the storage backend of each log a member starts (a shard group's Raft log, a record
/// log), given the log's directory: the system backend in a broker, the fault backend in the
/// simulation (which keeps the handle to cut the power under that directory's log).
pub type OpenBackend<B> = Box<dyn FnMut(&Path) -> Result<B, StorageError>>;

/// The system backend for every log (FELIX_STORAGE_IO_URING picks io_uring or pwrite).
#[must_use]
pub fn system_backends() -> OpenBackend<SystemBackend> {
    Box::new(|_| SystemBackend::open(felix_storage::BackendChoice::from_env()?))
}

/// The shard groups of this member.
pub struct Groups<B: Backend = SystemBackend> {
    id: u64,
    /// This run of the member (start time in nanoseconds): its producers' ids.
    boot: u64,
    dir: PathBuf,
    groups: BTreeMap<u64, Group<B>>,
    ticks: u64,
    /// Where the record logs live (`<data_dir>/cluster/records/<group>/`) and how they are kept.
    records_dir: PathBuf,
    records_config: RecordsConfig,
    /// Fetches of missing records to send to peers, by member.
    fetches: Vec<(u64, DataFrame)>,
    next_request: u64,
    open_backend: OpenBackend<B>,
    /// Fixed election timeouts in ticks for every group started here ([`Groups::fix_timeouts`]).
    fixed_election_tick: Option<usize>,
    /// The groups' Raft logs: one Felix log per fsync mode, opened when a group of that mode
    /// first starts (`raft_log.rs`, [`SharedLog`]): a pass writes and fdatasyncs each once.
    on_commit: Option<SharedLog<B>>,
    periodic: Option<SharedLog<B>>,
    /// Groups found on disk at the first reconcile (in a shared log, a record log's or an
    /// earlier release's directory) and not running since: each is released once the control
    /// plane has applied its creation and still has no such stream ([`Groups::sweep_orphans`]).
    /// `None` until that first reconcile.
    unclaimed: Option<BTreeSet<u64>>,
    /// Bumped whenever a group starts or stops: [`Groups::wake_fds`] changed.
    wake_version: u64,
    /// Peers' fetches of records whose read waits for the disk (`records.rs`, "Holes"):
    /// answered once the record log's reader thread fetched the bytes.
    fetches_waiting: Vec<(u64, Fetch)>,
}

impl<B: Backend> std::fmt::Debug for Groups<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("id", &self.id)
            .field("groups", &self.groups.len())
            .finish_non_exhaustive()
    }
}

impl Groups<SystemBackend> {
    /// [`Groups::with_backends`] on the system backend.
    #[must_use]
    pub fn new(
        id: u64,
        boot: u64,
        dir: PathBuf,
        records_dir: PathBuf,
        records: RecordsConfig,
    ) -> Groups {
        Groups::with_backends(id, boot, dir, records_dir, records, system_backends())
    }
}

impl<B: Backend> Groups<B> {
    /// No groups yet; their Raft logs go under `dir`, their record logs under `records_dir`,
    /// each on a backend `open_backend` opens. `boot` tells this run of the member from its
    /// earlier ones (its publishes' producer ids differ per run). Groups of periodic streams,
    /// and every record log, fdatasync every `records.fsync_interval`.
    #[must_use]
    pub fn with_backends(
        id: u64,
        boot: u64,
        dir: PathBuf,
        records_dir: PathBuf,
        records: RecordsConfig,
        open_backend: OpenBackend<B>,
    ) -> Groups<B> {
        Groups {
            id,
            boot,
            dir,
            groups: BTreeMap::new(),
            ticks: 0,
            records_dir,
            records_config: records,
            fetches: Vec::new(),
            next_request: 1,
            open_backend,
            fixed_election_tick: None,
            on_commit: None,
            periodic: None,
            unclaimed: None,
            wake_version: 0,
            fetches_waiting: Vec::new(),
        }
    }

    /// The shared Raft log of `fsync`'s groups, opened (and recovered) on first use.
    fn shared_log(&mut self, fsync: Fsync) -> Result<&SharedLog<B>, NodeError> {
        let slot = match fsync {
            Fsync::OnCommit => &mut self.on_commit,
            Fsync::Periodic => &mut self.periodic,
        };
        if slot.is_none() {
            let dir = self.dir.join(shared_dir_name(fsync));
            let mut config = shard_log_config(&dir);
            if fsync == Fsync::Periodic {
                config.fsync = felix_storage::FsyncMode::Periodic {
                    interval: self.records_config.fsync_interval,
                };
            }
            let backend =
                (self.open_backend)(&dir).map_err(|error| NodeError::Store(error.to_string()))?;
            let shared = SharedLog::open(config, backend)
                .map_err(|error| NodeError::Store(format!("{}: {error}", dir.display())))?;
            tracing::info!(
                dir = %dir.display(),
                groups = shared.groups().len(),
                "shard groups' raft log opened"
            );
            *slot = Some(shared);
        }
        Ok(slot.as_ref().expect("opened above"))
    }

    /// Opens group `group`'s Raft log in its mode's shared log, moving a log an earlier
    /// release kept in the group's own directory into it first.
    fn open_group_log(&mut self, group: u64, fsync: Fsync) -> Result<RaftLog<B>, NodeError> {
        let store_error = |error: &dyn std::fmt::Display| {
            NodeError::Store(format!("shard group {group}'s raft log: {error}"))
        };
        let legacy_dir = self.dir.join(group.to_string());
        let legacy = if legacy_dir.is_dir() && !self.shared_log(fsync)?.holds(group) {
            let backend = (self.open_backend)(&legacy_dir).map_err(|e| store_error(&e))?;
            let legacy = RaftLog::open_with(shard_log_config(&legacy_dir), backend);
            Some(legacy.map_err(|e| store_error(&e))?)
        } else {
            None
        };
        let shared = self.shared_log(fsync)?;
        let log = match legacy {
            Some(legacy) => {
                let log = RaftLog::import(shared, group, legacy).map_err(|e| store_error(&e))?;
                tracing::info!(group, from = %legacy_dir.display(), "a shard group's raft log moved into the shared log");
                log
            }
            None => RaftLog::open_shared(shared, group).map_err(|e| store_error(&e))?,
        };
        if legacy_dir.is_dir()
            && let Err(error) = std::fs::remove_dir_all(&legacy_dir)
        {
            tracing::warn!(group, %error, "cannot remove a shard group's moved raft log");
        }
        Ok(log)
    }

    /// Every group started from now on times elections out after exactly `ticks` ticks
    /// instead of a random draw by raft-rs's own generator: a simulation draws `ticks` per
    /// member from its seed, so its runs replay exactly.
    pub fn fix_timeouts(&mut self, ticks: usize) {
        self.fixed_election_tick = Some(ticks);
    }

    /// Starts the groups of durable shards placed on this member that are not running, and
    /// stops (removing their logs) those whose stream is gone.
    pub fn reconcile(&mut self, state: &ControlState) -> Result<(), NodeError> {
        let mut wanted = BTreeMap::new();
        for stream in state.streams.values() {
            if stream.kind != StreamKind::Durable {
                continue;
            }
            for (shard, placement) in stream.shards.iter().enumerate() {
                if placement.replicas.contains(&self.id) {
                    let shard = u32::try_from(shard).expect("shards below 2^32");
                    wanted.insert(
                        group_id(stream.incarnation, shard),
                        (stream.name.clone(), shard, placement, stream.fsync),
                    );
                }
            }
        }
        let gone: Vec<u64> = self
            .groups
            .keys()
            .filter(|group| !wanted.contains_key(group))
            .copied()
            .collect();
        for group in gone {
            if let Some(mut stopped) = self.groups.remove(&group) {
                self.wake_version += 1;
                stopped.producer.fail_all(&PublishError::NoSuchStream {
                    stream: stopped.stream.clone(),
                });
                if let Err(error) = stopped.node.into_store().release() {
                    tracing::warn!(group, %error, "cannot release a deleted shard's raft log");
                }
                let records = stopped.records.dir().to_path_buf();
                drop(stopped.records);
                if let Err(error) = std::fs::remove_dir_all(&records) {
                    tracing::warn!(group, %error, "cannot remove a deleted shard's record log");
                }
            }
        }
        for (group, (stream, shard, placement, fsync)) in wanted {
            if self.groups.contains_key(&group) {
                continue;
            }
            let store = self.open_group_log(group, fsync)?;
            let store_error = |error: StorageError| NodeError::Store(error.to_string());
            let records_at = records_dir(&self.records_dir, group);
            let backend = (self.open_backend)(&records_at).map_err(store_error)?;
            let records = ShardRecords::open_with(&records_at, &self.records_config, backend)
                .map_err(store_error)?;
            let mut config = NodeConfig::new(self.id, placement.replicas.clone());
            if let Some(ticks) = self.fixed_election_tick {
                config.election_tick = ticks;
                config.randomized_timeouts = false;
            }
            config.compact_after = self.records_config.compact_after;
            config.lazy_commit = true;
            let node = Node::with_machine(&config, store, ShardState::default())?;
            tracing::info!(
                stream,
                shard,
                group,
                fsync = fsync.name(),
                "replicated shard started"
            );
            self.wake_version += 1;
            self.groups.insert(
                group,
                Group {
                    stream,
                    shard,
                    placed_leader: placement.leader,
                    replicas: placement.replicas.clone(),
                    node,
                    heard: BTreeMap::new(),
                    producer: Producer::new(self.id, self.boot),
                    records,
                    compact_point: None,
                    hole: None,
                    leader: None,
                    tell_due: None,
                },
            );
        }
        self.sweep_orphans(state)
    }

    /// Releases what this member keeps of groups whose stream was deleted while it was down:
    /// it never replays such a stream's creation (the control plane's snapshot has no trace of
    /// it), so the group never starts and [`Groups::reconcile`] never stops it. A group found
    /// on disk is released once the control plane has applied the index that created it (the
    /// group id's incarnation) and the group still does not run: the deletion is then
    /// committed. A group created after what this member has applied so far waits: it may be
    /// one this member is about to start again, and its Raft log must not go.
    fn sweep_orphans(&mut self, state: &ControlState) -> Result<(), NodeError> {
        let unclaimed = match self.unclaimed.take() {
            Some(unclaimed) => unclaimed,
            None => self.groups_on_disk()?,
        };
        let mut waiting = BTreeSet::new();
        for group in unclaimed {
            if self.groups.contains_key(&group) {
                continue;
            }
            if group >> 16 > state.applied {
                waiting.insert(group);
                continue;
            }
            for shared in [&self.on_commit, &self.periodic].into_iter().flatten() {
                shared.release_orphan(group).map_err(|error| {
                    NodeError::Store(format!("release deleted shard group {group}: {error}"))
                })?;
            }
            for dir in [
                records_dir(&self.records_dir, group),
                self.dir.join(group.to_string()),
            ] {
                if dir.is_dir()
                    && let Err(error) = std::fs::remove_dir_all(&dir)
                {
                    tracing::warn!(group, dir = %dir.display(), %error, "cannot remove a deleted shard's directory");
                }
            }
            tracing::info!(
                group,
                "released a shard group whose stream was deleted while this member was down"
            );
        }
        self.unclaimed = Some(waiting);
        Ok(())
    }

    /// The groups this member keeps something of on disk (a generation in a shared Raft log,
    /// a record log, an earlier release's directory) that do not run.
    fn groups_on_disk(&mut self) -> Result<BTreeSet<u64>, NodeError> {
        let mut found = BTreeSet::new();
        for fsync in [Fsync::OnCommit, Fsync::Periodic] {
            if self.dir.join(shared_dir_name(fsync)).is_dir() {
                found.extend(self.shared_log(fsync)?.groups());
            }
        }
        found.extend(numbered_dirs(&self.records_dir));
        found.extend(numbered_dirs(&self.dir));
        found.retain(|group| *group != CONTROL_GROUP && !self.groups.contains_key(group));
        Ok(found)
    }

    /// One tick of every group at time `now`: its log's background work (queued writes, a
    /// periodic fdatasync due; an error there is the log's failure, as in
    /// [`Groups::advance`]); callers of publishes past their deadline are answered and
    /// pending batches due are proposed again (`publish.rs`); every
    /// [`TRANSFER_CHECK_TICKS`], a leader that is not the placed one hands leadership to it
    /// when it is connected and caught up.
    pub fn tick(&mut self, connected: &[u64], now: std::time::Instant) -> Result<(), NodeError> {
        self.ticks += 1;
        let check = self.ticks.is_multiple_of(TRANSFER_CHECK_TICKS);
        let retention = self.ticks.is_multiple_of(RETENTION_TICKS);
        for (id, group) in &mut self.groups {
            group.node.drive_store(now)?;
            group
                .records
                .drive(now)
                .map_err(|error| records_failed(*id, &error))?;
            if retention {
                group
                    .records
                    .apply_retention()
                    .map_err(|error| records_failed(*id, &error))?;
            }
            group.node.tick();
            let leader = group.node.leader();
            if leader != group.leader {
                group.leader = leader;
                if leader.is_some() {
                    group.producer.leader_changed();
                }
            }
            for (sequence, data) in group.producer.due(self.ticks, now) {
                if group.node.propose_data(data).is_err() {
                    // No leader known yet: the rest would be refused too.
                    break;
                }
                group.producer.proposed(sequence, self.ticks);
            }
            if check && group.node.is_leader() && group.placed_leader != self.id {
                let status = group.node.status();
                let alive = group
                    .heard
                    .get(&group.placed_leader)
                    .is_some_and(|at| self.ticks - at <= ALIVE_TICKS);
                let caught_up = status
                    .peers
                    .iter()
                    .any(|p| p.id == group.placed_leader && p.lag == 0);
                if caught_up && alive && connected.contains(&group.placed_leader) {
                    group.node.transfer_leader(group.placed_leader);
                }
            }
        }
        Ok(())
    }

    /// A peer's message for `group`; dropped when the group is not running here (yet: Raft
    /// sends again).
    pub fn step(&mut self, group: u64, message: Message) {
        let Some(group) = self.groups.get_mut(&group) else {
            return;
        };
        group.heard.insert(message.from, self.ticks);
        if let Err(error) = group.node.step(message) {
            tracing::debug!(%error, "a shard group refused a peer message");
        }
    }

    /// Drives the groups without waiting for their writes (`member.rs` calls it after every
    /// input and completion, then [`Groups::end_advance`]): the shared logs' finished rounds are
    /// reaped, each group takes the writes found stored (its held messages, votes and append
    /// responses, go to `send`; a leader counts its own entries), then every group with
    /// something ready sends what may leave now (a leader's appends go out before its own
    /// write is done, as Raft allows), applies what is committed and appends its write
    /// ([`Node::start`]); last, each shared log starts one round and one fdatasync for all
    /// the groups' writes ([`SharedLog::start_rounds`]; what completes later is announced by
    /// the logs' eventfds). Returns whether work is left that no completion will announce
    /// (the caller drives again at once). Each message goes to `send` with its group id as soon
    /// as it may leave (a snapshot's fate and an unreachable peer are reported to the group
    /// by the member once the send is done); this member's publishes that were applied are
    /// answered.
    pub fn pump(
        &mut self,
        now: std::time::Instant,
        send: &mut dyn FnMut(u64, &Message),
    ) -> Result<bool, NodeError> {
        self.poll_shared(now)?;
        let mut again = false;
        for (id, group) in &mut self.groups {
            let mut output = Output::default();
            again |= !group.node.pump(&mut output)?;
            deliver(*id, group, output, send);
        }
        for shared in self.open_shared() {
            shared
                .start_rounds(now)
                .map_err(|error| NodeError::Store(error.to_string()))?;
        }
        Ok(again)
    }

    /// The shared Raft logs opened so far.
    fn open_shared(&self) -> impl Iterator<Item = &SharedLog<B>> {
        [&self.on_commit, &self.periodic].into_iter().flatten()
    }

    /// Reaps the shared logs' finished rounds and starts a round for what the groups appended
    /// ([`SharedLog::poll`]); whether a round was reaped.
    fn poll_shared(&self, now: std::time::Instant) -> Result<bool, NodeError> {
        let mut reaped = false;
        for shared in self.open_shared() {
            reaped |= shared
                .poll(now)
                .map_err(|error| NodeError::Store(error.to_string()))?;
        }
        Ok(reaped)
    }

    /// Copies of the shared logs' eventfds (readable when a round completes: drive the
    /// groups then) and of the record logs' (readable when a read's bytes were fetched:
    /// [`Groups::poll_reads`] then). The set changes when a group starts or stops
    /// ([`Groups::wake_version`]).
    pub fn wake_fds(&self) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
        self.open_shared()
            .map(SharedLog::wake_fd)
            .chain(self.groups.values().map(|group| group.records.wake_fd()))
            .collect()
    }

    /// Changes whenever [`Groups::wake_fds`] does.
    #[must_use]
    pub fn wake_version(&self) -> u64 {
        self.wake_version
    }

    /// Takes in what the record logs' reader threads fetched, then answers the peers' fetches
    /// that waited for it (their frames go out with [`Groups::take_fetches`]). Never blocks.
    pub fn poll_reads(&mut self) {
        let mut arrived = 0;
        for group in self.groups.values() {
            if group.records.reads_outstanding() > 0 {
                arrived += group.records.poll_reads();
            }
        }
        if arrived == 0 || self.fetches_waiting.is_empty() {
            return;
        }
        for (peer, fetch) in std::mem::take(&mut self.fetches_waiting) {
            self.answer_fetch(peer, fetch);
        }
    }

    /// After the passes: records what the groups applied in their record logs, compacts
    /// the groups due (behind what their record logs fdatasynced; a record log's misses are
    /// asked of peers by [`Groups::take_fetches`]).
    pub fn end_advance(&mut self, now: std::time::Instant) -> Result<(), NodeError> {
        for (id, group) in &mut self.groups {
            record(*id, group, now)?;
            compact(group)?;
            if group.node.commit_untold() {
                group.tell_due.get_or_insert(now + COMMIT_TELL_DELAY);
            } else {
                group.tell_due = None;
            }
        }
        Ok(())
    }

    /// When the earliest leader's followers are due to be told its commit index
    /// ([`Groups::tell_commits`]).
    #[must_use]
    pub fn commit_due(&self) -> Option<std::time::Instant> {
        self.groups
            .values()
            .filter_map(|group| group.tell_due)
            .min()
    }

    /// Leaders whose followers have waited [`COMMIT_TELL_DELAY`] for a commit index send it
    /// (heartbeats, out with the next pass).
    pub fn tell_commits(&mut self, now: std::time::Instant) {
        for group in self.groups.values_mut() {
            if group.tell_due.is_some_and(|due| due <= now) {
                group.node.tell_commit();
                group.tell_due = None;
            }
        }
    }

    /// Writes what every group's Raft log left queued and waits for it (a clean close); a
    /// group whose log fails is logged and the others still flushed.
    pub fn flush(&mut self) {
        for (id, group) in &mut self.groups {
            if let Err(error) = group.node.flush_store() {
                tracing::warn!(group = id, %error, "a shard group's log could not be flushed at close");
            }
        }
    }

    /// Publishes a batch of records into shard group `group` (`publish.rs`): `answer` is
    /// called once, with the records' offsets once the batch is applied here, or with why not
    /// (at the latest at `deadline`). Call [`Groups::advance`] next.
    pub fn publish(
        &mut self,
        group: u64,
        records: Vec<ShardRecord>,
        deadline: std::time::Instant,
        timeout: std::time::Duration,
        answer: PublishAnswer,
        client: Option<(u64, u64)>,
    ) {
        let Some(found) = self.groups.get_mut(&group) else {
            answer.answer(Err(PublishError::NotReplicatedHere {
                stream: String::new(),
                shard: u32::try_from(group & 0xffff).expect("16 bits"),
            }));
            return;
        };
        match found
            .producer
            .add(records, deadline, timeout, answer, client)
        {
            Ok((sequence, data)) => {
                // Without a known leader the batch waits for the next tick's retry.
                if found.node.propose_data(data).is_ok() {
                    found.producer.proposed(sequence, self.ticks);
                }
            }
            Err((answer, pending)) => answer.answer(Err(PublishError::Busy {
                stream: found.stream.clone(),
                shard: found.shard,
                pending,
            })),
        }
    }

    /// Reads up to `max_records` committed records of shard group `group` from offset `from`
    /// out of this member's copy: `(offset, record)` in offset order, empty at the end;
    /// `None` while the bytes it needs first are fetched from the disk (ask again after
    /// [`Groups::poll_reads`]). Never blocks.
    pub fn read(
        &self,
        group: u64,
        from: u64,
        max_records: usize,
    ) -> Result<Option<Vec<(u64, ShardRecord)>>, String> {
        let found = self
            .groups
            .get(&group)
            .ok_or_else(|| format!("shard group {group} is not running on this member"))?;
        read_copy(found, from, max_records, usize::MAX)
            .map_err(|error| format!("offset {from}: {error}"))
    }

    /// Like [`Groups::read`], bounded by `max_bytes` of keys and payloads too (at least one
    /// record), for a group known to run here (`subscribe.rs`).
    pub(crate) fn read_bytes(
        &self,
        group: u64,
        from: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Option<Vec<(u64, ShardRecord)>>, ReadError> {
        let found = self.groups.get(&group).ok_or_else(|| {
            ReadError::Failed(format!("shard group {group} is not running on this member"))
        })?;
        read_copy(found, from, max_records, max_bytes)
    }

    /// The offsets this member's copy of `group` holds: `(oldest, next)`, every offset in
    /// between committed (a read in a run the member still fetches from a peer answers
    /// nothing until the records are here). `None` when the group does not run here.
    #[must_use]
    pub fn range(&self, group: u64) -> Option<(u64, u64)> {
        let group = self.groups.get(&group)?;
        Some((group.records.oldest(), group.node.state().next_offset()))
    }

    /// Peer `peer` asks for records its record log misses (`records.rs`, "Holes"): answered
    /// from this member's copy, as a subscriber would read them (the answer goes out with
    /// [`Groups::take_fetches`]); a read that waits for the disk is answered once its bytes
    /// are fetched ([`Groups::poll_reads`]).
    pub fn answer_fetch(&mut self, peer: u64, fetch: Fetch) {
        let group = group_id(fetch.key.0, fetch.key.1);
        let result = match self.groups.get(&group) {
            None => Err(FetchRefusal::NotHere),
            Some(found) => match read_copy(
                found,
                fetch.from,
                fetch.max_records.min(HOLE_FETCH_RECORDS) as usize,
                fetch.max_bytes.min(HOLE_FETCH_BYTES) as usize,
            ) {
                Ok(None) if self.fetches_waiting.len() < FETCHES_WAITING_MAX => {
                    self.fetches_waiting.push((peer, fetch));
                    return;
                }
                // Too many waiting already (the disk is slow): the peer asks again later, or
                // asks another replica.
                Ok(None) => Err(FetchRefusal::NotHere),
                Ok(Some(records)) => Ok(Fetched {
                    oldest: found.records.oldest(),
                    next: found.node.state().next_offset(),
                    records,
                }),
                Err(ReadError::Compacted { oldest }) => Err(FetchRefusal::TooOld { oldest }),
                Err(ReadError::Failed(reason)) => {
                    tracing::warn!(group, %reason, "cannot read records a peer asks for");
                    Err(FetchRefusal::NotHere)
                }
            },
        };
        self.fetches.push((
            peer,
            DataFrame::RecordsFetched {
                request: fetch.request,
                result,
            },
        ));
    }

    /// A peer's answer to a fetch of missing records: the records are appended to the
    /// record log (those that follow its end), recording goes on past them, and a hole not
    /// filled yet is asked for again (at once after records, else the next replica later).
    pub fn records_fetched(
        &mut self,
        request: u64,
        result: Result<Fetched, FetchRefusal>,
        now: std::time::Instant,
    ) -> Result<(), NodeError> {
        let Some((id, group)) = self
            .groups
            .iter_mut()
            .find(|(_, g)| g.hole.as_ref().is_some_and(|h| h.request == request))
        else {
            return Ok(());
        };
        let Some(hole) = group.hole.as_mut() else {
            return Ok(());
        };
        match result {
            Ok(fetched) if !fetched.records.is_empty() => {
                let appended = group
                    .records
                    .fill(&fetched.records)
                    .map_err(|error| records_failed(*id, &error))?;
                if appended > 0 {
                    hole.asked_at = None;
                } else {
                    // Records not at the hole's start (the peer's copy skips offsets there,
                    // or the log's pending bytes are full): the next replica, after a while.
                    hole.attempts += 1;
                }
            }
            Ok(_) | Err(FetchRefusal::NotHere) => {
                // The peer has not got them either (yet): the next replica, after a while.
                hole.attempts += 1;
            }
            Err(FetchRefusal::TooOld { oldest }) => {
                group
                    .records
                    .skip_to(oldest)
                    .map_err(|error| records_failed(*id, &error))?;
                hole.asked_at = None;
            }
        }
        record(*id, group, now)?;
        Ok(())
    }

    /// The fetches of missing records to send now, by member.
    pub fn take_fetches(&mut self) -> Vec<(u64, DataFrame)> {
        self.ask_for_holes();
        std::mem::take(&mut self.fetches)
    }

    fn ask_for_holes(&mut self) {
        for (id, group) in &mut self.groups {
            let Some(hole) = group.hole.as_mut() else {
                continue;
            };
            if hole
                .asked_at
                .is_some_and(|at| self.ticks < at + HOLE_FETCH_RETRY_TICKS)
            {
                continue;
            }
            if hole.asked_at.is_some() {
                hole.attempts += 1;
            }
            let mut peers: Vec<u64> = Vec::new();
            if let Some(leader) = group.node.leader().filter(|l| *l != self.id) {
                peers.push(leader);
            }
            for replica in &group.replicas {
                if *replica != self.id && !peers.contains(replica) {
                    peers.push(*replica);
                }
            }
            let Some(&peer) =
                peers.get(usize::try_from(hole.attempts % peers.len().max(1) as u64).unwrap_or(0))
            else {
                continue;
            };
            hole.request = self.next_request;
            self.next_request += 1;
            hole.asked_at = Some(self.ticks);
            self.fetches.push((
                peer,
                DataFrame::RecordsFetch(Fetch {
                    request: hole.request,
                    key: (id >> 16, u32::try_from(id & 0xffff).expect("16 bits")),
                    from: hole.from,
                    max_records: HOLE_FETCH_RECORDS,
                    max_bytes: HOLE_FETCH_BYTES,
                }),
            ));
        }
    }

    /// Whether shard group `group` runs on this member.
    #[must_use]
    pub fn holds(&self, group: u64) -> bool {
        self.groups.contains_key(&group)
    }

    /// Reports a snapshot's fate to the group that sent it.
    pub fn report_snapshot(&mut self, group: u64, to: u64, finished: bool) {
        if let Some(group) = self.groups.get_mut(&group) {
            group.node.report_snapshot(to, finished);
        }
    }

    /// Tells the group that `to` could not be reached.
    pub fn report_unreachable(&mut self, group: u64, to: u64) {
        if let Some(group) = self.groups.get_mut(&group) {
            group.node.report_unreachable(to);
        }
    }

    /// The shared Raft logs opened so far.
    #[must_use]
    pub fn raft_logs(&self) -> Vec<RaftLogStatus> {
        [
            (Fsync::OnCommit, &self.on_commit),
            (Fsync::Periodic, &self.periodic),
        ]
        .into_iter()
        .filter_map(|(fsync, shared)| {
            shared.as_ref().map(|shared| RaftLogStatus {
                fsync,
                bytes: shared.disk_bytes(),
                groups: shared.groups().len(),
            })
        })
        .collect()
    }

    /// Every group's status.
    #[must_use]
    pub fn status(&self) -> Vec<ShardStatus> {
        self.groups
            .iter()
            .map(|(id, group)| {
                let status = group.node.status();
                let alive = |peer: u64| {
                    peer == self.id
                        || group
                            .heard
                            .get(&peer)
                            .is_some_and(|at| self.ticks - at <= ALIVE_TICKS)
                };
                let in_sync = status
                    .peers
                    .iter()
                    .filter(|p| alive(p.id) && p.lag <= IN_SYNC_LAG_MAX)
                    .count();
                ShardStatus {
                    stream: group.stream.clone(),
                    shard: group.shard,
                    group: *id,
                    placed_leader: group.placed_leader,
                    leader: status.leader,
                    role: status.role,
                    term: status.term,
                    commit: status.commit,
                    next_offset: group.node.state().next_offset(),
                    oldest_offset: group.records.oldest(),
                    recorded_offset: group.records.synced(),
                    record_log_bytes: group.records.disk_bytes(),
                    raft_log_entry_bytes: group.node.store().live_bytes(),
                    snapshot_index: raft::Storage::first_index(group.node.store())
                        .map_or(0, |first| first - 1),
                    fetching_from: group.hole.as_ref().map(|h| h.from),
                    replicas: group.replicas.clone(),
                    under_replicated: status.role == Role::Leader && in_sync < group.replicas.len(),
                    pending: group.producer.pending(),
                    fsync: if group.node.store().is_periodic() {
                        Fsync::Periodic
                    } else {
                        Fsync::OnCommit
                    },
                    progress: status.peers,
                }
            })
            .collect()
    }
}

/// The group ids named by the subdirectories of `dir` (none when it does not exist).
fn numbered_dirs(dir: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .collect()
}

fn records_failed(group: u64, error: &dyn std::fmt::Display) -> NodeError {
    NodeError::Store(format!("shard group {group}: record log: {error}"))
}

/// Peers' hole fetches kept waiting for the disk at most (beyond, they are refused and asked
/// again later).
const FETCHES_WAITING_MAX: usize = 64;

/// Reads `group`'s committed records from `from`: out of the record log up to what it has
/// written (`None` while its bytes are fetched from the disk: never blocks), past it out of
/// the Raft log's live entries. Offsets the record log still misses and the Raft log no
/// longer holds (a hole being fetched) read as nothing yet.
fn read_copy<B: Backend>(
    group: &Group<B>,
    from: u64,
    max_records: usize,
    max_bytes: usize,
) -> Result<Option<Vec<(u64, ShardRecord)>>, ReadError> {
    let records = &group.records;
    if from < records.written() || from < records.oldest() {
        return records.try_read(from, max_records, max_bytes);
    }
    match group
        .node
        .state()
        .read(group.node.store(), from, max_records, max_bytes)
    {
        Err(ReadError::Compacted { .. }) => Ok(Some(Vec::new())),
        other => other.map(Some),
    }
}

/// Appends what the group applied to its record log, notes a hole to fetch, and writes once
/// a round is full (the tick writes the rest).
fn record<B: Backend>(
    id: u64,
    group: &mut Group<B>,
    now: std::time::Instant,
) -> Result<(), NodeError> {
    let found = group
        .records
        .catch_up(group.node.state(), group.node.store())
        .map_err(|error| records_failed(id, &error))?;
    match found {
        CatchUp::Recorded => {
            if group.hole.take().is_some() {
                tracing::info!(group = id, "the records this member missed are fetched");
            }
        }
        CatchUp::Hole { from } => match group.hole.as_mut() {
            Some(hole) => hole.from = from,
            None => {
                tracing::info!(
                    group = id,
                    from,
                    upto = group.node.state().oldest_offset(),
                    "this member's copy misses records (it installed a snapshot): fetching them from a peer"
                );
                group.hole = Some(Hole {
                    from,
                    request: 0,
                    asked_at: None,
                    attempts: 0,
                });
            }
        },
    }
    group
        .records
        .drive_if_full(now)
        .map_err(|error| records_failed(id, &error))
}

/// Compacts the group's Raft log once due, behind a point its record log has fdatasynced:
/// the state is taken when the compaction falls due, and the log compacts to it once the
/// record log's fdatasync covers the records before it.
fn compact<B: Backend>(group: &mut Group<B>) -> Result<(), NodeError> {
    if group.compact_point.is_none() && group.node.compaction_due()? {
        let state = group.node.state();
        group.compact_point = Some(CompactPoint {
            index: state.applied_index(),
            next_offset: state.next_offset(),
            data: state.snapshot(),
        });
        group.records.sync_now();
    }
    if group
        .compact_point
        .as_ref()
        .is_some_and(|point| group.records.synced() >= point.next_offset)
        && let Some(point) = group.compact_point.take()
    {
        group.node.compact_to(point.index, point.data)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{Command, Member, Outcome};
    use raft::prelude::{ConfState, Entry, HardState};

    /// Member 1 registered at index 1, nothing else.
    fn one_member_registered() -> ControlState {
        let mut state = ControlState::default();
        let register = Command::Register {
            member: Member {
                id: 1,
                client_addr: "127.0.0.1:7001".to_owned(),
                peer_addr: "127.0.0.1:8001".to_owned(),
                cores: 1,
            },
        };
        assert_eq!(state.apply(1, &register), Outcome::Done);
        state
    }

    fn one_member_with_a_stream() -> ControlState {
        let mut state = one_member_registered();
        let create = Command::CreateStream {
            name: "orders".to_owned(),
            kind: StreamKind::Durable,
            shards: 2,
            replicas: 1,
            fsync: Fsync::OnCommit,
        };
        assert_eq!(state.apply(2, &create), Outcome::Done);
        state
    }

    fn groups(root: &Path) -> Groups {
        Groups::new(
            1,
            7,
            root.join("shards"),
            root.join("records"),
            RecordsConfig::default(),
        )
    }

    /// A member down while a stream was deleted never replays the creation, so its groups
    /// never start: they are released once the control plane has applied past the creation,
    /// and kept while it has not (the member may be about to start them again).
    #[test]
    fn groups_of_a_stream_deleted_while_down_are_released_once_the_deletion_is_applied() {
        let root = tempfile::tempdir().expect("tempdir");
        let created = one_member_with_a_stream();
        let incarnation = created.streams["orders"].incarnation;
        let ids = [group_id(incarnation, 0), group_id(incarnation, 1)];
        let mut running = groups(root.path());
        running.reconcile(&created).expect("reconcile");
        assert_eq!(running.status().len(), 2);
        running.flush();
        drop(running);
        let records = root.path().join("records");
        let record_dirs = || {
            let mut found = numbered_dirs(&records);
            found.sort_unstable();
            found
        };
        assert_eq!(record_dirs(), ids);

        // Behind: the member has applied less than the creation (a stream may come back).
        let behind = one_member_registered();
        let mut restarted = groups(root.path());
        restarted.reconcile(&behind).expect("reconcile behind");
        assert!(restarted.status().is_empty());
        let held = |groups: &Groups| {
            groups
                .on_commit
                .as_ref()
                .map(SharedLog::groups)
                .unwrap_or_default()
        };
        assert_eq!(
            held(&restarted),
            ids,
            "kept while the creation is not applied"
        );
        assert_eq!(record_dirs(), ids);

        // Caught up past the deletion: released, record logs removed, for good.
        let mut deleted = created.clone();
        let delete = Command::DeleteStream {
            name: "orders".to_owned(),
        };
        assert_eq!(deleted.apply(3, &delete), Outcome::Done);
        restarted.reconcile(&deleted).expect("reconcile caught up");
        assert!(held(&restarted).is_empty(), "released from the shared log");
        assert!(record_dirs().is_empty(), "record logs removed");
        drop(restarted);
        let dir = root.path().join("shards").join(SHARED_ON_COMMIT_DIR);
        let backend = (system_backends())(&dir).expect("backend");
        let reopened = SharedLog::open(shard_log_config(&dir), backend).expect("reopen");
        assert!(reopened.groups().is_empty(), "the release was stored");
    }

    /// A group's Raft log in its own directory (the layout before the shared logs) moves
    /// into the shared log when the group starts, and its directory goes.
    #[test]
    fn a_group_log_of_an_earlier_release_moves_into_the_shared_log() {
        let root = tempfile::tempdir().expect("tempdir");
        let state = one_member_with_a_stream();
        let incarnation = state.streams["orders"].incarnation;
        let moved = group_id(incarnation, 1);
        let legacy_dir = root.path().join("shards").join(moved.to_string());
        let mut legacy = RaftLog::open(&legacy_dir).expect("legacy log");
        legacy
            .set_conf_state(ConfState::from((vec![1], vec![])))
            .expect("conf state");
        let entries: Vec<Entry> = (1..=2)
            .map(|index| Entry {
                index,
                term: 5,
                ..Default::default()
            })
            .collect();
        let hard_state = HardState {
            term: 5,
            vote: 1,
            commit: 2,
            ..Default::default()
        };
        legacy
            .persist(&entries, Some(&hard_state))
            .expect("persist");
        legacy.close().expect("close");

        let mut running = groups(root.path());
        running.reconcile(&state).expect("reconcile");
        assert!(!legacy_dir.exists(), "the moved log's directory is removed");
        let term = |groups: &Groups| {
            groups
                .status()
                .into_iter()
                .find(|s| s.group == moved)
                .expect("the moved group runs")
                .term
        };
        assert!(term(&running) >= 5, "the moved group keeps its term");
        running.flush();
        drop(running);

        let mut reopened = groups(root.path());
        reopened.reconcile(&state).expect("reconcile again");
        assert!(term(&reopened) >= 5, "recovered from the shared log");
        assert_eq!(reopened.status().len(), 2);
        let names: Vec<String> = std::fs::read_dir(root.path().join("shards"))
            .expect("shards dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec![SHARED_ON_COMMIT_DIR.to_owned()]);
    }
}
