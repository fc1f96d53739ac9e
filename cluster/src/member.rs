//! One cluster member as a sans-IO state machine: the control plane's Raft node, the shard
//! groups this member holds, its in-memory shards, their forwards and fetches, and the
//! subscriptions it serves. The member never reads a clock, opens a socket or spawns a
//! thread: the time comes with every input, its logs go through the storage [`Backend`] its
//! owner chooses (the system's in a broker, the fault backend in a simulation, which can cut
//! the power under them), and everything it produces is polled.
//!
//! Inputs: [`Member::handle_tick`] (every [`TICK`], with the peers connected now),
//! [`Member::handle_peer_frame`], [`Member::handle_request`] (publishes, proposals, reads),
//! [`Member::handle_subscription`], [`Member::handle_transmitted`] (how a send went).
//! After inputs, and when a shard group's write completes ([`Member::wake_fds`]),
//! [`Member::advance`] drives the Raft nodes (appends, applies, writes begun; it never waits
//! for a shard group's write). Outputs: [`Member::poll_transmit`] (frames for peers),
//! [`Member::poll_answer`] (answers to the callers of requests, in the order they were
//! given), [`Member::poll_timeout`] (when the next tick is due), [`Member::update_status`]
//! (the status and the cores' view).
//!
//! The service's loop (`service.rs`, on the broker's data-plane core 0) is a thin loop around
//! it: it waits for the next input, hands it in, and carries out the outputs on the peer
//! transport.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_storage::{Backend, SystemBackend};
use raft::prelude::{Message, MessageType};

use crate::control::{Command, ControlState, Member as MemberEntry, Outcome, StreamKind};
use crate::groups::{CONTROL_GROUP, Groups, OpenBackend, group_id};
use crate::memory::{DATA_GROUP, DataFrame, Forwards, MemoryShards};
use crate::node::{Applied, Node, NodeConfig, Output};
use crate::publish::{PublishAnswer, PublishError};
use crate::raft_log::{RaftLog, raft_log_config};
use crate::records::RecordsConfig;
use crate::service::{Answer, ClusterStatus, ClusterView, ServiceError, TICK};
use crate::shard::ShardRecord;
use crate::subscribe::{SubscribeRequest, SubscriptionSink, Subscriptions, View};

/// How often an unregistered member asks to be registered.
const REGISTER_EVERY_TICKS: u64 = 10;

/// Ticks a proposal may take before it is proposed again.
const PROPOSE_AGAIN_TICKS: u64 = 10;

/// What a member needs to start.
#[derive(Debug, Clone)]
pub struct MemberConfig {
    /// This member's entry (id, client and peer addresses, cores), registered once it runs.
    pub member: MemberEntry,
    /// The other members' ids (the static peer list, this member excluded).
    pub peers: Vec<u64>,
    /// The control plane's Raft log directory; the shard groups' logs go next to it
    /// (`shards/`, `records/`).
    pub dir: PathBuf,
    /// How the replicated shards' record logs are kept (`records.rs`).
    pub records: RecordsConfig,
    /// This run of the member (its start time in nanoseconds since the Unix epoch, or any
    /// number that differs per run): its proposals and publishes are told from an earlier
    /// run's by it.
    pub boot: u64,
    /// Election timeouts fixed at this many ticks (the control plane's and every shard
    /// group's) instead of drawn by raft-rs's own generator: a simulation draws them per
    /// member from its seed so its runs replay. `None` in a broker.
    pub fixed_election_tick: Option<usize>,
}

/// A request from a caller (a data-plane core, a tool): answered exactly once, through
/// [`Member::poll_answer`].
pub enum Request {
    /// Propose a control-plane command; answered once it is applied here.
    Propose {
        command: Command,
        answer: Answer<Outcome>,
        timeout: Duration,
    },
    /// Publish records into a shard of a cluster stream.
    Publish {
        stream: String,
        shard: u32,
        records: Vec<ShardRecord>,
        deadline: Instant,
        timeout: Duration,
        answer: PublishAnswer,
        /// The client's idempotent producer id and sequence (`ProducerPublish`): the shard
        /// applies the batch once however often it is retried, through any member.
        producer: Option<(u64, u64)>,
    },
    /// Read committed records of a replicated shard from this member's copy.
    Read {
        stream: String,
        shard: u32,
        from: u64,
        max_records: usize,
        answer: Answer<Vec<(u64, ShardRecord)>>,
    },
}

/// Subscribes, credits and unsubscribes, in one order per caller (an unsubscribe never
/// overtakes its subscribe); never refused (a lost credit would stall a subscription).
pub enum SubscriptionControl {
    Subscribe {
        request: SubscribeRequest,
        sink: SubscriptionSink,
    },
    Credit(u64),
    Unsubscribe(u64),
}

/// A frame for peer `to`. The owner sends it and tells [`Member::handle_transmitted`]
/// whether it went.
#[derive(Debug, Clone)]
pub struct Transmit {
    pub to: u64,
    pub frame: Bytes,
    pub about: About,
    /// The peer connection's stream it goes on.
    pub lane: Lane,
}

/// The streams of a peer connection: each has its own queue and is written and read on its
/// own, so a lane held up (flow control, a large frame) never holds back the other
/// (`transport.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Raft's replication: appends, their answers, heartbeats, votes, snapshots.
    Replication = 0,
    /// Publishes forwarded to a leader or an owner (Raft proposals from a follower, in-memory
    /// forwards) and every other data frame (record fetches and their answers, remote
    /// subscriptions' records): never on the replication lane.
    Forward = 1,
}

/// What a [`Transmit`] carries, so the member can act on its fate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum About {
    /// A Raft message of group `group` ([`CONTROL_GROUP`]: the control plane): a peer that
    /// could not be reached is reported to it, and a snapshot's fate always is.
    Raft { group: u64, snapshot: bool },
    /// A publish forwarded to an in-memory shard's owner: answered at once when it could not
    /// be sent.
    Forward { request: u64 },
    /// Any other data frame (fetches, their answers): best effort.
    Data,
}

/// An answer to a request, ready for its caller: [`Answered::deliver`] calls the caller's
/// answer (which must not block).
pub struct Answered(Box<dyn FnOnce() + Send>);

impl Answered {
    /// Hands the outcome to the caller.
    pub fn deliver(self) {
        (self.0)();
    }
}

impl std::fmt::Debug for Answered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Answered")
    }
}

/// A proposal a caller waits for.
struct Waiting {
    command: Command,
    answer: Answer<Outcome>,
    /// When the caller stops waiting (it is then answered [`ServiceError::Timeout`]).
    deadline: Instant,
    timeout: Duration,
    proposed_at: u64,
}

/// The member.
pub struct Member<B: Backend = SystemBackend> {
    id: u64,
    entry: MemberEntry,
    node: Node<RaftLog<B>>,
    groups: Groups<B>,
    memory: MemoryShards,
    forwards: Forwards,
    /// Data frames to send at the end of the round, by member.
    out: Vec<(u64, DataFrame)>,
    subscriptions: Subscriptions,
    waiting: BTreeMap<u64, Waiting>,
    tick_count: u64,
    next_tick: Instant,
    registered_sequence: Option<u64>,
    reconciled_at: u64,
    /// The status is rebuilt at every tick and after control-plane changes, not after
    /// every event (a publish is an event).
    status_due: bool,
    /// The peers connected at the last tick.
    connected: Vec<u64>,
    /// Control-plane entries applied this round, answered once the status shows them.
    applied: Vec<Applied>,
    /// The last [`Member::advance`] left the groups with more to do at once (a group reached
    /// its bound of readies per advance, `groups.rs`): when it ran.
    again: Option<Instant>,
    transmits: VecDeque<Transmit>,
    /// Answers given by the member's parts, in order; shared with the wrappers
    /// [`Member::handle_request`] puts around each caller's answer.
    answered: Arc<Mutex<VecDeque<Answered>>>,
    /// Reads of a member's copy (`Request::Read`) waiting for their record log's bytes to
    /// be fetched from the disk: asked again after each [`Groups::poll_reads`].
    reads_waiting: Vec<WaitingRead>,
}

/// A `Request::Read` whose record log read waits for the disk.
struct WaitingRead {
    group: u64,
    from: u64,
    max_records: usize,
    answer: Answer<Vec<(u64, ShardRecord)>>,
}

impl<B: Backend> std::fmt::Debug for Member<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("id", &self.id)
            .field("groups", &self.groups)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Member<B> {
    /// Opens (or recovers) the control plane's Raft log in `config.dir` on a backend
    /// `open_backend` opens (as every shard group's logs later), and applies what this member
    /// knows to be committed (its log up to the stored commit index) before it serves: the
    /// cores then know the streams created before a restart at once. Blocks on the disk.
    pub fn open(
        config: MemberConfig,
        now: Instant,
        mut open_backend: OpenBackend<B>,
    ) -> Result<Member<B>, ServiceError> {
        let id = config.member.id;
        let backend = open_backend(&config.dir)
            .map_err(|error| ServiceError::Start(format!("the raft log's backend: {error}")))?;
        let store = RaftLog::open_with(raft_log_config(&config.dir), backend)
            .map_err(|error| ServiceError::Start(format!("the raft log: {error}")))?;
        let mut voters = config.peers.clone();
        voters.push(id);
        let mut node_config = NodeConfig::new(id, voters);
        node_config.boot = config.boot;
        if let Some(ticks) = config.fixed_election_tick {
            node_config.election_tick = ticks;
            node_config.randomized_timeouts = false;
        }
        let node = Node::new(&node_config, store)?;
        let mut groups = Groups::with_backends(
            id,
            config.boot,
            config.dir.with_file_name("shards"),
            config.dir.with_file_name("records"),
            config.records,
            open_backend,
        );
        if let Some(ticks) = config.fixed_election_tick {
            groups.fix_timeouts(ticks);
        }
        let mut member = Member {
            id,
            entry: config.member,
            node,
            groups,
            memory: MemoryShards::new(id),
            forwards: Forwards::default(),
            out: Vec::new(),
            subscriptions: Subscriptions::default(),
            waiting: BTreeMap::new(),
            tick_count: 0,
            next_tick: now + TICK,
            registered_sequence: None,
            reconciled_at: 0,
            status_due: true,
            connected: Vec::new(),
            applied: Vec::new(),
            again: None,
            transmits: VecDeque::new(),
            answered: Arc::new(Mutex::new(VecDeque::new())),
            reads_waiting: Vec::new(),
        };
        let recovered = member.node.advance()?;
        member.queue_control(recovered.messages);
        Ok(member)
    }

    /// This member's id.
    #[must_use]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The control plane's state as this member applied it.
    #[must_use]
    pub fn state(&self) -> &ControlState {
        self.node.state()
    }

    /// When [`Member::handle_tick`] is due next: the next tick, or sooner a shard group's
    /// leader whose followers wait for its commit index (`groups.rs`, `COMMIT_TELL_DELAY`),
    /// or at once when the last [`Member::advance`] left work (call it again after the tick).
    /// Besides timeouts and inputs, the shard groups' writes completing is a reason to
    /// advance: [`Member::wake_fds`].
    #[must_use]
    pub fn poll_timeout(&self) -> Instant {
        let due = self
            .groups
            .commit_due()
            .map_or(self.next_tick, |due| due.min(self.next_tick));
        self.again.map_or(due, |again| again.min(due))
    }

    /// What is due at `now` ([`Member::poll_timeout`]), with the peers whose connections are
    /// up: shard-group leaders send their followers a commit index they have waited for, and
    /// once the tick (every [`TICK`]) is due: the Raft logs' background work, the logical
    /// clocks, callers past their deadline answered, proposals that did not come back proposed
    /// again, registration. A storage error is the member's failure (it stops rather than
    /// vote or ack falsely).
    pub fn handle_tick(&mut self, now: Instant, connected: &[u64]) -> Result<(), ServiceError> {
        self.groups.tell_commits(now);
        if now < self.next_tick {
            return Ok(());
        }
        self.next_tick = now + TICK;
        connected.clone_into(&mut self.connected);
        self.node.drive_store(now)?;
        self.node.tick();
        self.groups.tick(connected, now)?;
        self.tick_count += 1;
        self.status_due = true;
        self.forwards.expire(now);
        self.memory.tick(self.tick_count, &mut self.out);
        // Callers that gave up (their deadline passed) are answered; proposals that did not
        // come back within a second are proposed again (a forward lost on the way to the
        // leader, or dropped by a leader change: raft-rs never retries them). The control
        // plane applies each once (`ControlState::apply_proposal`).
        let expired: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(_, waiting)| waiting.deadline <= now)
            .map(|(sequence, _)| *sequence)
            .collect();
        for sequence in expired {
            if let Some(gone) = self.waiting.remove(&sequence) {
                gone.answer.answer(Err(ServiceError::Timeout(gone.timeout)));
            }
        }
        for (sequence, waiting) in &mut self.waiting {
            if self.tick_count - waiting.proposed_at >= PROPOSE_AGAIN_TICKS
                && self
                    .node
                    .propose_again(*sequence, waiting.command.clone())
                    .is_ok()
            {
                waiting.proposed_at = self.tick_count;
            }
        }
        let registered = self.node.state().members.get(&self.id) == Some(&self.entry);
        if !registered && self.tick_count % REGISTER_EVERY_TICKS == 1 {
            self.registered_sequence = self
                .node
                .propose(Command::Register {
                    member: self.entry.clone(),
                })
                .ok();
        }
        Ok(())
    }

    /// A frame from peer `from` (the transport proved who sent it): a data frame (in-memory
    /// shards, fetches), else a Raft message for the control plane or a shard group. A frame
    /// that does not decode, or a message not from `from` or not for this member, is dropped.
    pub fn handle_peer_frame(&mut self, now: Instant, from: u64, frame: &Bytes) {
        if frame.get(..8) != Some(&DATA_GROUP.to_be_bytes()[..]) {
            self.step_frame(from, frame);
            return;
        }
        match DataFrame::decode(&frame.slice(8..)) {
            Ok(DataFrame::Publish {
                request,
                key,
                records,
            }) => {
                let first_offset = self.memory.append(key, records, &mut self.out);
                self.out.push((
                    from,
                    DataFrame::Published {
                        request,
                        first_offset,
                    },
                ));
            }
            Ok(DataFrame::Published {
                request,
                first_offset,
            }) => self.forwards.answered(request, first_offset, from),
            Ok(DataFrame::Fetch(fetch)) => {
                self.memory
                    .fetch(from, &fetch, self.tick_count, &mut self.out);
            }
            Ok(DataFrame::Fetched { request, result }) => {
                self.subscriptions.fetched(request, result);
            }
            Ok(DataFrame::RecordsFetch(fetch)) => self.groups.answer_fetch(from, fetch),
            Ok(DataFrame::RecordsFetched { request, result }) => {
                // A failed record log fails the member at the end of this round.
                if let Err(error) = self.groups.records_fetched(request, result, now) {
                    tracing::error!(%error, "recording fetched records failed");
                }
            }
            Err(error) => {
                tracing::warn!(from, %error, "an undecodable data frame; dropped");
            }
        }
    }

    /// A Raft message for the control plane or a shard group.
    fn step_frame(&mut self, from: u64, frame: &[u8]) {
        match decode_frame(frame) {
            Ok((group, message)) if message.from == from && message.to == self.id => {
                if group == CONTROL_GROUP {
                    if let Err(error) = self.node.step(message) {
                        tracing::debug!(from, %error, "a peer message was refused");
                    }
                } else {
                    self.groups.step(group, message);
                }
            }
            Ok((_, message)) => tracing::warn!(
                from,
                claimed = message.from,
                to = message.to,
                "a peer sent a message not from itself or not for this member; dropped"
            ),
            Err(error) => {
                tracing::warn!(from, %error, "an undecodable peer frame; dropped");
            }
        }
    }

    /// A caller's request. Its answer comes out of [`Member::poll_answer`], exactly once.
    pub fn handle_request(&mut self, now: Instant, request: Request) {
        match request {
            Request::Propose {
                command,
                answer,
                timeout,
            } => {
                let answer = self.defer(answer);
                match self.node.propose(command.clone()) {
                    Ok(sequence) => {
                        self.waiting.insert(
                            sequence,
                            Waiting {
                                command,
                                answer,
                                deadline: now + timeout,
                                timeout,
                                proposed_at: self.tick_count,
                            },
                        );
                    }
                    Err(error) => answer.answer(Err(error.into())),
                }
            }
            Request::Publish {
                stream,
                shard,
                records,
                deadline,
                timeout,
                answer,
                producer,
            } => {
                let answer = self.defer_publish(answer);
                let placed = crate::memory::shard_key(self.node.state(), &stream, shard);
                if let Some((key, owner)) = placed {
                    // An in-memory shard: appended here by its owner, else forwarded to it.
                    if owner == self.id {
                        let count = u32::try_from(records.len()).unwrap_or(u32::MAX);
                        let appended = self.memory.append(key, records, &mut self.out);
                        answer.answer(appended.map_or(
                            Err(PublishError::NotOwner { member: self.id }),
                            |first_offset| {
                                Ok(crate::publish::PublishAck {
                                    first_offset,
                                    count,
                                })
                            },
                        ));
                    } else {
                        self.forwards.forward(
                            owner,
                            key,
                            records,
                            (deadline, timeout),
                            answer,
                            &mut self.out,
                        );
                    }
                    return;
                }
                match shard_group(self.node.state(), &stream, shard) {
                    Ok(group) if self.groups.holds(group) => {
                        self.groups
                            .publish(group, records, deadline, timeout, answer, producer);
                    }
                    Ok(_) => {
                        answer.answer(Err(PublishError::NotReplicatedHere { stream, shard }));
                    }
                    Err(error) => answer.answer(Err(error)),
                }
            }
            Request::Read {
                stream,
                shard,
                from,
                max_records,
                answer,
            } => {
                let answer = self.defer(answer);
                match shard_group(self.node.state(), &stream, shard) {
                    Ok(group) => self.read(WaitingRead {
                        group,
                        from,
                        max_records,
                        answer,
                    }),
                    Err(error) => answer.answer(Err(ServiceError::Read(error.to_string()))),
                }
            }
        }
    }

    /// Answers `read` from this member's copy, or keeps it until its bytes are fetched.
    fn read(&mut self, read: WaitingRead) {
        match self.groups.read(read.group, read.from, read.max_records) {
            Ok(Some(records)) => read.answer.answer(Ok(records)),
            Ok(None) => self.reads_waiting.push(read),
            Err(error) => read.answer.answer(Err(ServiceError::Read(error))),
        }
    }

    /// A subscription's subscribe, credit or unsubscribe. A subscription's records go to its
    /// sink (its delivery path) as the member reads them.
    pub fn handle_subscription(&mut self, control: SubscriptionControl) {
        match control {
            SubscriptionControl::Subscribe { request, sink } => {
                let view = View {
                    state: self.node.state(),
                    groups: &self.groups,
                    memory: &self.memory,
                };
                self.subscriptions
                    .add(request, sink, &view, self.tick_count);
            }
            SubscriptionControl::Credit(id) => self.subscriptions.credit(id),
            SubscriptionControl::Unsubscribe(id) => self.subscriptions.remove(id),
        }
    }

    /// Whether the frame [`Member::poll_transmit`] gave for `to` went (`sent`): an unreachable
    /// peer is reported to the Raft group the message came from, a snapshot's fate always is,
    /// and a forwarded publish that did not go is answered at once.
    pub fn handle_transmitted(&mut self, to: u64, about: About, sent: bool) {
        match about {
            About::Raft { group, snapshot } => {
                if group == CONTROL_GROUP {
                    if snapshot {
                        self.node.report_snapshot(to, sent);
                    }
                    if !sent {
                        self.node.report_unreachable(to);
                    }
                } else {
                    if snapshot {
                        self.groups.report_snapshot(group, to, sent);
                    }
                    if !sent {
                        self.groups.report_unreachable(group, to);
                    }
                }
            }
            About::Forward { request } if !sent => self.forwards.unsent(request, to),
            About::Forward { .. } | About::Data => {}
        }
    }

    /// Drives the Raft nodes after inputs and when their writes complete
    /// ([`Member::wake_fds`]), without waiting for a write: the control plane takes its
    /// stored writes and starts what is ready the way a shard group does ([`Node::pump`]:
    /// its messages queued, what it applied answered at the end, its votes and append
    /// responses held until their write is stored), the shard groups are started or stopped
    /// to match it, and the groups are driven (`groups.rs`, [`Groups::pump`]): writes found
    /// stored let out what they held (votes, append responses) and count for their leader,
    /// every group with something ready sends what may leave at once (a leader's appends
    /// before its own write, so its followers write while it does), applies what is committed
    /// and begins its write, and each shared Raft log starts one round and one fdatasync for
    /// all of them. Then the subscriptions read what was applied, the data frames are queued,
    /// and callers whose batches were applied are answered (through
    /// [`Member::poll_answer`]). A storage error is the member's failure.
    pub fn advance(&mut self, now: Instant) -> Result<(), ServiceError> {
        let mut output = Output::default();
        // Reads that waited for the disk go on with what the record logs fetched.
        self.groups.poll_reads();
        for read in std::mem::take(&mut self.reads_waiting) {
            self.read(read);
        }
        if self.node.writes_in_flight() > 0 {
            // Reaps the control log's finished rounds (its eventfd woke the owner, or a
            // later input came first); a round for what was appended since starts with it.
            self.node.drive_store(now)?;
        }
        let control_settled = self.node.pump(&mut output)?;
        self.node.compact_if_due()?;
        self.queue_control(output.messages);
        self.applied.extend(output.applied);
        if self.node.state().applied != self.reconciled_at {
            // A shard whose log cannot be opened here (a full disk) stays without this
            // replica: its leader reports it under-replicated. Tried again at the next
            // change.
            if let Err(error) = self.groups.reconcile(self.node.state()) {
                tracing::error!(%error, "cannot start a replicated shard on this member");
            }
            self.memory.reconcile(self.node.state());
            self.reconciled_at = self.node.state().applied;
            self.status_due = true;
        }
        let transmits = &mut self.transmits;
        let again = self.groups.pump(now, &mut |group, message| {
            transmits.push_back(raft_transmit(group, message));
        })?;
        self.again = (again || !control_settled).then_some(now);
        self.groups.end_advance(now)?;
        // Subscribers read what this round applied (and what they have credit for).
        let reading = View {
            state: self.node.state(),
            groups: &self.groups,
            memory: &self.memory,
        };
        self.subscriptions
            .pump(&reading, self.tick_count, &mut self.out);
        self.out.extend(self.groups.take_fetches());
        for (to, frame) in self.out.drain(..) {
            let about = match &frame {
                DataFrame::Publish { request, .. } => About::Forward { request: *request },
                _ => About::Data,
            };
            let mut bytes = DATA_GROUP.to_be_bytes().to_vec();
            bytes.extend_from_slice(&frame.encode());
            self.transmits.push_back(Transmit {
                to,
                frame: Bytes::from(bytes),
                about,
                lane: Lane::Forward,
            });
        }
        // Callers of applied proposals are answered after the status that shows them (the
        // owner takes [`Member::update_status`] before [`Member::poll_answer`]).
        for applied in std::mem::take(&mut self.applied) {
            if !self.node.proposed(&applied.proposal) {
                continue;
            }
            if let Some(waiting) = self.waiting.remove(&applied.proposal.sequence) {
                waiting.answer.answer(Ok(applied.outcome));
            } else if Some(applied.proposal.sequence) == self.registered_sequence {
                tracing::info!(id = self.id, "registered with the cluster");
            }
        }
        Ok(())
    }

    /// Copies of the eventfds that become readable when a write completes or a read's bytes
    /// were fetched (the control plane's log first, then the shard groups' shared logs and
    /// their record logs): the owner waits on them with its other inputs and calls
    /// [`Member::advance`] when one is readable. The set changes when
    /// [`Member::wake_version`] does.
    pub fn wake_fds(&self) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
        let mut fds = vec![self.node.store().wake_fd()?];
        fds.extend(self.groups.wake_fds()?);
        Ok(fds)
    }

    /// Changes whenever [`Member::wake_fds`] does (a shard group started or stopped here).
    #[must_use]
    pub fn wake_version(&self) -> u64 {
        self.groups.wake_version()
    }

    /// The next frame to send to a peer.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next answer to a caller, in the order the member gave them.
    pub fn poll_answer(&mut self) -> Option<Answered> {
        self.answered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop_front()
    }

    /// Whether the status changed since [`Member::update_status`] (a tick, a control-plane
    /// change).
    #[must_use]
    pub fn status_due(&self) -> bool {
        self.status_due
    }

    /// Brings `shown` up to date (the control plane's state copied only when it changed) and
    /// returns the view the data-plane cores route by.
    pub fn update_status(&mut self, shown: &mut ClusterStatus) -> ClusterView {
        self.status_due = false;
        shown.node = self.node.status();
        if shown.state.applied != self.node.state().applied {
            shown.state = self.node.state().clone();
        }
        shown.connected.clone_from(&self.connected);
        shown.shards = self.groups.status();
        shown.subscriptions = self.subscriptions.len();
        shown.raft_logs = self.groups.raft_logs();
        ClusterView::new(self.id, self.node.state(), &shown.shards, &self.memory)
    }

    /// The status now (a fresh copy).
    #[must_use]
    pub fn status(&self) -> ClusterStatus {
        ClusterStatus {
            node: self.node.status(),
            state: self.node.state().clone(),
            connected: self.connected.clone(),
            shards: self.groups.status(),
            subscriptions: self.subscriptions.len(),
            raft_logs: self.groups.raft_logs(),
        }
    }

    /// Stops cleanly: every subscription hears that the member stopped, and what the logs
    /// left queued is written (waited for). Requests still waiting are
    /// answered [`ServiceError::Stopped`] when the member is dropped.
    pub fn stop(&mut self) {
        self.subscriptions.stop_all();
        // A clean close: the commit indexes noted since the last writes go to disk, so a
        // restart re-applies up to them at once.
        if let Err(error) = self.node.flush_store() {
            tracing::warn!(%error, "the control plane's log could not be flushed at close");
        }
        self.groups.flush();
    }

    /// Queues the control plane's messages.
    fn queue_control(&mut self, messages: Vec<Message>) {
        for message in messages {
            self.transmits
                .push_back(raft_transmit(CONTROL_GROUP, &message));
        }
    }

    /// Wraps a caller's answer so that answering it queues the answer for
    /// [`Member::poll_answer`] instead of calling the caller.
    fn defer<T: Send + 'static>(&self, answer: Answer<T>) -> Answer<T> {
        let queue = Arc::clone(&self.answered);
        Answer::new(move |result| {
            queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push_back(Answered(Box::new(move || answer.answer(result))));
        })
    }

    /// [`Member::defer`] for a publish's answer.
    fn defer_publish(&self, answer: PublishAnswer) -> PublishAnswer {
        let queue = Arc::clone(&self.answered);
        PublishAnswer::new(move |result| {
            queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push_back(Answered(Box::new(move || answer.answer(result))));
        })
    }
}

/// A Raft message of `group` as a frame for its peer.
fn raft_transmit(group: u64, message: &Message) -> Transmit {
    Transmit {
        to: message.to,
        frame: encode_frame(group, message),
        about: About::Raft {
            group,
            snapshot: message.get_msg_type() == MessageType::MsgSnapshot,
        },
        // A follower's proposal forwarded to the leader is a forward, not replication.
        lane: if message.get_msg_type() == MessageType::MsgPropose {
            Lane::Forward
        } else {
            Lane::Replication
        },
    }
}

/// The shard group of shard `shard` of durable stream `stream`, by the control plane's state.
fn shard_group(state: &ControlState, stream: &str, shard: u32) -> Result<u64, PublishError> {
    let Some(placement) = state
        .streams
        .get(stream)
        .filter(|placement| placement.kind == StreamKind::Durable)
    else {
        return Err(PublishError::NoSuchStream {
            stream: stream.to_owned(),
        });
    };
    if shard as usize >= placement.shards.len() {
        return Err(PublishError::NotReplicatedHere {
            stream: stream.to_owned(),
            shard,
        });
    }
    Ok(group_id(placement.incarnation, shard))
}

/// A peer frame: the group id (big-endian u64; [`CONTROL_GROUP`] for the control plane), then
/// the Raft message.
fn encode_frame(group: u64, message: &Message) -> Bytes {
    let encoded = crate::node::encode_message(message);
    let mut frame = Vec::with_capacity(8 + encoded.len());
    frame.extend_from_slice(&group.to_be_bytes());
    frame.extend_from_slice(&encoded);
    Bytes::from(frame)
}

fn decode_frame(frame: &[u8]) -> Result<(u64, Message), String> {
    let (group, message) = frame
        .split_first_chunk::<8>()
        .ok_or_else(|| format!("a frame of {} bytes has no group id", frame.len()))?;
    let message = crate::node::decode_message(message).map_err(|error| error.to_string())?;
    Ok((u64::from_be_bytes(*group), message))
}
