//! The cluster member as a running service: one `felix-cluster` thread per broker, a thin
//! loop around the sans-IO [`Member`] (`member.rs`) on the system storage backend and the
//! peer transport (`transport.rs`): it waits for the next tick, peer frame, request,
//! subscription change or completed shard-group write (the shared Raft logs' eventfds), hands
//! it to the member, advances it, sends its frames, publishes its status and view, and
//! delivers its answers. The data-plane cores never wait for it, and it never waits for a
//! shard group's write.
//!
//! Threads: the service's own thread runs a current-thread tokio runtime (the transport's
//! tasks run there too). Other threads talk to it through [`Service`]'s methods, which queue a
//! request on a channel; blocking variants for tools wait for the answer with a deadline.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
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
        let thread = std::thread::Builder::new()
            .name("felix-cluster".to_owned())
            .spawn(move || run(config, (inbox, control_inbox), stopped, ready_tx))
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
    let outcome = runtime.block_on(serve(config, inbox, stopped, ready));
    if let Err(error) = &outcome {
        tracing::error!(%error, "the cluster service stopped: this member no longer takes part");
    }
    outcome
}

async fn serve(
    config: ServiceConfig,
    (mut inbox, mut control_inbox): Inboxes,
    mut stopped: oneshot::Receiver<()>,
    ready: std::sync::mpsc::Sender<Started>,
) -> Result<(), ServiceError> {
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
        });
    let setup = async {
        let member = Member::open(
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
        )?;
        let (transport, frames) = PeerTransport::start(TransportConfig {
            node_id: config.member.id,
            bind: config.peer_bind,
            peers: config.peers.clone(),
            identity: config.identity.clone(),
            ca_pem: config.ca_pem.clone(),
        })
        .map_err(|error| ServiceError::Start(format!("the peer endpoint: {error}")))?;
        Ok::<_, ServiceError>((member, transport, frames))
    };
    let (mut member, transport, mut frames) = match setup.await {
        Ok(parts) => parts,
        Err(error) => {
            let _ = ready.send(Err(ServiceError::Start(error.to_string())));
            return Err(error);
        }
    };
    transmit(&mut member, &transport);
    let status = Arc::new(Mutex::new(member.status()));
    let (view, view_watched) = tokio::sync::watch::channel(Arc::new(ClusterView::new(
        member.id(),
        member.state(),
        &[],
        &MemoryShards::new(member.id()),
    )));
    let _ = ready.send(Ok((
        transport.local_addr(),
        Arc::clone(&status),
        view_watched,
    )));
    let mut wakes = Wakes::default();
    wakes.update(&member)?;
    let outcome = async {
        loop {
            tokio::select! {
                _ = &mut stopped => return Ok(()),
                () = wakes.readable() => {}
                () = tokio::time::sleep_until(member.poll_timeout().into()) => {
                    member.handle_tick(std::time::Instant::now(), &transport.connected_peers())?;
                }
                Some(inbound) = frames.recv() => {
                    let now = std::time::Instant::now();
                    member.handle_peer_frame(now, inbound.from, &inbound.frame);
                    // Everything else already queued goes in before the nodes advance, so one
                    // Ready (one append and one fdatasync per group) covers it all: group
                    // commit under load.
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
            answer(&mut member, &status, &view);
            wakes.update(&member)?;
        }
    }
    .await;
    member.stop();
    while let Some(answered) = member.poll_answer() {
        answered.deliver();
    }
    outcome
}

/// The eventfds of the member's shard-group logs ([`Member::wake_fds`]), registered with
/// the runtime: readable when a write completes.
#[derive(Default)]
struct Wakes {
    fds: Vec<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
}

impl Wakes {
    /// Takes the member's eventfds again when the set changed (a shared log opened).
    fn update<B: felix_storage::Backend>(
        &mut self,
        member: &Member<B>,
    ) -> Result<(), ServiceError> {
        if !member.wake_fds_changed(self.fds.len()) {
            return Ok(());
        }
        let wake_error =
            |error: std::io::Error| ServiceError::Start(format!("a shard log's eventfd: {error}"));
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
        Ok(())
    }

    /// Waits until one of the eventfds is readable and clears its readiness (the member's
    /// advance reads it: `felix_storage::Log::reap`). Never returns without eventfds.
    async fn readable(&self) {
        match self.fds.as_slice() {
            [] => std::future::pending().await,
            [one] => clear(one).await,
            [first, second, ..] => tokio::select! {
                () = clear(first) => {}
                () = clear(second) => {}
            },
        }
    }
}

/// Waits for `fd` to be readable and clears the readiness.
async fn clear(fd: &tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>) {
    match fd.readable().await {
        Ok(mut guard) => guard.clear_ready(),
        // Not expected of a registered eventfd; the ticks still drive the logs.
        Err(_) => std::future::pending().await,
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
