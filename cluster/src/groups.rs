//! The replicated shards a member holds: one Raft group per shard of each durable stream
//! placed on it (`placement.rs`), each a [`Node`] applying [`ShardState`] on a Raft log of its
//! own under `<data_dir>/cluster/shards/<group>/`. The service (`service.rs`) owns a
//! [`Groups`], reconciles it with the control plane after every change (a group starts when
//! the stream's creation is applied here and stops, its directory removed, when the deletion
//! is), ticks and drives every group, and routes peer frames to them by group id.
//!
//! Leadership follows placement: a group elects whichever replica Raft picks (after a failure,
//! any live replica), and its leader hands leadership back to the placed leader once that one
//! is connected and caught up, so each stream's leaders stay spread.

use std::collections::BTreeMap;
use std::path::PathBuf;

use raft::prelude::Message;
use serde::{Deserialize, Serialize};

use crate::control::{ControlState, Fsync, StreamKind};
use crate::node::{Node, NodeConfig, NodeError, Output, PeerProgress, Role};
use crate::publish::{Producer, PublishAnswer, PublishError};
use crate::raft_log::{RaftLog, raft_log_config};
use crate::shard::{ReadError, ShardApplied, ShardRecord, ShardState};

/// Group id 0 is the control plane's; a shard's group id is its stream's incarnation (the
/// control-plane index that created it) shifted over the shard number (shards < 2^16).
pub const CONTROL_GROUP: u64 = 0;

/// Segment size of a shard group's Raft log (the records live in it), and its largest write
/// round (at most half a segment, `storage/src/config.rs`).
const SHARD_LOG_SEGMENT_BYTES: u64 = 4 << 20;
const SHARD_LOG_ROUND_BYTES: usize = 1 << 20;

/// A replica this many entries or fewer behind the leader counts as in sync.
pub const IN_SYNC_LAG_MAX: u64 = 1_000;

/// Ticks between two checks whether a group should hand leadership to its placed leader.
const TRANSFER_CHECK_TICKS: u64 = 10;

/// A replica heard from within this many ticks (3 s: fifteen heartbeats) counts as alive.
/// raft-rs's own `recent_active` flag is cleared at every election timeout and set again by
/// the next answer, so a sample of it right after the clearing would call live replicas dead.
const ALIVE_TICKS: u64 = 30;

/// The group id of shard `shard` of the stream created at control-plane index `incarnation`.
#[must_use]
pub fn group_id(incarnation: u64, shard: u32) -> u64 {
    (incarnation << 16) | u64::from(shard)
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
    /// The oldest offset this member's copy still holds (older ones were compacted).
    #[serde(default)]
    pub oldest_offset: u64,
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

struct Group {
    stream: String,
    shard: u32,
    placed_leader: u64,
    replicas: Vec<u64>,
    node: Node<RaftLog, ShardState>,
    dir: PathBuf,
    /// The tick each replica was last heard from in this group.
    heard: BTreeMap<u64, u64>,
    /// This member's publishes into the shard (`publish.rs`).
    producer: Producer,
}

/// Answers this member's publishes that `output` applied and sends its messages; notes
/// `(group, to, snapshot, sent)` where the group must hear how a send went.
fn deliver(
    id: u64,
    group: &mut Group,
    output: Output<ShardApplied>,
    send: &mut dyn FnMut(u64, &Message) -> bool,
    reports: &mut Vec<(u64, u64, bool, bool)>,
) {
    for applied in &output.applied {
        group.producer.applied(applied);
    }
    for message in output.messages {
        let sent = send(id, &message);
        let snapshot = message.get_msg_type() == raft::prelude::MessageType::MsgSnapshot;
        if snapshot || !sent {
            reports.push((id, message.to, snapshot, sent));
        }
    }
}

/// The shard groups of this member.
pub struct Groups {
    id: u64,
    /// This run of the member (start time in nanoseconds): its producers' ids.
    boot: u64,
    dir: PathBuf,
    /// The periodic fdatasync interval of groups of `--fsync periodic` streams
    /// (FELIX_DURABLE_FSYNC_INTERVAL_MS).
    fsync_interval: std::time::Duration,
    groups: BTreeMap<u64, Group>,
    ticks: u64,
    /// `(group, to, snapshot, sent)` of the sends a group must hear about after a pass.
    reports: Vec<(u64, u64, bool, bool)>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("id", &self.id)
            .field("groups", &self.groups.len())
            .finish_non_exhaustive()
    }
}

impl Groups {
    /// No groups yet; their logs go under `dir`. `boot` tells this run of the member from
    /// its earlier ones (its publishes' producer ids differ per run). Groups of periodic
    /// streams fdatasync every `fsync_interval`.
    #[must_use]
    pub fn new(id: u64, boot: u64, dir: PathBuf, fsync_interval: std::time::Duration) -> Groups {
        Groups {
            id,
            boot,
            dir,
            fsync_interval,
            groups: BTreeMap::new(),
            ticks: 0,
            reports: Vec::new(),
        }
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
                stopped.producer.fail_all(&PublishError::NoSuchStream {
                    stream: stopped.stream.clone(),
                });
                drop(stopped.node);
                if let Err(error) = std::fs::remove_dir_all(&stopped.dir) {
                    tracing::warn!(group, %error, "cannot remove a deleted shard's raft log");
                }
            }
        }
        for (group, (stream, shard, placement, fsync)) in wanted {
            if self.groups.contains_key(&group) {
                continue;
            }
            let dir = self.dir.join(group.to_string());
            let mut log_config = raft_log_config(&dir);
            log_config.segment_bytes = SHARD_LOG_SEGMENT_BYTES;
            log_config.max_round_bytes = SHARD_LOG_ROUND_BYTES;
            if fsync == Fsync::Periodic {
                log_config.fsync = felix_storage::FsyncMode::Periodic {
                    interval: self.fsync_interval,
                };
            }
            let backend = felix_storage::SystemBackend::open(
                felix_storage::BackendChoice::from_env()
                    .map_err(|error| NodeError::Store(error.to_string()))?,
            )
            .map_err(|error| NodeError::Store(error.to_string()))?;
            let store = RaftLog::open_with(log_config, backend)
                .map_err(|error| NodeError::Store(error.to_string()))?;
            let config = NodeConfig::new(self.id, placement.replicas.clone());
            let node = Node::with_machine(&config, store, ShardState::default())?;
            tracing::info!(
                stream,
                shard,
                group,
                fsync = fsync.name(),
                "replicated shard started"
            );
            self.groups.insert(
                group,
                Group {
                    stream,
                    shard,
                    placed_leader: placement.leader,
                    replicas: placement.replicas.clone(),
                    node,
                    dir,
                    heard: BTreeMap::new(),
                    producer: Producer::new(self.id, self.boot),
                },
            );
        }
        Ok(())
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
        for group in self.groups.values_mut() {
            group.node.drive_store(now)?;
            group.node.tick();
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

    /// Starts a pass of driving the groups (`service.rs` runs up to
    /// [`crate::node::ADVANCE_PASSES`], then [`Groups::end_advance`]), answering this member's
    /// publishes that were applied and handing each message to `send` with its group id as
    /// soon as it may leave (`send` says whether it went: a snapshot's fate and an
    /// unreachable peer are reported to the group at the end). Every group with something
    /// ready sends what may leave now (a leader's
    /// appends go out before its own write is done, as Raft allows), applies what is
    /// committed and starts its write ([`Node::begin`]), all before any write is waited for,
    /// so the groups' logs write and fdatasync at the same time. Returns the groups begun;
    /// [`Groups::finish_pass`] with them must follow. A caller on an async runtime yields in
    /// between, so the messages reach the network while the disks work.
    pub fn begin_pass(
        &mut self,
        send: &mut dyn FnMut(u64, &Message) -> bool,
    ) -> Result<Vec<u64>, NodeError> {
        let mut begun = Vec::new();
        for (id, group) in &mut self.groups {
            let mut output = Output::default();
            if group.node.begin(&mut output)? {
                begun.push(*id);
            }
            deliver(*id, group, output, send, &mut self.reports);
        }
        Ok(begun)
    }

    /// Completes the pass [`Groups::begin_pass`] started for `begun` ([`Node::finish`]):
    /// waits for each write, sends what needed it (votes, append responses), applies what
    /// became committed.
    pub fn finish_pass(
        &mut self,
        begun: &[u64],
        send: &mut dyn FnMut(u64, &Message) -> bool,
    ) -> Result<(), NodeError> {
        for id in begun {
            let Some(group) = self.groups.get_mut(id) else {
                continue;
            };
            let mut output = Output::default();
            group.node.finish(&mut output)?;
            deliver(*id, group, output, send, &mut self.reports);
        }
        Ok(())
    }

    /// After the passes: compacts the groups due and tells them how their sends went.
    pub fn end_advance(&mut self) -> Result<(), NodeError> {
        for group in self.groups.values_mut() {
            group.node.compact_if_due()?;
        }
        for (group, to, snapshot, sent) in std::mem::take(&mut self.reports) {
            if snapshot {
                self.report_snapshot(group, to, sent);
            }
            if !sent {
                self.report_unreachable(group, to);
            }
        }
        Ok(())
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
    ) {
        let Some(found) = self.groups.get_mut(&group) else {
            answer.answer(Err(PublishError::NotReplicatedHere {
                stream: String::new(),
                shard: u32::try_from(group & 0xffff).expect("16 bits"),
            }));
            return;
        };
        match found.producer.add(records, deadline, timeout, answer) {
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
    /// out of this member's copy: `(offset, record)` in offset order, empty at the end.
    pub fn read(
        &self,
        group: u64,
        from: u64,
        max_records: usize,
    ) -> Result<Vec<(u64, ShardRecord)>, String> {
        let found = self
            .groups
            .get(&group)
            .ok_or_else(|| format!("shard group {group} is not running on this member"))?;
        found
            .node
            .state()
            .read(found.node.store(), from, max_records, usize::MAX)
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
    ) -> Result<Vec<(u64, ShardRecord)>, ReadError> {
        let found = self.groups.get(&group).ok_or_else(|| {
            ReadError::Failed(format!("shard group {group} is not running on this member"))
        })?;
        found
            .node
            .state()
            .read(found.node.store(), from, max_records, max_bytes)
    }

    /// The offsets this member's copy of `group` holds: `(oldest, next)`, every offset in
    /// between committed and readable. `None` when the group does not run here.
    #[must_use]
    pub fn range(&self, group: u64) -> Option<(u64, u64)> {
        let state = self.groups.get(&group)?.node.state();
        Some((state.oldest_offset(), state.next_offset()))
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
                    oldest_offset: group.node.state().oldest_offset(),
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
