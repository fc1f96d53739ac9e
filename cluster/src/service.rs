//! The cluster member as a running service: a thin loop around the sans-IO [`Member`]
//! (`member.rs`) on the system storage backend and the peer transport (`transport.rs`): it
//! waits for the next tick, peer frame, request, subscription change or completed shard-group
//! write (the shared Raft logs' eventfds), hands it to the member, advances it, sends its
//! frames, publishes its status and view, and delivers its answers. It never waits for a
//! shard group's write.
//!
//! Threads: the loop runs on one current-thread tokio runtime with the transport's tasks:
//! in a broker, data-plane core 0's ([`Service::hosted`]; `dataplane/broker/src/cluster.rs`),
//! for tools and tests a `felix-cluster` thread of its own ([`Service::start`]). Other
//! threads (and core 0's other tasks) talk to it through [`Service`]'s methods, which queue a
//! request on a channel; blocking variants for tools wait for the answer with a deadline and
//! must never be called on the loop's own thread.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::control::{Command, ControlState, Member as MemberEntry, Outcome, StreamKind};
use crate::groups::{group_id, system_backends};
use crate::member::{Member, MemberConfig, Request, SubscriptionControl};
use crate::memory::MemoryShards;
use crate::node::{NodeError, NodeStatus, ProposeError};
use crate::pki::NodeIdentity;
use crate::publish::{PublishAnswer, PublishError};
use crate::records::RecordsConfig;
use crate::shard::ShardRecord;
use crate::subscribe::{SubscribeRequest, SubscriptionSink};
use crate::transport::{PeerTransport, TransportConfig};

/// The logical clock's period: elections after 1-2 s without a leader, heartbeats every
/// 200 ms (`NodeConfig::new`).
pub const TICK: Duration = Duration::from_millis(100);

/// Requests queued for the service's thread (publishes from every data-plane core included;
/// beyond, a publish is refused at once with `PublishError::Busy`).
const REQUESTS_MAX: usize = 4_096;

/// What a broker needs to run its part of the control plane.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// This broker's member entry (id, client and peer addresses, cores).
    pub member: MemberEntry,
    /// Where the peer endpoint listens (port 0: any; `Service::peer_addr` tells).
    pub peer_bind: SocketAddr,
    /// Every other member's id and peer address (the static peer list).
    pub peers: BTreeMap<u64, SocketAddr>,
    /// This broker's certificate and key, issued by the cluster CA.
    pub identity: NodeIdentity,
    /// The cluster CA (PEM) that every peer's certificate must chain to.
    pub ca_pem: String,
    /// The largest QUIC datagram the peer endpoints probe for (FELIX_MTU_UPPER_BOUND).
    pub peer_max_mtu: u16,
    /// The control plane's Raft log directory.
    pub dir: PathBuf,
    /// How the replicated shards' record logs are kept (`records.rs`): their fdatasync
    /// interval, also that of the shard groups of `--fsync periodic` streams
    /// (FELIX_DURABLE_FSYNC_INTERVAL_MS), their retention, the Raft logs' compaction.
    pub records: RecordsConfig,
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
    /// The shard groups' shared Raft logs this member has opened, one per fsync mode.
    #[serde(default)]
    pub raft_logs: Vec<crate::groups::RaftLogStatus>,
}

impl ClusterStatus {
    /// A member whose service has not opened it yet: a follower that knows no leader.
    #[must_use]
    pub fn not_started(id: u64) -> Self {
        ClusterStatus {
            node: NodeStatus {
                id,
                role: crate::node::Role::Follower,
                leader: None,
                term: 0,
                commit: 0,
                applied: 0,
                last_index: 0,
                peers: Vec::new(),
            },
            state: ControlState::default(),
            connected: Vec::new(),
            shards: Vec::new(),
            subscriptions: 0,
            raft_logs: Vec::new(),
        }
    }
}

/// Called exactly once with a request's outcome, on the service loop's thread (it must not block):
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

/// A running control-plane service. Dropping it stops the service's loop and waits for it
/// (unless dropped on the thread that runs the loop, which then stops at its next turn).
///
/// The loop runs either on a thread of its own ([`Service::start`]: tools and tests) or on a
/// runtime the caller owns ([`Service::hosted`]: a broker's core 0, `dataplane/broker`).
pub struct Service {
    requests: mpsc::Sender<Request>,
    subscription_control: mpsc::UnboundedSender<SubscriptionControl>,
    view: tokio::sync::watch::Receiver<Arc<ClusterView>>,
    status: Arc<Mutex<ClusterStatus>>,
    peer_addr: Arc<OnceLock<SocketAddr>>,
    stop: Option<oneshot::Sender<()>>,
    /// The loop's outcome, sent when it ends; its sender dropped if the loop was dropped.
    ended: Mutex<std::sync::mpsc::Receiver<Result<(), ServiceError>>>,
    lifecycle: Arc<Lifecycle>,
    /// The service's own thread ([`Service::start`]).
    thread: Option<JoinHandle<()>>,
}

/// What the service and its loop both know of the loop's life.
#[derive(Debug, Default)]
struct Lifecycle {
    /// The loop ended (its member stopped or failed), or never opened.
    finished: AtomicBool,
    /// The thread the loop runs on, once it runs.
    thread: OnceLock<std::thread::ThreadId>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("peer_addr", &self.peer_addr.get())
            .finish_non_exhaustive()
    }
}

/// A [`Service`]'s loop before it runs ([`Service::hosted`]): [`ServiceTask::open`] opens the
/// member on the caller's runtime, then [`OpenedService::run`] serves.
pub struct ServiceTask {
    config: ServiceConfig,
    inbox: Inboxes,
    stopped: oneshot::Receiver<()>,
    shared: Shared,
}

impl std::fmt::Debug for ServiceTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceTask")
            .field("member", &self.config.member.id)
            .finish_non_exhaustive()
    }
}

/// What the loop publishes to its [`Service`].
struct Shared {
    status: Arc<Mutex<ClusterStatus>>,
    view: tokio::sync::watch::Sender<Arc<ClusterView>>,
    peer_addr: Arc<OnceLock<SocketAddr>>,
    ended: std::sync::mpsc::Sender<Result<(), ServiceError>>,
    lifecycle: Arc<Lifecycle>,
}

/// A [`Service`]'s member, opened, and its peer endpoint, started: [`OpenedService::run`]
/// serves until the service is stopped (or `also_stop` resolves).
pub struct OpenedService {
    member: Member<felix_storage::SystemBackend>,
    transport: PeerTransport,
    frames: mpsc::Receiver<crate::transport::Inbound>,
    inbox: Inboxes,
    stopped: oneshot::Receiver<()>,
    shared: Shared,
}

impl std::fmt::Debug for OpenedService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedService")
            .field("member", &self.member.id())
            .finish_non_exhaustive()
    }
}

/// How long a stop waits for the loop to close its logs.
const STOP_WAIT: Duration = Duration::from_secs(30);

impl Service {
    /// Opens (or recovers) the Raft logs, binds the peer endpoint and serves on a thread of
    /// its own (`felix-cluster`); returns once the member is open.
    pub fn start(config: ServiceConfig) -> Result<Service, ServiceError> {
        let id = config.member.id;
        let (mut service, task) = Service::hosted(config);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("felix-cluster".to_owned())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(error) => {
                        let _ = ready_tx.send(Err(ServiceError::Start(format!(
                            "the cluster runtime: {error}"
                        ))));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match task.open().await {
                        Ok(opened) => {
                            let _ = ready_tx.send(Ok(()));
                            opened.run(std::future::pending()).await;
                        }
                        Err(error) => {
                            let _ = ready_tx.send(Err(error));
                        }
                    }
                });
            })
            .map_err(|error| ServiceError::Start(format!("spawn the cluster thread: {error}")))?;
        let opened = ready_rx.recv_timeout(Duration::from_secs(60));
        match opened {
            Ok(Ok(())) => {
                service.thread = Some(thread);
                Ok(service)
            }
            Ok(Err(error)) => {
                let _ = thread.join();
                Err(error)
            }
            Err(_) => {
                let outcome = thread.join();
                Err(ServiceError::Start(format!(
                    "member {id}: the cluster thread stopped before it was ready: {outcome:?}"
                )))
            }
        }
    }

    /// The service and its loop, not yet running: the caller opens the member with
    /// [`ServiceTask::open`] on a tokio runtime of its own (a current-thread runtime, the
    /// member's state is not `Send`), then runs [`OpenedService::run`] there. Until it opened,
    /// requests queue and [`Service::status`] shows the member as not started.
    #[must_use]
    pub fn hosted(config: ServiceConfig) -> (Service, ServiceTask) {
        let (requests, inbox) = mpsc::channel(REQUESTS_MAX);
        let (subscription_control, control_inbox) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel();
        let (ended_tx, ended) = std::sync::mpsc::channel();
        let status = Arc::new(Mutex::new(ClusterStatus::not_started(config.member.id)));
        let (view_tx, view) = tokio::sync::watch::channel(Arc::new(ClusterView {
            member: config.member.id,
            ..ClusterView::default()
        }));
        let peer_addr = Arc::new(OnceLock::new());
        let lifecycle = Arc::new(Lifecycle::default());
        let service = Service {
            requests,
            subscription_control,
            view,
            status: Arc::clone(&status),
            peer_addr: Arc::clone(&peer_addr),
            stop: Some(stop),
            ended: Mutex::new(ended),
            lifecycle: Arc::clone(&lifecycle),
            thread: None,
        };
        let task = ServiceTask {
            config,
            inbox: (inbox, control_inbox),
            stopped,
            shared: Shared {
                status,
                view: view_tx,
                peer_addr,
                ended: ended_tx,
                lifecycle,
            },
        };
        (service, task)
    }

    /// The cluster as this member sees it, updated whenever it changes (checked at every
    /// tick and control-plane change): the data-plane cores route by it (`felix_core`'s
    /// `cluster.rs`).
    #[must_use]
    pub fn view(&self) -> tokio::sync::watch::Receiver<Arc<ClusterView>> {
        self.view.clone()
    }

    /// Where the peer endpoint listens (once the member opened; before, the configured
    /// address's port 0 is not known and this is `None`).
    #[must_use]
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr.get().copied()
    }

    /// Whether the service's loop ended on its own (a fatal error, logged: a failed fsync of a
    /// Raft log stops this member's part rather than letting it vote or ack falsely).
    #[must_use]
    pub fn failed(&self) -> bool {
        self.lifecycle.finished.load(Ordering::Acquire)
    }

    /// The control plane as this broker last saw it (updated after every event).
    #[must_use]
    pub fn status(&self) -> ClusterStatus {
        self.status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Proposes `command`; `answer` is called once, on the service loop's thread, when it is
    /// applied on this broker (any broker may propose: a follower forwards to the leader), or with
    /// [`ServiceError::Timeout`] once `timeout` passed (the proposal may still commit). Never
    /// blocks: a data-plane core's admin request comes this way.
    pub fn propose_then(&self, command: Command, timeout: Duration, answer: Answer<Outcome>) {
        self.queue(Request::Propose {
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

    /// Hands a data-plane core's request (`link::route`) to the thread. Never blocks: a full
    /// queue answers a request at once with `Busy`, a stopped service with `Stopped`.
    pub fn submit(&self, routed: crate::link::Routed) {
        match routed {
            crate::link::Routed::Request(request) => self.queue(request),
            crate::link::Routed::Subscription(control) => {
                // A service that stopped drops a subscription's sink, which then hears
                // `Ended(Stopped)`.
                let _ = self.subscription_control.send(control);
            }
        }
    }

    /// Queues `request` for the thread; a full queue answers it [`ServiceError::Busy`] (a
    /// publish [`PublishError::Busy`]) at once, a stopped service `Stopped` (its answer
    /// dropped).
    fn queue(&self, request: Request) {
        if let Err(mpsc::error::TrySendError::Full(request)) = self.requests.try_send(request) {
            match request {
                Request::Propose { answer, .. } => answer.answer(Err(ServiceError::Busy {
                    pending: REQUESTS_MAX,
                })),
                Request::Read { answer, .. } => answer.answer(Err(ServiceError::Busy {
                    pending: REQUESTS_MAX,
                })),
                Request::Publish {
                    stream,
                    shard,
                    answer,
                    ..
                } => answer.answer(Err(PublishError::Busy {
                    stream,
                    shard,
                    pending: REQUESTS_MAX,
                })),
            }
        }
    }

    /// Publishes `records` into shard `shard` of the replicated (durable) stream `stream`
    /// through this member's producer on the shard (`publish.rs`). Never blocks: `answer` is
    /// called once, on the service loop's thread, with the records' offsets once the batch
    /// is committed (a majority including the leader has it fsynced) and applied here, or with
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
            producer: None,
            timeout,
            answer,
        };
        self.queue(request);
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
        self.queue(Request::Read {
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
    /// Never blocks: `sink` hears, on the service loop's thread, `Started` or `Refused`, then a
    /// batch of committed records per credit (at most `subscribe::CREDITS` in flight; give one back
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

    /// Stops the loop and waits for it; returns its error, if it failed.
    pub fn shutdown(mut self) -> Result<(), ServiceError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), ServiceError> {
        let Some(stop) = self.stop.take() else {
            return Ok(());
        };
        let _ = stop.send(());
        // On the loop's own thread the loop cannot end while this waits: it stops when the
        // thread gets back to it (or ends with its runtime).
        if self.lifecycle.thread.get() == Some(&std::thread::current().id()) {
            return Ok(());
        }
        let ended = self
            .ended
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .recv_timeout(STOP_WAIT);
        // A loop that did not end in time keeps its thread (joining it could wait forever).
        if !matches!(ended, Err(std::sync::mpsc::RecvTimeoutError::Timeout))
            && let Some(thread) = self.thread.take()
        {
            let _ = thread.join();
        }
        match ended {
            Ok(outcome) => outcome,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                Err(ServiceError::Timeout(STOP_WAIT))
            }
            // The loop was dropped before it ended (its runtime went first), or never opened.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(ServiceError::Stopped),
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

type Inboxes = (
    mpsc::Receiver<Request>,
    mpsc::UnboundedReceiver<SubscriptionControl>,
);

impl ServiceTask {
    /// Opens (or recovers) the member's Raft logs (blocking while recovery reads them) and
    /// starts the peer endpoint on the current tokio runtime; the service's status and view
    /// show the member from then on. A failure ends the service ([`Service::failed`]).
    pub async fn open(self) -> Result<OpenedService, ServiceError> {
        let ServiceTask {
            config,
            inbox,
            stopped,
            shared,
        } = self;
        let _ = shared.lifecycle.thread.set(std::thread::current().id());
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
            });
        let opened = Member::open(
            MemberConfig {
                member: config.member.clone(),
                peers: config.peers.keys().copied().collect(),
                dir: config.dir.clone(),
                records: config.records,
                boot,
                fixed_election_tick: None,
            },
            std::time::Instant::now(),
            system_backends(),
        )
        .and_then(|member| {
            let (transport, frames) = PeerTransport::start(TransportConfig {
                node_id: config.member.id,
                bind: config.peer_bind,
                peers: config.peers.clone(),
                identity: config.identity.clone(),
                ca_pem: config.ca_pem.clone(),
                max_mtu: config.peer_max_mtu,
            })
            .map_err(|error| ServiceError::Start(format!("the peer endpoint: {error}")))?;
            Ok((member, transport, frames))
        });
        let (mut member, transport, frames) = match opened {
            Ok(parts) => parts,
            Err(error) => {
                tracing::error!(%error, "the cluster member did not open");
                shared.lifecycle.finished.store(true, Ordering::Release);
                return Err(error);
            }
        };
        let _ = shared.peer_addr.set(transport.local_addr());
        transmit(&mut member, &transport);
        answer(&mut member, &shared.status, &shared.view);
        Ok(OpenedService {
            member,
            transport,
            frames,
            inbox,
            stopped,
            shared,
        })
    }
}

impl OpenedService {
    /// This member's id.
    #[must_use]
    pub fn member_id(&self) -> u64 {
        self.member.id()
    }

    /// Where the peer endpoint listens.
    #[must_use]
    pub fn peer_addr(&self) -> SocketAddr {
        self.transport.local_addr()
    }

    /// Serves until the [`Service`] is stopped or dropped, `also_stop` resolves (a broker's
    /// shutdown), or the member fails; then stops the member (its logs closed cleanly) and
    /// answers what is still waiting. Never blocks on a shard group's write.
    pub async fn run(self, also_stop: impl std::future::Future<Output = ()>) {
        let OpenedService {
            mut member,
            transport,
            mut frames,
            inbox: (mut inbox, mut control_inbox),
            mut stopped,
            shared,
        } = self;
        let mut also_stop = std::pin::pin!(also_stop);
        let mut wakes = Wakes::default();
        let outcome = async {
            wakes.update(&member)?;
            loop {
                tokio::select! {
                    _ = &mut stopped => return Ok(()),
                    () = &mut also_stop => return Ok(()),
                    () = wakes.readable() => {}
                    () = tokio::time::sleep_until(member.poll_timeout().into()) => {
                        member.handle_tick(std::time::Instant::now(), &transport.connected_peers())?;
                    }
                    Some(inbound) = frames.recv() => {
                        let now = std::time::Instant::now();
                        member.handle_peer_frame(now, inbound.from, &inbound.frame);
                        // Everything else already queued goes in before the nodes advance, so
                        // one Ready (one append and one fdatasync per group) covers it all:
                        // group commit under load.
                        for _ in 0..BATCH_MAX {
                            let Ok(inbound) = frames.try_recv() else { break };
                            member.handle_peer_frame(now, inbound.from, &inbound.frame);
                        }
                    }
                    Some(request) = inbox.recv() => {
                        let now = std::time::Instant::now();
                        member.handle_request(now, request);
                        for _ in 0..BATCH_MAX {
                            let Ok(request) = inbox.try_recv() else { break };
                            member.handle_request(now, request);
                        }
                    }
                    Some(control) = control_inbox.recv() => {
                        member.handle_subscription(control);
                        while let Ok(control) = control_inbox.try_recv() {
                            member.handle_subscription(control);
                        }
                    }
                }
                // The member never waits for its shard groups' writes: their completions wake
                // this loop (`wakes`), and the peer tasks take the frames while the disk works.
                member.advance(std::time::Instant::now())?;
                transmit(&mut member, &transport);
                answer(&mut member, &shared.status, &shared.view);
                wakes.update(&member)?;
            }
        }
        .await;
        if let Err(error) = &outcome {
            tracing::error!(%error, "the cluster service stopped: this member no longer takes part");
        }
        member.stop();
        while let Some(answered) = member.poll_answer() {
            answered.deliver();
        }
        shared.lifecycle.finished.store(true, Ordering::Release);
        let _ = shared.ended.send(outcome);
    }
}

/// The eventfds of the member's logs ([`Member::wake_fds`]: the control plane's, the shard
/// groups' shared logs and their record logs), registered with the runtime: readable when a
/// write completes or a read's bytes were fetched.
#[derive(Default)]
struct Wakes {
    fds: Vec<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
    /// The [`Member::wake_version`] `fds` were taken at.
    version: Option<u64>,
}

impl Wakes {
    /// Takes the member's eventfds again when the set changed (a shard group started or
    /// stopped).
    fn update<B: felix_storage::Backend>(
        &mut self,
        member: &Member<B>,
    ) -> Result<(), ServiceError> {
        let version = member.wake_version();
        if self.version == Some(version) {
            return Ok(());
        }
        let wake_error = |error: std::io::Error| {
            ServiceError::Start(format!("a cluster log's eventfd: {error}"))
        };
        self.fds = member
            .wake_fds()
            .map_err(wake_error)?
            .into_iter()
            .map(|fd| {
                // SAFETY: `fd` is an OwnedFd this AsyncFd takes by value: it stays open
                // exactly as long as the registration and nothing else can close it.
                unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(std::io::Error::from)
            })
            .collect::<Result<_, _>>()
            .map_err(wake_error)?;
        self.version = Some(version);
        Ok(())
    }

    /// Waits until one of the eventfds is readable and clears its readiness (the member's
    /// advance reads it: `felix_storage::Log::reap`). Never returns without eventfds.
    async fn readable(&self) {
        std::future::poll_fn(|cx| {
            for fd in &self.fds {
                // An error is not expected of a registered eventfd; the ticks still drive
                // the logs.
                if let std::task::Poll::Ready(Ok(mut guard)) = fd.poll_read_ready(cx) {
                    guard.clear_ready();
                    return std::task::Poll::Ready(());
                }
            }
            std::task::Poll::Pending
        })
        .await;
    }
}

/// Publishes the member's status and view when they changed, then answers its callers
/// (after the status shows what they waited for).
fn answer<B: felix_storage::Backend>(
    member: &mut Member<B>,
    status: &Mutex<ClusterStatus>,
    view: &tokio::sync::watch::Sender<Arc<ClusterView>>,
) {
    if member.status_due() {
        let mut shown = status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = member.update_status(&mut shown);
        drop(shown);
        view.send_if_modified(|known| {
            let changed = **known != now;
            if changed {
                *known = Arc::new(now);
            }
            changed
        });
    }
    while let Some(answered) = member.poll_answer() {
        answered.deliver();
    }
}

/// Hands the member's frames to the peer transport and tells it how each went.
fn transmit<B: felix_storage::Backend>(member: &mut Member<B>, transport: &PeerTransport) {
    while let Some(out) = member.poll_transmit() {
        let sent = transport.send(out.to, out.lane, out.frame);
        member.handle_transmitted(out.to, out.about, sent);
    }
}

/// Most queued frames or requests taken in after the one that woke the service, before the
/// member advances (`serve`).
const BATCH_MAX: usize = 256;

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
