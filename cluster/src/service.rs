//! The control plane as a running service: one `felix-cluster` thread per broker that owns
//! the Raft node (`node.rs`) on its durable log (`raft_log.rs`) and the peer transport
//! (`transport.rs`), ticks it every [`TICK`], steps the frames peers send, sends what the
//! node produces, registers the broker, and answers proposals and status requests from other
//! threads. The data-plane cores never wait for it.
//!
//! Threads: the service's own thread runs a current-thread tokio runtime (the transport's
//! tasks run there too). Other threads talk to it through [`Service`]'s methods, which send
//! a request over a channel and wait for the answer with a deadline.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use raft::prelude::MessageType;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::control::{Command, ControlState, Member, Outcome, StreamKind};
use crate::groups::{CONTROL_GROUP, Groups, group_id};
use crate::memory::{DATA_GROUP, DataFrame, Forwards, MemoryShards};
use crate::node::{Node, NodeConfig, NodeError, NodeStatus, ProposeError};
use crate::pki::NodeIdentity;
use crate::publish::{PublishAnswer, PublishError};
use crate::raft_log::RaftLog;
use crate::records::RecordsConfig;
use crate::shard::ShardRecord;
use crate::subscribe::{SubscribeRequest, SubscriptionSink, Subscriptions, View};
use crate::transport::{PeerCut, PeerTransport, TransportConfig};

/// The logical clock's period: elections after 1-2 s without a leader, heartbeats every
/// 200 ms (`NodeConfig::new`).
pub const TICK: Duration = Duration::from_millis(100);

/// How often an unregistered broker asks to be registered.
const REGISTER_EVERY_TICKS: u64 = 10;

/// Requests queued for the service's thread (publishes from every data-plane core included;
/// beyond, a publish is refused at once with `PublishError::Busy`).
const REQUESTS_MAX: usize = 4_096;

/// What a broker needs to run its part of the control plane.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// This broker's member entry (id, client and peer addresses, cores).
    pub member: Member,
    /// Where the peer endpoint listens (port 0: any; `Service::peer_addr` tells).
    pub peer_bind: SocketAddr,
    /// Every other member's id and peer address (the static peer list).
    pub peers: BTreeMap<u64, SocketAddr>,
    /// This broker's certificate and key, issued by the cluster CA.
    pub identity: NodeIdentity,
    /// The cluster CA (PEM) that every peer's certificate must chain to.
    pub ca_pem: String,
    /// The control plane's Raft log directory.
    pub dir: PathBuf,
    /// How the replicated shards' record logs are kept (`records.rs`): their fdatasync
    /// interval, also that of the shard groups of `--fsync periodic` streams
    /// (FELIX_DURABLE_FSYNC_INTERVAL_MS), their retention, the Raft logs' compaction.
    pub records: RecordsConfig,
    /// Whether [`Service::cut_peers`] may cut links (FELIX_CLUSTER_FAULT_INJECTION).
    pub fault_injection: bool,
}

/// Why the service failed or a request did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("cluster start-up: {0}")]
    Start(String),
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error(transparent)]
    Propose(#[from] ProposeError),
    #[error("no answer within {0:?} (the proposal may still commit; check `felix cluster status`)")]
    Timeout(Duration),
    #[error("the cluster service stopped")]
    Stopped,
    #[error("the cluster service has {pending} requests queued: ask again")]
    Busy { pending: usize },
    #[error("read: {0}")]
    Read(String),
    #[error("fault injection is off on this member (FELIX_CLUSTER_FAULT_INJECTION=1 enables it)")]
    FaultInjectionOff,
}

/// A snapshot of the control plane as this broker sees it (`felix cluster status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub node: NodeStatus,
    pub state: ControlState,
    /// Peer ids whose connection is up now.
    pub connected: Vec<u64>,
    /// The replicated shards this member holds (`groups.rs`).
    pub shards: Vec<crate::groups::ShardStatus>,
    /// Subscriptions to cluster streams this member serves (`subscribe.rs`).
    #[serde(default)]
    pub subscriptions: usize,
}

/// Ticks a proposal may take before it is proposed again.
const PROPOSE_AGAIN_TICKS: u64 = 10;

/// Called exactly once with a request's outcome, on the cluster thread (it must not block):
/// the answer to a proposal ([`Service::propose_then`]) or a read ([`Service::read_then`]).
/// An answer dropped without being called (a request still queued when the service stops)
/// answers [`ServiceError::Stopped`], so no caller waits forever.
pub struct Answer<T>(Option<AnswerFn<T>>);

type AnswerFn<T> = Box<dyn FnOnce(Result<T, ServiceError>) + Send>;

impl<T> Answer<T> {
    pub fn new(answer: impl FnOnce(Result<T, ServiceError>) + Send + 'static) -> Self {
        Answer(Some(Box::new(answer)))
    }

    /// Answers the caller.
    pub fn answer(mut self, result: Result<T, ServiceError>) {
        if let Some(answer) = self.0.take() {
            answer(result);
        }
    }
}

impl<T> Drop for Answer<T> {
    fn drop(&mut self) {
        if let Some(answer) = self.0.take() {
            answer(Err(ServiceError::Stopped));
        }
    }
}

impl<T> std::fmt::Debug for Answer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Answer(waiting)"
        } else {
            "Answer(answered)"
        })
    }
}

/// A proposal a caller waits for.
struct Waiting {
    command: Command,
    answer: Answer<Outcome>,
    /// When the caller stops waiting (it is then answered [`ServiceError::Timeout`]).
    deadline: std::time::Instant,
    timeout: Duration,
    proposed_at: u64,
}

enum Request {
    Propose {
        command: Command,
        answer: Answer<Outcome>,
        timeout: Duration,
    },
    Publish {
        stream: String,
        shard: u32,
        records: Vec<ShardRecord>,
        deadline: std::time::Instant,
        timeout: Duration,
        answer: PublishAnswer,
    },
    Read {
        stream: String,
        shard: u32,
        from: u64,
        max_records: usize,
        answer: Answer<Vec<(u64, ShardRecord)>>,
    },
}

/// Subscribes, credits and unsubscribes: on a channel of their own, in one order (an
/// unsubscribe never overtakes its subscribe), never refused (a lost credit would stall a
/// subscription for good). Bounded by the subscriptions the callers hold (the broker's
/// subscription limits): one subscribe, at most `subscribe::CREDITS` credits and one
/// unsubscribe each.
enum SubscriptionControl {
    Subscribe {
        request: SubscribeRequest,
        sink: SubscriptionSink,
    },
    Credit(u64),
    Unsubscribe(u64),
}

/// The cluster as this member sees it, for the data-plane cores: the members' client
/// addresses and, per replicated (durable) stream, each shard's leader and this member's
/// offsets. Rebuilt at every tick and control-plane change; the cores route publishes,
/// subscriptions, describes and `DescribeCluster` by it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// This member's id.
    pub member: u64,
    /// Client address of each registered member, by id.
    pub members: BTreeMap<u64, String>,
    /// Each cluster stream: its kind and its shards, shard 0 first.
    pub streams: BTreeMap<String, StreamView>,
}

/// One stream in a [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamView {
    pub kind: StreamKind,
    pub shards: Vec<ShardView>,
}

/// One shard in a [`ClusterView`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardView {
    /// A replicated shard: its group's leader as this member knows it; for a shard this member
    /// holds no copy of, the placed leader. An in-memory shard: its owner.
    pub leader: Option<u64>,
    /// This member's copy: the oldest offset held and the next one (0 and 0 without a copy).
    pub oldest_offset: u64,
    pub next_offset: u64,
}

impl ClusterView {
    /// The view of `state` with the shard groups' `shards` (their status on this member) and
    /// the in-memory shards this member owns.
    #[must_use]
    pub fn new(
        member: u64,
        state: &ControlState,
        shards: &[crate::groups::ShardStatus],
        memory: &MemoryShards,
    ) -> Self {
        let members = state
            .members
            .iter()
            .map(|(id, m)| (*id, m.client_addr.clone()))
            .collect();
        let by_group: HashMap<u64, &crate::groups::ShardStatus> =
            shards.iter().map(|status| (status.group, status)).collect();
        let streams = state
            .streams
            .values()
            .map(|stream| {
                let views = stream
                    .shards
                    .iter()
                    .enumerate()
                    .map(|(shard, placement)| {
                        let shard = u32::try_from(shard).unwrap_or(u32::MAX);
                        if stream.kind == StreamKind::InMemory {
                            let (oldest_offset, next_offset) = memory
                                .get((stream.incarnation, shard))
                                .map_or((0, 0), crate::memory::MemoryShard::range);
                            return ShardView {
                                leader: Some(placement.leader),
                                oldest_offset,
                                next_offset,
                            };
                        }
                        let group = group_id(stream.incarnation, shard);
                        match by_group.get(&group) {
                            Some(status) => ShardView {
                                leader: status.leader,
                                oldest_offset: status.oldest_offset,
                                next_offset: status.next_offset,
                            },
                            None => ShardView {
                                leader: Some(placement.leader),
                                ..ShardView::default()
                            },
                        }
                    })
                    .collect();
                (
                    stream.name.clone(),
                    StreamView {
                        kind: stream.kind,
                        shards: views,
                    },
                )
            })
            .collect();
        ClusterView {
            member,
            members,
            streams,
        }
    }
}

/// A running control-plane service. Dropping it stops the thread.
pub struct Service {
    requests: mpsc::Sender<Request>,
    subscription_control: mpsc::UnboundedSender<SubscriptionControl>,
    view: tokio::sync::watch::Receiver<Arc<ClusterView>>,
    status: Arc<Mutex<ClusterStatus>>,
    peer_addr: SocketAddr,
    /// Peers whose links are cut (fault injection: [`Service::cut_peers`]).
    cut: Arc<PeerCut>,
    fault_injection: bool,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), ServiceError>>>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("peer_addr", &self.peer_addr)
            .finish_non_exhaustive()
    }
}

impl Service {
    /// Opens (or recovers) the Raft log, binds the peer endpoint and starts the thread.
    pub fn start(config: ServiceConfig) -> Result<Service, ServiceError> {
        let (requests, inbox) = mpsc::channel(REQUESTS_MAX);
        let (subscription_control, control_inbox) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let id = config.member.id;
        let fault_injection = config.fault_injection;
        let cut = Arc::new(PeerCut::default());
        let transport_cut = Arc::clone(&cut);
        let thread = std::thread::Builder::new()
            .name("felix-cluster".to_owned())
            .spawn(move || {
                run(
                    config,
                    (inbox, control_inbox),
                    transport_cut,
                    stopped,
                    ready_tx,
                )
            })
            .map_err(|error| ServiceError::Start(format!("spawn the cluster thread: {error}")))?;
        let started = ready_rx.recv_timeout(Duration::from_secs(60));
        let (peer_addr, status, view) = match started {
            Ok(Ok(started)) => started,
            Ok(Err(error)) => {
                let _ = thread.join();
                return Err(error);
            }
            Err(_) => {
                let outcome = thread.join();
                return Err(ServiceError::Start(format!(
                    "member {id}: the cluster thread stopped before it was ready: {outcome:?}"
                )));
            }
        };
        Ok(Service {
            requests,
            subscription_control,
            view,
            status,
            peer_addr,
            cut,
            fault_injection,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The cluster as this member sees it, updated whenever it changes (checked at every
    /// tick and control-plane change): the data-plane cores route by it (`felix_core`'s
    /// `cluster.rs`).
    #[must_use]
    pub fn view(&self) -> tokio::sync::watch::Receiver<Arc<ClusterView>> {
        self.view.clone()
    }

    /// Cuts this member's links to exactly `peers` (empty: all whole again): frames to and
    /// from them are dropped from now on, as in a network partition, while the connections
    /// stay up. For fault tests (the broker's `POST /v1/cluster/faults`, enabled by
    /// FELIX_CLUSTER_FAULT_INJECTION); a partition needs the cut on both sides of each link.
    pub fn cut_peers(&self, peers: std::collections::BTreeSet<u64>) -> Result<(), ServiceError> {
        if !self.fault_injection {
            return Err(ServiceError::FaultInjectionOff);
        }
        tracing::warn!(?peers, "fault injection: links to these peers cut");
        self.cut.set(peers);
        Ok(())
    }

    /// The peers whose links [`Service::cut_peers`] cut.
    #[must_use]
    pub fn cut(&self) -> Vec<u64> {
        self.cut.peers()
    }

    /// Where the peer endpoint listens.
    #[must_use]
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// Whether the service's thread ended on its own (a fatal error, logged: a failed fsync
    /// of a Raft log stops this member's part rather than letting it vote or ack falsely).
    #[must_use]
    pub fn failed(&self) -> bool {
        self.thread.as_ref().is_some_and(JoinHandle::is_finished)
    }

    /// The control plane as this broker last saw it (updated after every event).
    #[must_use]
    pub fn status(&self) -> ClusterStatus {
        self.status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Proposes `command`; `answer` is called once, on the cluster thread, when it is applied
    /// on this broker (any broker may propose: a follower forwards to the leader), or with
    /// [`ServiceError::Timeout`] once `timeout` passed (the proposal may still commit). Never
    /// blocks: a data-plane core's admin request comes this way.
    pub fn propose_then(&self, command: Command, timeout: Duration, answer: Answer<Outcome>) {
        self.send_request(Request::Propose {
            command,
            answer,
            timeout,
        });
    }

    /// Proposes `command` and waits for [`Service::propose_then`]'s answer. Blocking: for tools
    /// and tests, never for a data-plane core.
    pub fn propose(&self, command: Command, timeout: Duration) -> Result<Outcome, ServiceError> {
        let (answer, answered) = std::sync::mpsc::channel();
        self.propose_then(
            command,
            timeout,
            Answer::new(move |result| {
                let _ = answer.send(result);
            }),
        );
        answered
            .recv_timeout(timeout + Duration::from_secs(5))
            .unwrap_or(Err(ServiceError::Stopped))
    }

    /// Queues an admin `request` (a proposal or a read) for the thread; a full queue answers
    /// it [`ServiceError::Busy`] at once, a stopped service [`ServiceError::Stopped`] (its
    /// answer dropped).
    fn send_request(&self, request: Request) {
        if let Err(mpsc::error::TrySendError::Full(request)) = self.requests.try_send(request) {
            let busy = ServiceError::Busy {
                pending: REQUESTS_MAX,
            };
            match request {
                Request::Propose { answer, .. } => answer.answer(Err(busy)),
                Request::Read { answer, .. } => answer.answer(Err(busy)),
                Request::Publish { .. } => unreachable!("publishes are sent by Service::publish"),
            }
        }
    }

    /// Publishes `records` into shard `shard` of the replicated (durable) stream `stream`
    /// through this member's producer on the shard (`publish.rs`). Never blocks: `answer` is
    /// called once, on the cluster thread, with the records' offsets once the batch is
    /// committed (a majority including the leader has it fsynced) and applied here, or with
    /// why not, at the latest after `timeout`. Any replica may take a publish: a follower's
    /// proposal goes to the shard's leader.
    pub fn publish(
        &self,
        stream: &str,
        shard: u32,
        records: Vec<ShardRecord>,
        timeout: Duration,
        answer: PublishAnswer,
    ) {
        let request = Request::Publish {
            stream: stream.to_owned(),
            shard,
            records,
            deadline: std::time::Instant::now() + timeout,
            timeout,
            answer,
        };
        match self.requests.try_send(request) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(Request::Publish {
                stream,
                shard,
                answer,
                ..
            })) => answer.answer(Err(PublishError::Busy {
                stream,
                shard,
                pending: REQUESTS_MAX,
            })),
            Err(mpsc::error::TrySendError::Closed(Request::Publish { answer, .. })) => {
                answer.answer(Err(PublishError::Stopped));
            }
            Err(_) => unreachable!("the request given back is the publish"),
        }
    }

    /// Publishes and waits for the answer (at most `timeout` and a little): for tools and
    /// tests, never for a data-plane core.
    pub fn publish_wait(
        &self,
        stream: &str,
        shard: u32,
        records: Vec<ShardRecord>,
        timeout: Duration,
    ) -> Result<crate::publish::PublishAck, PublishError> {
        let (answer, answered) = std::sync::mpsc::channel();
        self.publish(
            stream,
            shard,
            records,
            timeout,
            PublishAnswer::new(move |result| {
                let _ = answer.send(result);
            }),
        );
        answered
            .recv_timeout(timeout + Duration::from_secs(5))
            .unwrap_or(Err(PublishError::Stopped))
    }

    /// Reads up to `max_records` committed records of shard `shard` of `stream` from offset
    /// `from`, out of this member's copy: `answer` hears `(offset, record)` in offset order,
    /// empty at the end, or [`ServiceError::Read`] (no such replicated shard here, or `from`
    /// no longer held). Never blocks.
    pub fn read_then(
        &self,
        stream: &str,
        shard: u32,
        from: u64,
        max_records: usize,
        answer: Answer<Vec<(u64, ShardRecord)>>,
    ) {
        self.send_request(Request::Read {
            stream: stream.to_owned(),
            shard,
            from,
            max_records,
            answer,
        });
    }

    /// [`Service::read_then`], waiting for the answer (at most `timeout`): for tools and tests.
    pub fn read(
        &self,
        stream: &str,
        shard: u32,
        from: u64,
        max_records: usize,
        timeout: Duration,
    ) -> Result<Vec<(u64, ShardRecord)>, ServiceError> {
        let (answer, answered) = std::sync::mpsc::channel();
        self.read_then(
            stream,
            shard,
            from,
            max_records,
            Answer::new(move |result| {
                let _ = answer.send(result);
            }),
        );
        match answered.recv_timeout(timeout) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(ServiceError::Timeout(timeout)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(ServiceError::Stopped),
        }
    }

    /// Subscribes to shards of a replicated stream on this member's copy (`subscribe.rs`).
    /// Never blocks: `sink` hears, on the cluster thread, `Started` or `Refused`, then a batch
    /// of committed records per credit (at most `subscribe::CREDITS` in flight; give one back
    /// with [`Service::credit`] for each batch written), until `Ended`.
    pub fn subscribe(&self, request: SubscribeRequest, sink: SubscriptionSink) {
        // A service that stopped drops the sink, which then hears `Ended(Stopped)`.
        let _ = self
            .subscription_control
            .send(SubscriptionControl::Subscribe { request, sink });
    }

    /// Subscription `id`'s caller wrote one of its batches.
    pub fn credit(&self, id: u64) {
        let _ = self
            .subscription_control
            .send(SubscriptionControl::Credit(id));
    }

    /// Subscription `id`'s caller is gone: it is forgotten (its sink hears nothing more).
    pub fn unsubscribe(&self, id: u64) {
        let _ = self
            .subscription_control
            .send(SubscriptionControl::Unsubscribe(id));
    }

    /// Stops the thread and waits for it; returns its error, if it failed.
    pub fn shutdown(mut self) -> Result<(), ServiceError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), ServiceError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread.join().map_err(|_| ServiceError::Stopped)?,
            None => Ok(()),
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

type Started = Result<
    (
        SocketAddr,
        Arc<Mutex<ClusterStatus>>,
        tokio::sync::watch::Receiver<Arc<ClusterView>>,
    ),
    ServiceError,
>;

type Inboxes = (
    mpsc::Receiver<Request>,
    mpsc::UnboundedReceiver<SubscriptionControl>,
);

fn run(
    config: ServiceConfig,
    inbox: Inboxes,
    cut: Arc<PeerCut>,
    stopped: oneshot::Receiver<()>,
    ready: std::sync::mpsc::Sender<Started>,
) -> Result<(), ServiceError> {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            let error = ServiceError::Start(format!("the cluster runtime: {error}"));
            let _ = ready.send(Err(ServiceError::Start(error.to_string())));
            return Err(error);
        }
    };
    let outcome = runtime.block_on(serve(config, inbox, cut, stopped, ready));
    if let Err(error) = &outcome {
        tracing::error!(%error, "the cluster service stopped: this member no longer takes part");
    }
    outcome
}

async fn serve(
    config: ServiceConfig,
    (mut inbox, mut control_inbox): Inboxes,
    cut: Arc<PeerCut>,
    mut stopped: oneshot::Receiver<()>,
    ready: std::sync::mpsc::Sender<Started>,
) -> Result<(), ServiceError> {
    let id = config.member.id;
    let setup = async {
        let store = RaftLog::open(&config.dir)
            .map_err(|error| ServiceError::Start(format!("the raft log: {error}")))?;
        let mut voters: Vec<u64> = config.peers.keys().copied().collect();
        voters.push(id);
        let node = Node::new(&NodeConfig::new(id, voters), store)?;
        let (transport, frames) = PeerTransport::start(TransportConfig {
            node_id: id,
            bind: config.peer_bind,
            peers: config.peers.clone(),
            identity: config.identity.clone(),
            ca_pem: config.ca_pem.clone(),
            cut,
        })
        .map_err(|error| ServiceError::Start(format!("the peer endpoint: {error}")))?;
        Ok::<_, ServiceError>((node, transport, frames))
    };
    let (mut node, transport, mut frames) = match setup.await {
        Ok(parts) => parts,
        Err(error) => {
            let _ = ready.send(Err(ServiceError::Start(error.to_string())));
            return Err(error);
        }
    };
    // Apply what this member knows to be committed (its log up to the stored commit index)
    // before it serves: the cores then know the streams created before a restart at once,
    // rather than answering `stream_not_found` until the first peer message.
    let recovered = node.advance()?;
    send_control(&transport, &mut node, recovered.messages);
    let status = Arc::new(Mutex::new(ClusterStatus {
        node: node.status(),
        state: node.state().clone(),
        connected: Vec::new(),
        shards: Vec::new(),
        subscriptions: 0,
    }));
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
        });
    let mut groups = Groups::new(
        id,
        boot,
        config.dir.with_file_name("shards"),
        config.dir.with_file_name("records"),
        config.records,
    );
    let mut reconciled_at = 0u64;
    let (view, view_watched) = tokio::sync::watch::channel(Arc::new(ClusterView::new(
        id,
        node.state(),
        &[],
        &MemoryShards::new(id),
    )));
    let _ = ready.send(Ok((
        transport.local_addr(),
        Arc::clone(&status),
        view_watched,
    )));
    let mut waiting: HashMap<u64, Waiting> = HashMap::new();
    let mut subscriptions = Subscriptions::default();
    let mut data = Data {
        memory: MemoryShards::new(id),
        forwards: Forwards::default(),
        out: Vec::new(),
    };
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick_count = 0u64;
    let mut registered_sequence: Option<u64> = None;
    // The status snapshot is rebuilt at every tick and after control-plane changes, not after
    // every event (a publish is an event).
    let mut refresh_status = true;
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = ticks.tick() => {
                let now = std::time::Instant::now();
                node.drive_store(now)?;
                node.tick();
                groups.tick(&transport.connected_peers(), now)?;
                tick_count += 1;
                refresh_status = true;
                data.forwards.expire(now);
                data.memory.tick(tick_count, &mut data.out);
                // Callers that gave up (their deadline passed) are forgotten; proposals that did
                // not come back within a second are proposed again (a forward lost on the way
                // to the leader, or dropped by a leader change: raft-rs never retries them).
                // The control plane applies each once (`ControlState::apply_proposal`).
                let expired: Vec<u64> = waiting
                    .iter()
                    .filter(|(_, waiting)| waiting.deadline <= now)
                    .map(|(sequence, _)| *sequence)
                    .collect();
                for sequence in expired {
                    if let Some(gone) = waiting.remove(&sequence) {
                        gone.answer.answer(Err(ServiceError::Timeout(gone.timeout)));
                    }
                }
                for (sequence, waiting) in &mut waiting {
                    if tick_count - waiting.proposed_at >= PROPOSE_AGAIN_TICKS
                        && node.propose_again(*sequence, waiting.command.clone()).is_ok()
                    {
                        waiting.proposed_at = tick_count;
                    }
                }
                let registered = node.state().members.get(&id) == Some(&config.member);
                if !registered && tick_count % REGISTER_EVERY_TICKS == 1 {
                    registered_sequence = node
                        .propose(Command::Register { member: config.member.clone() })
                        .ok();
                }
            }
            Some(inbound) = frames.recv() => {
                let mut peers = Peers {
                    id,
                    node: &mut node,
                    groups: &mut groups,
                    data: &mut data,
                    subscriptions: &mut subscriptions,
                    tick_count,
                };
                peers.frame(&inbound);
                // Everything else already queued goes in before the nodes advance, so one
                // Ready (one append and one fdatasync per group) covers it all: group commit
                // under load.
                for _ in 0..BATCH_MAX {
                    let Ok(inbound) = frames.try_recv() else { break };
                    peers.frame(&inbound);
                }
            }
            Some(request) = inbox.recv() => {
                let mut serving = Serving {
                    id,
                    node: &mut node,
                    groups: &mut groups,
                    waiting: &mut waiting,
                    data: &mut data,
                    tick_count,
                };
                serving.request(request);
                for _ in 0..BATCH_MAX {
                    let Ok(request) = inbox.try_recv() else { break };
                    serving.request(request);
                }
            }
            Some(control) = control_inbox.recv() => {
                let mut control = Some(control);
                while let Some(next) = control.take().or_else(|| control_inbox.try_recv().ok()) {
                    match next {
                        SubscriptionControl::Subscribe { request, sink } => {
                            let view = View {
                                state: node.state(),
                                groups: &groups,
                                memory: &data.memory,
                            };
                            subscriptions.add(request, sink, &view, tick_count);
                        }
                        SubscriptionControl::Credit(id) => subscriptions.credit(id),
                        SubscriptionControl::Unsubscribe(id) => subscriptions.remove(id),
                    }
                }
            }
        }
        let output = node.advance()?;
        send_control(&transport, &mut node, output.messages);
        if node.state().applied != reconciled_at {
            // A shard whose log cannot be opened here (a full disk) stays without this
            // replica: its leader reports it under-replicated. Tried again at the next change.
            if let Err(error) = groups.reconcile(node.state()) {
                tracing::error!(%error, "cannot start a replicated shard on this member");
            }
            data.memory.reconcile(node.state());
            reconciled_at = node.state().applied;
            refresh_status = true;
        }
        // Each pass starts every group's write before it waits for any (the groups' logs
        // fdatasync at the same time). When one group wrote, the runtime first puts the
        // messages that may leave now on the network (a leader's appends: its followers
        // write while it does): a lone publish through the leader acks ~18 % sooner. When
        // several groups wrote, the member is busy and they wait for the pass: sending early
        // then split the work finer and cost ~20 % of a three-shard stream's rate on this
        // CPU-bound machine (docs/performance.md, "Cluster: writes in parallel").
        let sent_early = std::cell::Cell::new(false);
        let mut send = |group: u64, message: &raft::prelude::Message| -> bool {
            sent_early.set(true);
            transport.send(message.to, encode_frame(group, message))
        };
        for _ in 0..crate::node::ADVANCE_PASSES {
            sent_early.set(false);
            let begun = groups.begin_pass(&mut send)?;
            if begun.is_empty() {
                break;
            }
            if sent_early.get() && begun.len() == 1 {
                // The peer task takes the frames and its QUIC stream wakes the endpoint.
                tokio::task::yield_now().await;
            }
            groups.finish_pass(&begun, &mut send)?;
        }
        groups.end_advance()?;
        // Subscribers read what this round applied (and what they have credit for).
        let reading = View {
            state: node.state(),
            groups: &groups,
            memory: &data.memory,
        };
        subscriptions.pump(&reading, tick_count, &mut data.out);
        data.out.extend(groups.take_fetches());
        for (to, frame) in data.out.drain(..) {
            let mut bytes = DATA_GROUP.to_be_bytes().to_vec();
            bytes.extend_from_slice(&frame.encode());
            if !transport.send(to, Bytes::from(bytes))
                && let DataFrame::Publish { request, .. } = frame
            {
                data.forwards.unsent(request, to);
            }
        }
        if refresh_status {
            refresh_status = false;
            let mut shown = status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            shown.node = node.status();
            if shown.state.applied != node.state().applied {
                shown.state = node.state().clone();
            }
            shown.connected = transport.connected_peers();
            shown.shards = groups.status();
            shown.subscriptions = subscriptions.len();
            let now = ClusterView::new(id, node.state(), &shown.shards, &data.memory);
            view.send_if_modified(|known| {
                let changed = **known != now;
                if changed {
                    *known = Arc::new(now);
                }
                changed
            });
        }
        // Callers are answered after the status shows what they waited for.
        for applied in output.applied {
            if !node.proposed(&applied.proposal) {
                continue;
            }
            if let Some(waiting) = waiting.remove(&applied.proposal.sequence) {
                waiting.answer.answer(Ok(applied.outcome));
            } else if Some(applied.proposal.sequence) == registered_sequence {
                tracing::info!(id, "registered with the cluster");
            }
        }
    }
    subscriptions.stop_all();
    Ok(())
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

/// Sends the control plane's messages, telling its node which could not be sent (and the fate
/// of each snapshot).
fn send_control(
    transport: &PeerTransport,
    node: &mut Node<RaftLog>,
    messages: Vec<raft::prelude::Message>,
) {
    for message in messages {
        let to = message.to;
        let snapshot = message.get_msg_type() == MessageType::MsgSnapshot;
        let sent = transport.send(to, encode_frame(CONTROL_GROUP, &message));
        if snapshot {
            node.report_snapshot(to, sent);
        }
        if !sent {
            node.report_unreachable(to);
        }
    }
}

/// Most queued frames or requests taken in after the one that woke the service, before the
/// nodes advance (`serve`).
const BATCH_MAX: usize = 256;

/// A peer's frame: stepped into the control plane's node or the shard group it names.
fn step_frame(
    id: u64,
    inbound: &crate::transport::Inbound,
    node: &mut Node<RaftLog>,
    groups: &mut Groups,
) {
    match decode_frame(&inbound.frame) {
        Ok((group, message)) if message.from == inbound.from && message.to == id => {
            if group == CONTROL_GROUP {
                if let Err(error) = node.step(message) {
                    tracing::debug!(from = inbound.from, %error, "a peer message was refused");
                }
            } else {
                groups.step(group, message);
            }
        }
        Ok((_, message)) => tracing::warn!(
            from = inbound.from,
            claimed = message.from,
            to = message.to,
            "a peer sent a message not from itself or not for this broker; dropped"
        ),
        Err(error) => {
            tracing::warn!(from = inbound.from, %error, "an undecodable peer frame; dropped");
        }
    }
}

/// The in-memory streams' state on the cluster thread (`memory.rs`).
struct Data {
    memory: MemoryShards,
    forwards: Forwards,
    /// Data frames to send at the end of the round, by member.
    out: Vec<(u64, DataFrame)>,
}

/// What a peer's frame works on.
struct Peers<'a> {
    id: u64,
    node: &'a mut Node<RaftLog>,
    groups: &'a mut Groups,
    data: &'a mut Data,
    subscriptions: &'a mut Subscriptions,
    tick_count: u64,
}

impl Peers<'_> {
    /// A peer's frame: a data frame (in-memory shards), else a Raft message.
    fn frame(&mut self, inbound: &crate::transport::Inbound) {
        if inbound.frame.get(..8) != Some(&DATA_GROUP.to_be_bytes()[..]) {
            step_frame(self.id, inbound, self.node, self.groups);
            return;
        }
        let data = &mut *self.data;
        match DataFrame::decode(&inbound.frame.slice(8..)) {
            Ok(DataFrame::Publish {
                request,
                key,
                records,
            }) => {
                let first_offset = data.memory.append(key, records, &mut data.out);
                data.out.push((
                    inbound.from,
                    DataFrame::Published {
                        request,
                        first_offset,
                    },
                ));
            }
            Ok(DataFrame::Published {
                request,
                first_offset,
            }) => data.forwards.answered(request, first_offset, inbound.from),
            Ok(DataFrame::Fetch(fetch)) => {
                data.memory
                    .fetch(inbound.from, &fetch, self.tick_count, &mut data.out);
            }
            Ok(DataFrame::Fetched { request, result }) => {
                self.subscriptions.fetched(request, result);
            }
            Ok(DataFrame::RecordsFetch(fetch)) => {
                data.out
                    .push((inbound.from, self.groups.answer_fetch(&fetch)));
            }
            Ok(DataFrame::RecordsFetched { request, result }) => {
                // A failed record log fails the service at the end of this round.
                if let Err(error) = self.groups.records_fetched(request, result) {
                    tracing::error!(%error, "recording fetched records failed");
                }
            }
            Err(error) => {
                tracing::warn!(from = inbound.from, %error, "an undecodable data frame; dropped");
            }
        }
    }
}

/// What a request from another thread of the broker works on.
struct Serving<'a> {
    id: u64,
    node: &'a mut Node<RaftLog>,
    groups: &'a mut Groups,
    waiting: &'a mut HashMap<u64, Waiting>,
    data: &'a mut Data,
    tick_count: u64,
}

impl Serving<'_> {
    /// A request from another thread of the broker.
    fn request(&mut self, request: Request) {
        let Serving {
            id,
            node,
            groups,
            waiting,
            data,
            tick_count,
        } = self;
        match request {
            Request::Propose {
                command,
                answer,
                timeout,
            } => match node.propose(command.clone()) {
                Ok(sequence) => {
                    waiting.insert(
                        sequence,
                        Waiting {
                            command,
                            answer,
                            deadline: std::time::Instant::now() + timeout,
                            timeout,
                            proposed_at: *tick_count,
                        },
                    );
                }
                Err(error) => answer.answer(Err(error.into())),
            },
            Request::Publish {
                stream,
                shard,
                records,
                deadline,
                timeout,
                answer,
            } => {
                let placed = crate::memory::shard_key(node.state(), &stream, shard);
                if let Some((key, owner)) = placed {
                    // An in-memory shard: appended here by its owner, else forwarded to it.
                    if owner == *id {
                        let count = u32::try_from(records.len()).unwrap_or(u32::MAX);
                        let appended = data.memory.append(key, records, &mut data.out);
                        answer.answer(appended.map_or(
                            Err(PublishError::NotOwner { member: *id }),
                            |first_offset| {
                                Ok(crate::publish::PublishAck {
                                    first_offset,
                                    count,
                                })
                            },
                        ));
                    } else {
                        let by = (deadline, timeout);
                        data.forwards
                            .forward(owner, key, records, by, answer, &mut data.out);
                    }
                    return;
                }
                match shard_group(node.state(), &stream, shard) {
                    Ok(group) if groups.holds(group) => {
                        groups.publish(group, records, deadline, timeout, answer);
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
                let read = shard_group(node.state(), &stream, shard)
                    .map_err(|error| error.to_string())
                    .and_then(|group| groups.read(group, from, max_records));
                answer.answer(read.map_err(ServiceError::Read));
            }
        }
    }
}

/// A peer frame: the group id (big-endian u64; [`CONTROL_GROUP`] for the control plane), then
/// the Raft message.
fn encode_frame(group: u64, message: &raft::prelude::Message) -> Bytes {
    let encoded = crate::node::encode_message(message);
    let mut frame = Vec::with_capacity(8 + encoded.len());
    frame.extend_from_slice(&group.to_be_bytes());
    frame.extend_from_slice(&encoded);
    Bytes::from(frame)
}

fn decode_frame(frame: &[u8]) -> Result<(u64, raft::prelude::Message), String> {
    let (group, message) = frame
        .split_first_chunk::<8>()
        .ok_or_else(|| format!("a frame of {} bytes has no group id", frame.len()))?;
    let message = crate::node::decode_message(message).map_err(|error| error.to_string())?;
    Ok((u64::from_be_bytes(*group), message))
}

/// Parses FELIX_CLUSTER_PEERS: `ID=IP:PORT` entries separated by commas, semicolons or
/// whitespace. Ids are 1..=65535 and appear once; an address appears once.
pub fn parse_members(text: &str) -> Result<BTreeMap<u64, SocketAddr>, String> {
    let mut members = BTreeMap::new();
    for entry in text
        .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
        .filter(|entry| !entry.is_empty())
    {
        let Some((id, addr)) = entry.split_once('=') else {
            return Err(format!("{entry:?} is not ID=IP:PORT"));
        };
        let id: u64 = id
            .parse()
            .ok()
            .filter(|id| (1..=65_535).contains(id))
            .ok_or_else(|| format!("{id:?} in {entry:?} is not a member id 1..=65535"))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} in {entry:?} is not an IP:PORT address"))?;
        if members.values().any(|known| *known == addr) {
            return Err(format!("{addr} is listed twice"));
        }
        if members.insert(id, addr).is_some() {
            return Err(format!("member {id} is listed twice"));
        }
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_parse_and_mistakes_are_named() {
        let members = parse_members("1=127.0.0.1:7501, 2=127.0.0.1:7502;3=[::1]:7503\n").unwrap();
        assert_eq!(members.len(), 3);
        assert_eq!(members[&3], "[::1]:7503".parse().unwrap());
        for (bad, says) in [
            ("1=127.0.0.1:1,1=127.0.0.1:2", "listed twice"),
            ("1=127.0.0.1:1,2=127.0.0.1:1", "listed twice"),
            ("0=127.0.0.1:1", "member id"),
            ("1:127.0.0.1:1", "not ID=IP:PORT"),
            ("1=localhost:1", "IP:PORT"),
        ] {
            let error = parse_members(bad).unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
        }
    }
}
