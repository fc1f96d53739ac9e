//! The control plane's Raft node as a sans-IO state machine: ticks, peer messages and
//! proposals go in; messages to send and applied commands come out of [`Node::advance`]. It
//! owns raft-rs's `RawNode` (TiKV's Raft engine: elections, log matching, commit), its log
//! store and the applied [`ControlState`]. It never does network IO and never reads a clock:
//! the service's loop (`service.rs`) feeds it real time and real QUIC frames, and the
//! seeded simulation (`tests/control_sim.rs`) feeds it a simulated network and clock.
//!
//! The `Ready` handling follows raft-rs's contract: messages of a leader go out before its
//! entries are persisted (Raft allows the leader's own write to overlap replication);
//! entries and hard state are persisted (fsynced) before the messages that depend on them
//! (`persisted_messages`: votes, append responses) leave; committed entries are applied in
//! index order.

use std::collections::{BTreeMap, VecDeque};

use raft::prelude::{ConfState, Entry, EntryType, HardState, Message, MessageType, Snapshot};
use raft::{RawNode, StateRole, Storage};

use crate::control::{self, Command, ControlState, Outcome, Proposal};

/// The replicated state a Raft group applies its committed entries to: the control plane's
/// [`ControlState`], or a replicated shard. Applying must be deterministic: every member
/// applies the same entries in the same order and must reach the same state.
pub trait Machine: Sized {
    /// What applying one entry produced (the proposer answers its caller with it).
    type Applied;
    /// Index of the last entry applied.
    fn applied_index(&self) -> u64;
    /// Applies the data of entry `index` (never empty). An error means this member cannot
    /// read the entry (another version wrote it): fatal, never skipped.
    fn apply(&mut self, index: u64, data: &[u8]) -> Result<Self::Applied, String>;
    /// Entry `index` carries nothing to apply (a new leader's empty entry).
    fn skip(&mut self, index: u64);
    /// The state, for a snapshot at `applied_index`.
    fn snapshot(&self) -> Vec<u8>;
    /// The state a snapshot holds.
    fn restore(data: &[u8]) -> Result<Self, String>;
    /// The log store dropped the entries up to `index` (they are in the snapshot now).
    fn compacted(&mut self, _index: u64) {}
}

impl Machine for ControlState {
    type Applied = Applied;

    fn applied_index(&self) -> u64 {
        self.applied
    }

    fn apply(&mut self, index: u64, data: &[u8]) -> Result<Applied, String> {
        let proposal = control::decode(data).map_err(|error| error.to_string())?;
        let outcome = self.apply_proposal(index, &proposal);
        Ok(Applied {
            index,
            proposal,
            outcome,
        })
    }

    fn skip(&mut self, index: u64) {
        self.applied = index;
    }

    fn snapshot(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("the state always serializes")
    }

    fn restore(data: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(data).map_err(|error| error.to_string())
    }
}

/// Where a node keeps its Raft log durably. `persist` returns once the entries and hard state
/// are stored: fdatasynced, or for a periodic shard group's entries written
/// (`raft_log.rs`, "Durability"); a vote acknowledged before its fdatasync could be lost by
/// a power cut, which breaks Raft's safety.
pub trait LogStore: Storage {
    /// Stores the group's voters when the log is new (a static peer list bootstraps every
    /// member with the same configuration).
    fn bootstrap(&mut self, conf_state: ConfState) -> Result<(), NodeError>;
    /// Appends `entries` (an entry at index `i` replaces `i` and everything after it) and
    /// stores `hard_state`, durably.
    fn persist(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<(), NodeError>;
    /// Starts what [`LogStore::persist`] does without waiting for it: the write goes out (at
    /// the same time as other groups' writes), and the entries and hard state are readable
    /// through [`Storage`] at once (raft-rs's asynchronous persistence asks it). Further
    /// writes may begin before it is stored. Returns the write's number, ascending:
    /// [`LogStore::persisted`] tells when it is stored, [`LogStore::persist_end`] waits for
    /// every write begun. By default it persists at once.
    fn persist_begin(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<u64, NodeError> {
        self.persist(entries, hard_state)?;
        Ok(0)
    }
    /// The number of the newest write [`LogStore::persist_begin`] started that is stored, as
    /// `persist` stores it, and every write before it; without waiting. By default every
    /// write is stored once begun.
    fn persisted(&mut self) -> Result<u64, NodeError> {
        Ok(u64::MAX)
    }
    /// Waits for every write [`LogStore::persist_begin`] started; then they are stored as
    /// `persist` stores them.
    fn persist_end(&mut self) -> Result<(), NodeError> {
        Ok(())
    }
    /// Stores a newer commit index (its loss is harmless: Raft learns it again).
    fn persist_commit(&mut self, commit: u64) -> Result<(), NodeError>;
    /// Replaces the log up to the snapshot's index with the snapshot, durably.
    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<(), NodeError>;
    /// Drops entries up to `upto` (applied), keeping `data` as the snapshot at `upto`.
    fn compact(&mut self, upto: u64, data: Vec<u8>) -> Result<(), NodeError>;
    /// Bytes of entry data held in memory (the live entries behind the snapshot); 0 for a
    /// store that does not count them.
    fn live_bytes(&self) -> u64 {
        0
    }
    /// Whether the store wants a compaction whatever the entries held (a group's Raft log in
    /// a shared Felix log whose generation lies too far behind the log's head,
    /// `raft_log.rs` `RaftLog::relocation_due`).
    fn relocation_due(&self) -> bool {
        false
    }
    /// Background work at time `now`, without blocking: writes left queued, a periodic
    /// fdatasync that is due (`raft_log.rs`). Called every service tick.
    fn drive(&mut self, _now: std::time::Instant) -> Result<(), NodeError> {
        Ok(())
    }
    /// Writes what is left queued (a commit index noted since the last write) and waits for
    /// it: a clean close.
    fn flush(&mut self) -> Result<(), NodeError> {
        Ok(())
    }
}

/// Why the node cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("log store: {0}")]
    Store(String),
    #[error("entry {index} cannot be read by this broker (a different version?): {error}")]
    Undecodable { index: u64, error: String },
}

/// Why a proposal was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    #[error("no control-plane leader is known yet; retry")]
    NoLeader,
}

/// The default [`NodeConfig::compact_after_bytes`]: 64 MiB of entries per group.
pub const COMPACT_AFTER_BYTES: u64 = 64 << 20;

/// Writes a node keeps in flight at most ([`Node::pump`]). A follower begins the write of
/// the next appends while the previous one is in flight, so its answers follow each other by
/// less than a write. With one (what Raft makes ready meanwhile waits and goes out as one write), the
/// leader acked fewer records under load on a latency-bound machine (docs/performance.md,
/// "Cluster: writes that do not block").
const WRITES_IN_FLIGHT: usize = 4;

/// Rounds of taking stored writes and starting readies per node and [`Node::pump`], at most.
const STARTS_PER_PASS: usize = 8;

/// Most `Ready`s one [`Node::advance`] handles: raft-rs produces a new one only after more
/// input or a persisted append, which a few passes exhaust.
pub const ADVANCE_PASSES: usize = 8;

/// Timing and identity of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub id: u64,
    /// Every member's id, this one included (the static peer list).
    pub voters: Vec<u64>,
    /// Ticks without a leader's word before a follower campaigns.
    pub election_tick: usize,
    /// Ticks between a leader's heartbeats.
    pub heartbeat_tick: usize,
    /// Election timeouts drawn in `[election_tick, 2 * election_tick)` (raft-rs draws them
    /// with its own thread-local generator), or fixed at `election_tick` when false: the
    /// simulation fixes them per node from its seed so its runs replay exactly.
    pub randomized_timeouts: bool,
    /// Applied entries kept in the log behind the snapshot before a compaction.
    pub compact_after: u64,
    /// Bytes of entry data the log store may hold in memory ([`LogStore::live_bytes`]) before
    /// a compaction, whatever the entry count: a shard group's entries are publish batches
    /// of up to a frame each (FELIX_MAX_FRAME_BYTES), so the count alone would not bound it.
    pub compact_after_bytes: u64,
    /// Tells this run of the member from its earlier ones in its proposals (`Proposal::boot`):
    /// the start time in nanoseconds by default; the simulation draws it from its seed.
    pub boot: u64,
    /// A leader tells its followers a new commit index lazily ([`Node::commit_untold`]): on
    /// the next append, or when the owner calls [`Node::tell_commit`], instead of a message
    /// of its own to every follower at each commit; at once only while an entry a follower
    /// forwarded is uncommitted (that follower answers its caller when it applies it). The
    /// shard groups run so; the control plane (few, rare entries) does not.
    pub lazy_commit: bool,
}

impl NodeConfig {
    /// The broker's defaults for `id` among `voters` (with a 100 ms tick: elections after 1-2 s
    /// of silence, heartbeats every 200 ms).
    #[must_use]
    pub fn new(id: u64, voters: Vec<u64>) -> Self {
        NodeConfig {
            id,
            voters,
            election_tick: 10,
            heartbeat_tick: 2,
            randomized_timeouts: true,
            compact_after: 10_000,
            compact_after_bytes: COMPACT_AFTER_BYTES,
            boot: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| {
                    u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
                }),
            lazy_commit: false,
        }
    }
}

/// An applied entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub index: u64,
    pub proposal: Proposal,
    pub outcome: Outcome,
}

/// What one `advance` produced.
#[derive(Debug)]
pub struct Output<A = Applied> {
    /// Messages to deliver to their `to` member, in order per member.
    pub messages: Vec<Message>,
    /// Entries applied, in index order.
    pub applied: Vec<A>,
}

impl<A> Default for Output<A> {
    fn default() -> Self {
        Output {
            messages: Vec::new(),
            applied: Vec::new(),
        }
    }
}

/// The node's role as `felix cluster status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Follower,
    Candidate,
    PreCandidate,
    Leader,
}

/// A peer's replication progress, seen from the leader.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerProgress {
    pub id: u64,
    /// Highest index known to be in the peer's log.
    pub matched: u64,
    /// Entries the peer is behind the leader's last index.
    pub lag: u64,
}

/// A node's view of the group.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeStatus {
    pub id: u64,
    pub role: Role,
    /// The leader this node knows of, if any.
    pub leader: Option<u64>,
    pub term: u64,
    pub commit: u64,
    pub applied: u64,
    pub last_index: u64,
    /// Every member's progress when this node leads; empty otherwise.
    pub peers: Vec<PeerProgress>,
}

/// A Raft group member: the control plane's (`Node<S>`), or a replicated shard's.
pub struct Node<S: LogStore, M: Machine = ControlState> {
    raw: RawNode<S>,
    /// The readies whose writes [`Node::start`] began and that are not known stored yet,
    /// oldest first, with the messages held until they are.
    in_flight: VecDeque<Persisting>,
    state: M,
    boot: u64,
    next_sequence: u64,
    compact_after: u64,
    compact_after_bytes: u64,
    /// The commit index each follower was last sent, when the leader tells it lazily
    /// ([`NodeConfig::lazy_commit`]).
    lazy: Option<LazyCommit>,
}

/// A ready whose write is in flight ([`Node::start`]).
#[derive(Debug)]
struct Persisting {
    /// raft-rs's number of the ready ([`RawNode::on_persist_ready`]).
    ready: u64,
    /// The store's number of the write ([`LogStore::persist_begin`]).
    write: u64,
    /// The messages that may leave only once the write is stored: a follower's append
    /// responses, votes.
    held: Vec<Message>,
}

/// What a leader that tells commits lazily knows of what its followers were told.
#[derive(Debug, Default)]
struct LazyCommit {
    /// Per follower, the highest commit index an append or heartbeat to it carried.
    told: BTreeMap<u64, u64>,
    /// The last index of an entry a follower forwarded: until it is committed, the leader
    /// broadcasts each commit at once (raft-rs's eager mode).
    forwarded_upto: u64,
}

impl<S: LogStore, M: Machine> std::fmt::Debug for Node<S, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.raw.raft.id)
            .field("applied", &self.state.applied_index())
            .finish_non_exhaustive()
    }
}

impl<S: LogStore> Node<S, ControlState> {
    /// Starts a control-plane member (see [`Node::with_machine`]).
    pub fn new(config: &NodeConfig, store: S) -> Result<Self, NodeError> {
        Node::with_machine(config, store, ControlState::default())
    }

    /// Proposes `command`; returns the proposal's sequence, which comes back in an
    /// [`Applied`] once committed and applied here (a follower forwards it to the leader).
    /// A proposal can still be lost (a leader change before it commits): callers wait with a
    /// deadline and propose again.
    pub fn propose(&mut self, command: Command) -> Result<u64, ProposeError> {
        let sequence = self.next_sequence;
        self.propose_again(sequence, command)?;
        self.next_sequence += 1;
        Ok(sequence)
    }

    /// Proposes `command` again under the `sequence` an earlier [`Node::propose`] returned (it
    /// did not come back in time): applied once however many times it commits.
    pub fn propose_again(&mut self, sequence: u64, command: Command) -> Result<(), ProposeError> {
        let data = control::encode(&Proposal {
            proposer: self.id(),
            boot: self.boot,
            sequence,
            command,
        });
        self.propose_data(data)
    }

    /// Whether this run of this member proposed `proposal` (its caller waits for it).
    #[must_use]
    pub fn proposed(&self, proposal: &Proposal) -> bool {
        proposal.proposer == self.id() && proposal.boot == self.boot
    }
}

impl<S: LogStore, M: Machine> Node<S, M> {
    /// Starts a node on `store`: a new store is bootstrapped with the voters; a recovered one
    /// restores the state from its snapshot (else starts from `fresh`) and re-applies the
    /// committed entries after it (they come out of the first `advance` calls).
    pub fn with_machine(config: &NodeConfig, mut store: S, fresh: M) -> Result<Self, NodeError> {
        let initial = store.initial_state()?;
        if initial.conf_state.voters.is_empty() {
            let mut voters = config.voters.clone();
            voters.sort_unstable();
            voters.dedup();
            store.bootstrap(ConfState::from((voters, vec![])))?;
        }
        let snapshot = store.snapshot(0, config.id);
        let (state, applied) = match snapshot {
            Ok(snapshot) if snapshot.get_metadata().index > 0 => {
                let state =
                    M::restore(snapshot.get_data()).map_err(|error| NodeError::Undecodable {
                        index: snapshot.get_metadata().index,
                        error,
                    })?;
                let applied = state.applied_index();
                (state, applied)
            }
            _ => (fresh, 0),
        };
        let raft_config = raft::Config {
            id: config.id,
            election_tick: config.election_tick,
            heartbeat_tick: config.heartbeat_tick,
            min_election_tick: config.election_tick,
            max_election_tick: if config.randomized_timeouts {
                2 * config.election_tick
            } else {
                config.election_tick + 1
            },
            applied,
            // A partitioned leader steps down once it has not heard from a majority for an
            // election timeout, and a partitioned follower's campaigns (pre-votes) do not
            // disturb the majority when it comes back.
            check_quorum: true,
            pre_vote: true,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            skip_bcast_commit: config.lazy_commit,
            ..raft::Config::default()
        };
        raft_config.validate()?;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let raw = RawNode::new(&raft_config, store, &logger)?;
        Ok(Node {
            raw,
            in_flight: VecDeque::new(),
            state,
            boot: config.boot,
            next_sequence: 1,
            compact_after: config.compact_after.max(1),
            compact_after_bytes: config.compact_after_bytes.max(1),
            lazy: config.lazy_commit.then(LazyCommit::default),
        })
    }

    /// This node's id.
    #[must_use]
    pub fn id(&self) -> u64 {
        self.raw.raft.id
    }

    /// The applied state.
    #[must_use]
    pub fn state(&self) -> &M {
        &self.state
    }

    /// The log store.
    pub fn store(&self) -> &S {
        self.raw.store()
    }

    /// The node's log store, to change under it (a simulation completes a
    /// [`MemLog::delayed`] store's writes).
    pub fn store_mut(&mut self) -> &mut S {
        self.raw.mut_store()
    }

    /// The node's end: its log store, to close or release.
    pub fn into_store(self) -> S {
        self.raw.raft.r.raft_log.store
    }

    /// One tick of the logical clock (the service ticks every 100 ms).
    pub fn tick(&mut self) {
        self.raw.tick();
    }

    /// The log store's background work at `now` ([`LogStore::drive`]).
    pub fn drive_store(&mut self, now: std::time::Instant) -> Result<(), NodeError> {
        self.raw.mut_store().drive(now)
    }

    /// Writes what the store left queued and waits for it (a clean close).
    pub fn flush_store(&mut self) -> Result<(), NodeError> {
        self.raw.mut_store().flush()
    }

    /// A message from a peer. Messages from a stale term or for another node are ignored by
    /// raft-rs; an error here is the peer's fault and is dropped by the caller.
    pub fn step(&mut self, message: Message) -> Result<(), NodeError> {
        let forwarded = message.get_msg_type() == MessageType::MsgPropose;
        self.raw.step(message)?;
        if forwarded
            && self.is_leader()
            && let Some(lazy) = &mut self.lazy
        {
            // A follower's caller waits for that follower to apply the entry: its commit is
            // broadcast as soon as it is known.
            lazy.forwarded_upto = self.raw.raft.raft_log.last_index();
            self.raw.skip_bcast_commit(false);
        }
        Ok(())
    }

    /// Whether this node leads and some follower was not yet sent the commit index it may
    /// know (the leader's, or the follower's last matched entry when that is lower). With
    /// [`NodeConfig::lazy_commit`] the owner calls [`Node::tell_commit`] once this has held a
    /// little while: an append under load carries the commit index first.
    #[must_use]
    pub fn commit_untold(&self) -> bool {
        let Some(lazy) = &self.lazy else {
            return false;
        };
        if !self.is_leader() {
            return false;
        }
        let committed = self.raw.raft.raft_log.committed;
        self.raw.raft.prs().iter().any(|(id, progress)| {
            *id != self.raw.raft.id
                && lazy.told.get(id).copied().unwrap_or(0) < progress.matched.min(committed)
        })
    }

    /// Sends every follower the commit index now (heartbeats, which carry it); they go out
    /// with the next [`Node::advance`] or pass.
    pub fn tell_commit(&mut self) {
        self.raw.ping();
    }

    /// Notes the commit indexes the messages of this pass carry to each follower, and goes
    /// back to lazy commits once the forwarded entries are committed.
    fn note_told(&mut self, messages: &[Message]) {
        let Some(lazy) = &mut self.lazy else {
            return;
        };
        for message in messages {
            if matches!(
                message.get_msg_type(),
                MessageType::MsgAppend | MessageType::MsgHeartbeat
            ) {
                let told = lazy.told.entry(message.to).or_default();
                *told = (*told).max(message.commit);
            }
        }
        if lazy.forwarded_upto != 0 && self.raw.raft.raft_log.committed >= lazy.forwarded_upto {
            lazy.forwarded_upto = 0;
            self.raw.skip_bcast_commit(true);
        }
    }

    /// Whether this member leads the group now.
    #[must_use]
    pub fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    /// The leader this member knows of.
    #[must_use]
    pub fn leader(&self) -> Option<u64> {
        let leader = self.raw.raft.leader_id;
        (leader != raft::INVALID_ID).then_some(leader)
    }

    /// Proposes an entry's data (a follower forwards it to the leader). It may still be lost
    /// to a leader change before it commits.
    pub fn propose_data(&mut self, data: Vec<u8>) -> Result<(), ProposeError> {
        if self.raw.raft.leader_id == raft::INVALID_ID {
            return Err(ProposeError::NoLeader);
        }
        self.raw
            .propose(vec![], data)
            .map_err(|_| ProposeError::NoLeader)
    }

    /// Asks the leader to hand leadership to `to` (once `to` has caught up it campaigns at
    /// once); the placement's preferred leader takes its shards back this way.
    pub fn transfer_leader(&mut self, to: u64) {
        self.raw.transfer_leader(to);
    }

    /// Tells Raft a peer could not be reached (it then probes instead of streaming).
    pub fn report_unreachable(&mut self, id: u64) {
        self.raw.report_unreachable(id);
    }

    /// Tells Raft whether a snapshot sent to `id` arrived (`finished`) or was lost: until told,
    /// the leader waits for it and sends `id` nothing else. The transport reports each
    /// `MsgSnapshot` it delivered or dropped.
    pub fn report_snapshot(&mut self, id: u64, finished: bool) {
        let status = if finished {
            raft::SnapshotStatus::Finish
        } else {
            raft::SnapshotStatus::Failure
        };
        self.raw.report_snapshot(id, status);
    }

    /// Handles everything Raft has ready: persists (waiting for the store), applies, and
    /// returns the messages to send and the commands applied. Call after every tick, step and
    /// propose. The member runs its nodes with [`Node::pump`] ([`Node::start`] and
    /// [`Node::poll_persisted`], which do not wait) and this only with no write in flight
    /// (the control plane's recovery at open); the simulations' seeds that store each write
    /// at once run this way.
    pub fn advance(&mut self) -> Result<Output<M::Applied>, NodeError> {
        let mut output = Output::default();
        for _ in 0..ADVANCE_PASSES {
            if !self.pass(&mut output)? {
                break;
            }
        }
        self.compact_if_due()?;
        Ok(output)
    }

    /// One pass of [`Node::advance`]: takes what Raft has ready, puts the messages that may
    /// leave now in `output` (a leader's appends), applies the committed entries, persists
    /// and waits, then lets out the messages that needed the write (votes, append
    /// responses), advances Raft and applies what became committed. False when nothing was
    /// ready.
    fn pass(&mut self, output: &mut Output<M::Applied>) -> Result<bool, NodeError> {
        debug_assert!(self.in_flight.is_empty(), "advance mixed with start");
        let Some(mut ready) = self.take_ready(output)? else {
            return Ok(false);
        };
        let store = self.raw.mut_store();
        store.persist_begin(ready.entries(), ready.hs())?;
        store.persist_end()?;
        let sent = output.messages.len();
        output.messages.extend(ready.take_persisted_messages());
        let mut light = self.raw.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.raw.mut_store().persist_commit(commit)?;
        }
        output.messages.extend(light.take_messages());
        self.note_told(&output.messages[sent..]);
        self.apply(light.take_committed_entries(), output)?;
        self.raw.advance_apply();
        Ok(true)
    }

    /// One step of the node without waiting for its writes (raft-rs's asynchronous
    /// persistence, `RawNode::advance_append_async`): takes what Raft has ready, puts the
    /// messages that may leave now in `output` (a leader's appends), applies the committed
    /// entries (raft-rs hands out only entries stored here) and starts the write, whose view
    /// the store serves at once. The messages that need the write (votes, a follower's append
    /// responses) are held until [`Node::poll_persisted`] finds it stored. It may run again
    /// while earlier writes are in flight. False when nothing was ready. [`Node::advance`]
    /// may run only while no write is in flight.
    pub fn start(&mut self, output: &mut Output<M::Applied>) -> Result<bool, NodeError> {
        let Some(mut ready) = self.take_ready(output)? else {
            return Ok(false);
        };
        let write = self
            .raw
            .mut_store()
            .persist_begin(ready.entries(), ready.hs())?;
        let held = ready.take_persisted_messages();
        let number = ready.number();
        self.raw.advance_append_async(ready);
        self.in_flight.push_back(Persisting {
            ready: number,
            write,
            held,
        });
        self.tell_applied();
        Ok(true)
    }

    /// What both ways of handling a ready begin with: takes what Raft has ready (`None` when
    /// nothing is), puts the messages that may leave before the write in `output` (a
    /// leader's appends), installs a snapshot, applies the committed entries.
    fn take_ready(
        &mut self,
        output: &mut Output<M::Applied>,
    ) -> Result<Option<raft::Ready>, NodeError> {
        if !self.raw.has_ready() {
            return Ok(None);
        }
        let mut ready = self.raw.ready();
        let sent = output.messages.len();
        output.messages.extend(ready.take_messages());
        self.note_told(&output.messages[sent..]);
        if !ready.snapshot().is_empty() {
            self.install(ready.snapshot().clone())?;
        }
        let committed = ready.take_committed_entries();
        self.apply(committed, output)?;
        Ok(Some(ready))
    }

    /// Tells raft-rs what the machine applied, as far as it counts stored here: a snapshot
    /// installed is applied at once but counts once its ready is persisted.
    fn tell_applied(&mut self) {
        let log = &self.raw.raft.raft_log;
        let applied = self
            .state
            .applied_index()
            .min(log.persisted)
            .min(log.committed);
        if applied > log.applied {
            self.raw.advance_apply_to(applied);
        }
    }

    /// Tells Raft which of [`Node::start`]'s writes the store has stored since the last call
    /// (`RawNode::on_persist_ready`: a leader counts its own entries, a follower's commit may
    /// move) and puts the messages they held in `output`, in order. True when a write was
    /// found stored. Does not wait.
    pub fn poll_persisted(&mut self, output: &mut Output<M::Applied>) -> Result<bool, NodeError> {
        if self.in_flight.is_empty() {
            return Ok(false);
        }
        let stored = self.raw.mut_store().persisted()?;
        let mut newest = None;
        while let Some(front) = self.in_flight.front() {
            if front.write > stored {
                break;
            }
            let Some(done) = self.in_flight.pop_front() else {
                break;
            };
            let sent = output.messages.len();
            output.messages.extend(done.held);
            self.note_told(&output.messages[sent..]);
            newest = Some(done.ready);
        }
        let Some(newest) = newest else {
            return Ok(false);
        };
        self.raw.on_persist_ready(newest);
        self.tell_applied();
        Ok(true)
    }

    /// [`Node::poll_persisted`] then [`Node::start`], again while either did something, with
    /// at most [`WRITES_IN_FLIGHT`] writes in flight and for at most [`STARTS_PER_PASS`]
    /// rounds: a ready that
    /// writes nothing new (a follower's forward alone) is stored as soon as the writes before
    /// it are, and what Raft makes of a stored write may be ready at once, so both go on
    /// here rather than at the next input. False when the bound cut it short (work is left
    /// that no completion will announce: the owner drives again at once).
    pub fn pump(&mut self, output: &mut Output<M::Applied>) -> Result<bool, NodeError> {
        for _ in 0..STARTS_PER_PASS {
            let stored = self.poll_persisted(output)?;
            let started = self.writes_in_flight() < WRITES_IN_FLIGHT && self.start(output)?;
            if !stored && !started {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Writes of [`Node::start`] not yet known stored.
    #[must_use]
    pub fn writes_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Installs a snapshot Raft handed over: the store replaces its log with it (durably),
    /// and the machine restarts from its data.
    fn install(&mut self, snapshot: Snapshot) -> Result<(), NodeError> {
        let state = M::restore(snapshot.get_data()).map_err(|error| NodeError::Undecodable {
            index: snapshot.get_metadata().index,
            error,
        })?;
        self.raw.mut_store().apply_snapshot(snapshot)?;
        self.state = state;
        Ok(())
    }

    fn apply(
        &mut self,
        entries: Vec<Entry>,
        output: &mut Output<M::Applied>,
    ) -> Result<(), NodeError> {
        for entry in entries {
            if entry.index <= self.state.applied_index() {
                continue;
            }
            if entry.get_entry_type() != EntryType::EntryNormal || entry.data.is_empty() {
                // A new leader's empty entry (or a membership change, which the static peer
                // list never proposes): nothing to apply, but the index is taken.
                self.state.skip(entry.index);
                continue;
            }
            let applied = self
                .state
                .apply(entry.index, &entry.data)
                .map_err(|error| NodeError::Undecodable {
                    index: entry.index,
                    error,
                })?;
            output.applied.push(applied);
        }
        Ok(())
    }

    /// Compacts the log behind a snapshot once enough entries are applied (`advance` does it
    /// after its passes; a caller of [`Node::start`] after its own).
    pub fn compact_if_due(&mut self) -> Result<(), NodeError> {
        if self.compaction_due()? {
            let applied = self.state.applied_index();
            let data = self.state.snapshot();
            self.compact_to(applied, data)?;
        }
        Ok(())
    }

    /// Whether enough entries (or entry bytes) are applied behind the snapshot for a
    /// compaction ([`NodeConfig::compact_after`], [`NodeConfig::compact_after_bytes`]), or
    /// the store asks for one ([`LogStore::relocation_due`]) and an entry is applied behind
    /// the snapshot.
    pub fn compaction_due(&self) -> Result<bool, NodeError> {
        let first = self.raw.store().first_index()?;
        let applied = self.state.applied_index();
        let due = (applied + 1).saturating_sub(first) > self.compact_after
            || self.raw.store().live_bytes() > self.compact_after_bytes
            || self.raw.store().relocation_due();
        Ok(applied >= first && due)
    }

    /// Compacts the log up to `index` behind `data`, the machine's [`Machine::snapshot`]
    /// taken when `index` was its applied index (a caller that must wait before compacting,
    /// as a replicated shard waits for its record log, takes the snapshot first and compacts
    /// later). Does nothing when `index` is already compacted.
    pub fn compact_to(&mut self, index: u64, data: Vec<u8>) -> Result<(), NodeError> {
        let first = self.raw.store().first_index()?;
        if index < first || index > self.state.applied_index() {
            return Ok(());
        }
        self.raw.mut_store().compact(index, data)?;
        self.state.compacted(index);
        Ok(())
    }

    /// The node's view of the group.
    pub fn status(&self) -> NodeStatus {
        let raft = &self.raw.raft;
        let role = match raft.state {
            StateRole::Follower => Role::Follower,
            StateRole::Candidate => Role::Candidate,
            StateRole::PreCandidate => Role::PreCandidate,
            StateRole::Leader => Role::Leader,
        };
        let last_index = raft.raft_log.last_index();
        let peers = if role == Role::Leader {
            let mut peers: Vec<PeerProgress> = raft
                .prs()
                .iter()
                .map(|(id, progress)| PeerProgress {
                    id: *id,
                    matched: progress.matched,
                    lag: last_index.saturating_sub(progress.matched),
                })
                .collect();
            peers.sort_by_key(|p| p.id);
            peers
        } else {
            Vec::new()
        };
        NodeStatus {
            id: raft.id,
            role,
            leader: (raft.leader_id != raft::INVALID_ID).then_some(raft.leader_id),
            term: raft.term,
            commit: raft.raft_log.committed,
            applied: self.state.applied_index(),
            last_index,
            peers,
        }
    }
}

/// Encodes a Raft message for the peer transport.
#[must_use]
pub fn encode_message(message: &Message) -> Vec<u8> {
    protobuf::Message::write_to_bytes(message).expect("a raft message always encodes")
}

/// Decodes a Raft message from a peer frame.
pub fn decode_message(bytes: &[u8]) -> Result<Message, protobuf::ProtobufError> {
    protobuf::Message::parse_from_bytes(bytes)
}

/// An in-memory log store, for the simulations and unit tests. By default `persist` and
/// `persist_begin` are immediate and the store is the "disk" a simulated crash keeps (the
/// node restarts on it). A [`MemLog::delayed`] one keeps [`LogStore::persist_begin`]'s
/// writes in flight until the simulation completes them ([`MemLog::complete_next`]), as a
/// Felix log's rounds are: they are readable at once, and a crash keeps only the stored ones
/// ([`MemLog::crash_copy`]). What waits in `raft_log.rs` (a snapshot installed, a
/// compaction, `persist`, `persist_end`) stores every write in flight first, as there.
#[derive(Debug, Clone, Default)]
pub struct MemLog {
    hard_state: HardState,
    conf_state: ConfState,
    /// The snapshot the entries follow (index 0: none), its data the state at its index.
    snapshot: Snapshot,
    entries: Vec<Entry>,
    /// A delayed store's writes in flight and its stored state.
    delay: Option<Box<Delay>>,
}

/// The writes a [`MemLog::delayed`] store has in flight, and what is stored.
#[derive(Debug, Clone, Default)]
struct Delay {
    /// Writes begun and not stored yet, oldest first.
    in_flight: VecDeque<(Vec<Entry>, Option<HardState>)>,
    /// Writes begun since the store was made.
    writes: u64,
    /// The store as the stored writes made it (never delayed itself).
    stored: MemLog,
}

impl MemLog {
    /// A store whose writes stay in flight until [`MemLog::complete_next`].
    #[must_use]
    pub fn delayed() -> MemLog {
        MemLog {
            delay: Some(Box::default()),
            ..MemLog::default()
        }
    }

    /// Writes in flight ([`MemLog::delayed`]; 0 otherwise).
    #[must_use]
    pub fn writes_in_flight(&self) -> usize {
        self.delay.as_ref().map_or(0, |delay| delay.in_flight.len())
    }

    /// Stores the oldest write in flight (in order: `raft_log.rs` counts a write stored only
    /// once every write before it is). False when none was in flight.
    pub fn complete_next(&mut self) -> bool {
        let Some(delay) = &mut self.delay else {
            return false;
        };
        let Some((entries, hard_state)) = delay.in_flight.pop_front() else {
            return false;
        };
        delay.stored.write(&entries, hard_state.as_ref());
        true
    }

    /// What a crash leaves of the store: only its stored writes, as a delayed store again.
    #[must_use]
    pub fn crash_copy(&self) -> MemLog {
        match &self.delay {
            None => self.clone(),
            Some(delay) => MemLog {
                delay: Some(Box::new(Delay {
                    stored: delay.stored.clone(),
                    ..Delay::default()
                })),
                ..delay.stored.clone()
            },
        }
    }

    /// Stores every write in flight, then applies `change` to what is stored too (a change
    /// that waits for the disk).
    fn stored_too(
        &mut self,
        change: impl Fn(&mut MemLog) -> Result<(), NodeError>,
    ) -> Result<(), NodeError> {
        while self.complete_next() {}
        if let Some(delay) = &mut self.delay {
            change(&mut delay.stored)?;
        }
        change(self)
    }

    /// Index of the snapshot the entries follow.
    fn snapshot_index(&self) -> u64 {
        self.snapshot.get_metadata().index
    }

    /// Appends `entries` (an entry at index `i` replaces `i` and everything after it) and
    /// takes `hard_state`.
    fn write(&mut self, entries: &[Entry], hard_state: Option<&HardState>) {
        if let Some(first) = entries.first() {
            let snapshot_index = self.snapshot_index();
            assert!(
                first.index > snapshot_index,
                "append below the snapshot: raft-rs never asks for it"
            );
            let keep = usize::try_from(first.index - snapshot_index - 1).expect("in memory");
            assert!(keep <= self.entries.len(), "append leaves no gap");
            self.entries.truncate(keep);
            self.entries.extend_from_slice(entries);
        }
        if let Some(hard_state) = hard_state {
            self.hard_state = hard_state.clone();
        }
    }
}

fn store_error(error: raft::StorageError) -> raft::Error {
    raft::Error::Store(error)
}

impl Storage for MemLog {
    fn initial_state(&self) -> raft::Result<raft::RaftState> {
        Ok(raft::RaftState::new(
            self.hard_state.clone(),
            self.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: raft::GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.snapshot_index() {
            return Err(store_error(raft::StorageError::Compacted));
        }
        assert!(
            high <= self.last_index()? + 1,
            "entries past the last index asked for"
        );
        let offset = self.snapshot_index() + 1;
        let from = usize::try_from(low - offset).expect("an index in memory");
        let to = usize::try_from(high - offset).expect("an index in memory");
        let mut entries = self.entries[from..to].to_vec();
        raft::util::limit_size(&mut entries, max_size.into());
        Ok(entries)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        let snapshot_index = self.snapshot_index();
        if index == snapshot_index {
            return Ok(self.snapshot.get_metadata().term);
        }
        if index < snapshot_index {
            return Err(store_error(raft::StorageError::Compacted));
        }
        let position = usize::try_from(index - snapshot_index - 1).expect("an index in memory");
        self.entries
            .get(position)
            .map(|entry| entry.term)
            .ok_or(store_error(raft::StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.snapshot_index() + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.snapshot_index() + self.entries.len() as u64)
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        if self.snapshot_index() < request_index {
            return Err(store_error(
                raft::StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        let mut snapshot = self.snapshot.clone();
        snapshot
            .mut_metadata()
            .set_conf_state(self.conf_state.clone());
        Ok(snapshot)
    }
}

impl LogStore for MemLog {
    fn bootstrap(&mut self, conf_state: ConfState) -> Result<(), NodeError> {
        self.stored_too(|log| {
            log.conf_state = conf_state.clone();
            Ok(())
        })
    }

    fn persist(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<(), NodeError> {
        self.stored_too(|log| {
            log.write(entries, hard_state);
            Ok(())
        })
    }

    fn persist_begin(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<u64, NodeError> {
        let Some(delay) = &mut self.delay else {
            self.persist(entries, hard_state)?;
            return Ok(0);
        };
        delay
            .in_flight
            .push_back((entries.to_vec(), hard_state.cloned()));
        delay.writes += 1;
        let number = delay.writes;
        self.write(entries, hard_state);
        Ok(number)
    }

    fn persisted(&mut self) -> Result<u64, NodeError> {
        Ok(self.delay.as_ref().map_or(u64::MAX, |delay| {
            delay.writes - delay.in_flight.len() as u64
        }))
    }

    fn persist_end(&mut self) -> Result<(), NodeError> {
        while self.complete_next() {}
        Ok(())
    }

    fn persist_commit(&mut self, commit: u64) -> Result<(), NodeError> {
        self.stored_too(|log| {
            log.hard_state.commit = commit;
            Ok(())
        })
    }

    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<(), NodeError> {
        self.stored_too(|log| log.install(snapshot.clone()))
    }

    fn compact(&mut self, upto: u64, data: Vec<u8>) -> Result<(), NodeError> {
        self.stored_too(|log| log.compact_to(upto, data.clone()))
    }
}

impl MemLog {
    fn install(&mut self, mut snapshot: Snapshot) -> Result<(), NodeError> {
        let metadata = snapshot.get_metadata().clone();
        if metadata.index <= self.snapshot_index() {
            return Ok(());
        }
        // Entries past the snapshot that agree with it stay (the log matching property);
        // otherwise the log restarts at the snapshot.
        let agrees = self.term(metadata.index).ok() == Some(metadata.term);
        if agrees {
            let drop = usize::try_from(metadata.index - self.snapshot_index()).expect("in memory");
            self.entries.drain(..drop);
        } else {
            self.entries.clear();
        }
        self.hard_state.term = self.hard_state.term.max(metadata.term);
        self.hard_state.commit = self.hard_state.commit.max(metadata.index);
        self.conf_state = snapshot.mut_metadata().take_conf_state();
        self.snapshot = snapshot;
        Ok(())
    }

    fn compact_to(&mut self, upto: u64, data: Vec<u8>) -> Result<(), NodeError> {
        if upto <= self.snapshot_index() {
            return Ok(());
        }
        let term = self.term(upto)?;
        let mut snapshot = Snapshot::default();
        snapshot.set_data(data.into());
        let metadata = snapshot.mut_metadata();
        metadata.index = upto;
        metadata.term = term;
        metadata.set_conf_state(self.conf_state.clone());
        let drop = usize::try_from(upto - self.snapshot_index()).expect("in memory");
        self.entries.drain(..drop);
        self.snapshot = snapshot;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{Batch, ShardRecord, ShardState};

    type ShardNode = Node<MemLog, ShardState>;

    /// Three members of a shard group, member 1 elected.
    fn group(lazy_commit: bool) -> BTreeMap<u64, ShardNode> {
        let mut nodes = BTreeMap::new();
        let mut election_tick = 0;
        for id in 1..=3 {
            let mut config = NodeConfig::new(id, vec![1, 2, 3]);
            config.randomized_timeouts = false;
            config.lazy_commit = lazy_commit;
            election_tick = config.election_tick;
            let node = Node::with_machine(&config, MemLog::default(), ShardState::default())
                .expect("node");
            nodes.insert(id, node);
        }
        // Only member 1's clock runs: it campaigns after its election timeout and wins.
        for _ in 0..=election_tick {
            nodes.get_mut(&1).expect("member 1").tick();
        }
        settle(&mut nodes);
        assert!(nodes[&1].is_leader(), "member 1 leads");
        nodes
    }

    /// Advances every member and delivers every message until none is left.
    fn settle(nodes: &mut BTreeMap<u64, ShardNode>) {
        for _ in 0..100 {
            let mut out = Vec::new();
            for node in nodes.values_mut() {
                out.extend(node.advance().expect("advance").messages);
            }
            if out.is_empty() {
                return;
            }
            for message in out {
                let to = nodes.get_mut(&message.to).expect("a member");
                to.step(message).expect("step");
            }
        }
        panic!("the group never went quiet");
    }

    fn batch(sequence: u64) -> Vec<u8> {
        Batch {
            producer: 7,
            sequence,
            client: None,
            records: vec![ShardRecord {
                timestamp_us: sequence,
                key: bytes::Bytes::new(),
                payload: bytes::Bytes::from_static(b"x"),
            }],
        }
        .encode()
    }

    fn next_offsets(nodes: &BTreeMap<u64, ShardNode>) -> Vec<u64> {
        nodes
            .values()
            .map(|node| node.state().next_offset())
            .collect()
    }

    /// Proposes batch `sequence` through member `via` and lets the group settle.
    fn propose(nodes: &mut BTreeMap<u64, ShardNode>, via: u64, sequence: u64) {
        let node = nodes.get_mut(&via).expect("a member");
        node.propose_data(batch(sequence)).expect("propose");
        settle(nodes);
    }

    #[test]
    fn a_lazy_leader_tells_a_commit_with_the_next_append_or_when_asked() {
        let mut nodes = group(true);
        propose(&mut nodes, 1, 1);
        // Committed and applied on the leader; the followers were not sent the commit.
        assert_eq!(next_offsets(&nodes), [1, 0, 0]);
        assert!(nodes[&1].commit_untold());
        // The next batch's append carries the first one's commit.
        propose(&mut nodes, 1, 2);
        assert_eq!(next_offsets(&nodes), [2, 1, 1]);
        assert!(nodes[&1].commit_untold());
        // Asked, the leader tells it (heartbeats).
        nodes.get_mut(&1).expect("leader").tell_commit();
        settle(&mut nodes);
        assert_eq!(next_offsets(&nodes), [2, 2, 2]);
        assert!(!nodes[&1].commit_untold());
        // A batch a follower forwarded is committed everywhere at once: that follower answers
        // its caller when it applies it.
        propose(&mut nodes, 2, 3);
        assert_eq!(next_offsets(&nodes), [3, 3, 3]);
        assert!(!nodes[&1].commit_untold());
        // And lazy again after it.
        propose(&mut nodes, 1, 4);
        assert_eq!(next_offsets(&nodes), [4, 3, 3]);
    }

    #[test]
    fn an_eager_leader_tells_every_commit_at_once() {
        let mut nodes = group(false);
        propose(&mut nodes, 1, 1);
        assert_eq!(next_offsets(&nodes), [1, 1, 1]);
        assert!(!nodes[&1].commit_untold());
    }
}
