//! One data-plane core: a pinned thread running a current-thread tokio runtime and a
//! `LocalSet`, its s2n-quic endpoints (its own port, plus its listeners on the shared
//! SO_REUSEPORT port), its engine and its ingress queue. Everything in [`CoreState`] lives on
//! that thread only (`Rc`, `RefCell`, `Cell`); other cores are reached through the
//! [`Mesh`](crate::mesh::Mesh) queues only. No lock is taken on the data path.
//!
//! Every core's engine holds the whole stream catalogue (every stream with all its shards) but
//! only ever receives publishes for the shards it owns (`shard % cores`), so the state of a
//! shard lives on its owner. Catalogue changes go through core 0; describe gathers per-shard
//! state from the owners; subscriptions register on each owner core, which pushes delivery
//! batches back under a credit bound.
//!
//! Durable streams: each core owns its log ([`DurableLog`], opened and recovered in
//! `run_thread` before the core serves). A durable publish is tracked by the engine and
//! answered (ack or error, locally or to the forwarding core) only once its records are
//! committed; its ingress job stays in the queue until then. The `durable_loop` task pumps the
//! log on its eventfd, its periodic-fsync deadline and when a publish or a catch-up read asks.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;
use felix_engine::{
    Engine, EngineConfig, EngineError, EngineEvent, PublishCompletion, PublishToken, ShardState,
    StreamDescription, SubscriptionId,
};
use felix_wire::{
    AckMode, Decoder, DeliveredRecord, ErrorCode, ErrorFrame, Frame, HashKind, HelloOk, Limits,
    PROTOCOL_VERSION, Publish, Record, ShardAck, ShardInfo, ShardSelection, StartPosition,
    StreamInfo, StreamKind, StreamRoute, StreamSummary,
};
use s2n_quic::Server;
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, mpsc, oneshot};

use crate::BrokerError;
use crate::admission::{Admission, AdmissionEvent, Decision, Policy, Ticket};
use crate::catalog::{Catalog, CatalogEntry};
use crate::connection;
use crate::durable::{DurableLog, DurableSettings, fatal_exit};
use crate::mesh::{AdminRequest, CoreMessage, DRAIN_BATCH, Mesh, SPIN_BEFORE_PARK, reset_eventfd};
use crate::metrics::DurableExported;
use crate::metrics::{CoreMetrics, Metrics};
use crate::tls::CertificatePair;
use crate::udp::BoundSocket;

/// Open connections per core beyond which new ones are closed at once with `LimitExceeded`:
/// bounds per-connection state (tasks, buffers); far above what one core serves usefully.
const MAX_CONNECTIONS_PER_CORE: usize = 10_000;
/// Client-opened bidirectional streams per connection (request, publish and subscription
/// streams); enough for a busy client, small enough that one connection cannot exhaust a core.
const MAX_STREAMS_PER_CONNECTION: u64 = 256;
/// How long shutdown waits for connection tasks to end after closing them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// After the last connection task ended: time for the endpoint to transmit the
/// CONNECTION_CLOSE packets before the runtime (and the endpoint task) is dropped.
const CLOSE_PACKET_LINGER: Duration = Duration::from_millis(100);
/// Records per `Delivery` frame: amortizes framing and syscalls while keeping one frame small
/// enough that other subscribers' frames interleave.
pub(crate) const DELIVERY_MAX_RECORDS: usize = 256;
/// Payload bytes per `Delivery` frame (about; at least one record is always taken).
pub(crate) const DELIVERY_MAX_BYTES: usize = 1024 * 1024;
/// A shard map larger than this share of the frame limit is cut short in `HelloOk` (clients
/// can still describe any stream); half leaves room for the rest of the frame.
const HELLO_SHARD_MAP_FRAME_SHARE: usize = 2;
/// Delivery batches an owner core may have in flight to a subscriber core per subscription:
/// 4 x 1 MiB keeps the subscriber's writer busy while bounding cross-core memory; the rest
/// waits in the owner's engine queue, where the lag bound applies as for local subscribers.
const REMOTE_DELIVERY_CREDITS: u32 = 4;
/// Poll interval of the test-only pause knob (TEST_FELIX_PAUSE_CORE_EXECUTOR).
const TEST_PAUSE_POLL: Duration = Duration::from_millis(2);
/// How often the durable loop applies retention (when FELIX_DURABLE_RETENTION_* is set):
/// deleting whole segments is coarse, so checking every few seconds is plenty.
const RETENTION_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// How long a clean shutdown waits for the log to write and fdatasync what it holds.
const DURABLE_SHUTDOWN_FLUSH: Duration = Duration::from_secs(10);
/// The exact refusal text of SPEC section 3.
pub(crate) const INGRESS_EXHAUSTED_MESSAGE: &str = "publish ingress byte budget exhausted";

/// Ingress queue settings of one core.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IngressSettings {
    pub depth: u64,
    pub budget_bytes: u64,
    pub fire_and_forget_waits: bool,
    pub ack_on_commit: bool,
    pub commit_wait: Duration,
}

/// QUIC endpoint settings shared by every endpoint of a core.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QuicSettings {
    pub max_mtu: u16,
    pub conn_recv_window: u64,
    pub stream_recv_window: u64,
}

/// What a core needs to start.
#[derive(Debug)]
pub(crate) struct CoreSettings {
    pub core_index: u16,
    pub cpu: usize,
    pub own_socket: BoundSocket,
    pub shared_sockets: Vec<BoundSocket>,
    pub core_ports: Vec<u16>,
    pub limits: Limits,
    pub engine: EngineConfig,
    pub quic: QuicSettings,
    pub ingress: IngressSettings,
    /// Test-only: while this file exists, cores other than 0 leave their inbound queues alone.
    pub test_pause_file: Option<PathBuf>,
    pub durable: DurableSetup,
}

/// What a core needs for durable streams.
#[derive(Debug)]
pub(crate) struct DurableSetup {
    pub data_dir: PathBuf,
    pub settings: DurableSettings,
    /// The catalogue's streams, restored on every core at start-up.
    pub entries: Vec<CatalogEntry>,
    /// The catalogue itself: core 0 only (it serializes catalogue changes).
    pub catalog: Option<Catalog>,
}

/// What a core reports once it is pinned and its endpoints listen.
#[derive(Debug, Clone)]
pub struct CoreReport {
    pub index: u16,
    pub cpu: usize,
    /// The thread's allowed CPUs read back with sched_getaffinity after pinning.
    pub allowed_cpus: Vec<usize>,
    pub own_addr: SocketAddr,
    pub shared_addrs: Vec<SocketAddr>,
    /// Effective SO_RCVBUF / SO_SNDBUF of the own-port socket, as the kernel reports them.
    pub recv_buffer_bytes: usize,
    pub send_buffer_bytes: usize,
}

/// A running core thread.
pub struct CoreRuntime {
    report: CoreReport,
    thread: std::thread::JoinHandle<Result<(), BrokerError>>,
}

impl std::fmt::Debug for CoreRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreRuntime")
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

impl CoreRuntime {
    /// Starts the core thread and returns once it is pinned and its endpoints are started.
    pub(crate) fn spawn(
        settings: CoreSettings,
        pair: CertificatePair,
        metrics: Metrics,
        mesh: Arc<Mesh>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<CoreRuntime, BrokerError> {
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name(format!("felix-core-{}", settings.core_index))
            .spawn(move || run_thread(settings, pair, metrics, mesh, shutdown, ready_tx))
            .map_err(|source| BrokerError::Thread {
                name: "felix-core",
                source,
            })?;
        match ready_rx.recv() {
            Ok(Ok(report)) => Ok(CoreRuntime { report, thread }),
            Ok(Err(error)) => {
                let _ = thread.join();
                Err(error)
            }
            // The thread ended without reporting: it returned an error or panicked.
            Err(_) => match thread.join() {
                Ok(Err(error)) => Err(error),
                Ok(Ok(())) => Err(BrokerError::Core(
                    "core thread ended during start-up".into(),
                )),
                Err(_) => Err(BrokerError::Core(
                    "core thread panicked during start-up".into(),
                )),
            },
        }
    }

    #[must_use]
    pub fn report(&self) -> &CoreReport {
        &self.report
    }

    /// Waits for the core thread to end.
    pub fn join(self) -> Result<(), BrokerError> {
        match self.thread.join() {
            Ok(result) => result,
            Err(_) => Err(BrokerError::Core("core thread panicked".into())),
        }
    }
}

fn run_thread(
    settings: CoreSettings,
    pair: CertificatePair,
    metrics: Metrics,
    mesh: Arc<Mesh>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    ready: std::sync::mpsc::SyncSender<Result<CoreReport, BrokerError>>,
) -> Result<(), BrokerError> {
    let core_error = |what: &str, error: &dyn std::fmt::Display| {
        BrokerError::Core(format!("core {}: {what}: {error}", settings.core_index))
    };
    // Pin first, then record the tid, so the CPU time read later is this core's only.
    if let Err(error) = felix_affinity::pin_current_thread(settings.cpu) {
        let _ = ready.send(Err(core_error("cannot pin the thread", &error)));
        return Ok(());
    }
    let core_metrics = metrics.core(settings.core_index);
    core_metrics.set_tid(felix_affinity::Tid::current().0);
    let allowed_cpus = match felix_affinity::current_thread_allowed_cpus() {
        Ok(cpus) => cpus,
        Err(error) => {
            let _ = ready.send(Err(core_error("cannot read the affinity", &error)));
            return Ok(());
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            let _ = ready.send(Err(core_error("cannot build the tokio runtime", &error)));
            return Ok(());
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let CoreSettings {
            core_index,
            cpu,
            own_socket,
            shared_sockets,
            core_ports,
            limits,
            engine,
            quic,
            ingress,
            test_pause_file,
            durable,
        } = settings;
        let DurableSetup {
            data_dir,
            settings: durable_settings,
            entries,
            catalog,
        } = durable;
        // Open and recover this core's log before serving (blocks while recovery scans).
        let log =
            match DurableLog::open_system(&data_dir, usize::from(core_index), &durable_settings) {
                Ok(log) => log,
                Err(error) => {
                    let _ = ready.send(Err(error));
                    return Ok(());
                }
            };
        let wake = match log.wake_fd().try_clone_to_owned().and_then(|fd| {
            // SAFETY: `fd` is a duplicate of the log's eventfd that this AsyncFd takes by value:
            // it stays open exactly as long as the registration and nothing else can close it.
            unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
        }) {
            Ok(wake) => wake,
            Err(error) => {
                let _ = ready.send(Err(core_error("cannot watch the log's eventfd", &error)));
                return Ok(());
            }
        };
        let own_addr = own_socket.local_addr;
        let recv_buffer_bytes = own_socket.recv_buffer_bytes;
        let send_buffer_bytes = own_socket.send_buffer_bytes;
        let shared_addrs: Vec<SocketAddr> = shared_sockets
            .iter()
            .map(|socket| socket.local_addr)
            .collect();
        let mut servers = Vec::with_capacity(1 + shared_sockets.len());
        for socket in std::iter::once(own_socket).chain(shared_sockets) {
            match start_endpoint(socket, &pair, quic, core_metrics.wire_bytes_counter()) {
                Ok(server) => servers.push(server),
                Err(error) => {
                    let _ = ready.send(Err(error));
                    return Ok(());
                }
            }
        }
        let eventfd = match mesh.eventfd_of(core_index).and_then(|fd| {
            // SAFETY: `fd` is an OwnedFd this AsyncFd takes by value: it stays open exactly as
            // long as the registration and nothing else can close it under the reactor.
            unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
        }) {
            Ok(fd) => fd,
            Err(error) => {
                let _ = ready.send(Err(core_error("cannot watch the wake-up eventfd", &error)));
                return Ok(());
            }
        };
        let state = Rc::new(CoreState::new(
            core_index,
            &mesh,
            core_ports,
            limits,
            engine,
            ingress,
            metrics,
            core_metrics,
            log,
            catalog,
        ));
        if let Err(error) = state.restore_durable(&entries) {
            let _ = ready.send(Err(error));
            return Ok(());
        }
        let _ = ready.send(Ok(CoreReport {
            index: core_index,
            cpu,
            allowed_cpus,
            own_addr,
            shared_addrs,
            recv_buffer_bytes,
            send_buffer_bytes,
        }));
        tracing::info!(core = core_index, cpu, %own_addr, "core serving");
        tokio::task::spawn_local(pump(Rc::clone(&state), eventfd, test_pause_file));
        let durable_task = tokio::task::spawn_local(durable_loop(Rc::clone(&state), wake));
        serve(Rc::clone(&state), servers, shutdown).await;
        durable_task.abort();
        state.shutdown_durable();
        Ok(())
    })
}

fn start_endpoint(
    socket: BoundSocket,
    pair: &CertificatePair,
    quic: QuicSettings,
    wire_bytes: crate::metrics::WireBytes,
) -> Result<Server, BrokerError> {
    let addr = socket.local_addr;
    let bind_error = |reason: String| BrokerError::QuicBind { addr, reason };
    let tls = s2n_quic::provider::tls::default::Server::builder()
        .with_certificate(pair.cert_pem.as_str(), pair.key_pem.as_str())
        .and_then(|builder| builder.with_application_protocols([felix_wire::ALPN]))
        .and_then(|builder| builder.build())
        .map_err(|error| BrokerError::Tls(error.to_string()))?;
    let io = s2n_quic::provider::io::tokio::Builder::default()
        .with_rx_socket(socket.socket)
        .and_then(|builder| builder.with_gso(true))
        .and_then(|builder| builder.with_gro(true))
        .and_then(|builder| builder.with_max_mtu(quic.max_mtu))
        .and_then(|builder| builder.build())
        .map_err(|error| bind_error(error.to_string()))?;
    let limits = s2n_quic::provider::limits::Limits::new()
        .with_max_open_remote_bidirectional_streams(MAX_STREAMS_PER_CONNECTION)
        .and_then(|limits| limits.with_data_window(quic.conn_recv_window))
        .and_then(|limits| limits.with_bidirectional_remote_data_window(quic.stream_recv_window))
        .and_then(|limits| limits.with_bidirectional_local_data_window(quic.stream_recv_window))
        .map_err(|error| bind_error(error.to_string()))?;
    Server::builder()
        .with_tls(tls)
        .map_err(|error| BrokerError::Tls(error.to_string()))?
        .with_io(io)
        .map_err(|error| bind_error(error.to_string()))?
        .with_limits(limits)
        .map_err(|error| bind_error(error.to_string()))?
        .with_event(wire_bytes)
        .map_err(|error| bind_error(error.to_string()))?
        .start()
        .map_err(|error| bind_error(error.to_string()))
}

async fn accept_loop(state: Rc<CoreState>, mut server: Server) {
    while let Some(connection) = server.accept().await {
        if state.connections.borrow().len() >= MAX_CONNECTIONS_PER_CORE {
            tracing::warn!(
                max = MAX_CONNECTIONS_PER_CORE,
                "connection refused: too many connections"
            );
            state.metrics.error(ErrorCode::LimitExceeded);
            connection.close(u32::from(ErrorCode::LimitExceeded as u16).into());
            continue;
        }
        tokio::task::spawn_local(connection::serve_connection(Rc::clone(&state), connection));
    }
}

async fn serve(
    state: Rc<CoreState>,
    servers: Vec<Server>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let accept_tasks: Vec<_> = servers
        .into_iter()
        .map(|server| tokio::task::spawn_local(accept_loop(Rc::clone(&state), server)))
        .collect();
    loop {
        // An error means every trigger is gone: nobody can ask us to stop any more, so stop
        // now rather than run unowned.
        if shutdown.changed().await.is_err() || *shutdown.borrow() {
            break;
        }
    }
    tracing::info!(core = state.index, "shutting down: closing connections");
    let handles: Vec<s2n_quic::connection::Handle> =
        state.connections.borrow().values().cloned().collect();
    for handle in &handles {
        handle.close(u32::from(ErrorCode::ShuttingDown as u16).into());
    }
    for task in &accept_tasks {
        task.abort();
    }
    let all_closed = async {
        while !state.connections.borrow().is_empty() {
            state.connections_changed.notified().await;
        }
    };
    if tokio::time::timeout(SHUTDOWN_GRACE, all_closed)
        .await
        .is_err()
    {
        tracing::warn!("some connections did not close within the shutdown grace period");
    }
    tokio::time::sleep(CLOSE_PACKET_LINGER).await;
}

/// The core's message pump: drains its inbound queues in batches, spins briefly when idle,
/// then parks on its eventfd.
async fn pump(
    state: Rc<CoreState>,
    eventfd: AsyncFd<std::os::fd::OwnedFd>,
    pause: Option<PathBuf>,
) {
    let mesh = Rc::clone(&state.mesh_handle);
    let index = state.index;
    let mut batch = Vec::with_capacity(DRAIN_BATCH);
    let mut idle_since = Instant::now();
    loop {
        if index != 0
            && let Some(path) = &pause
        {
            while path.exists() {
                tokio::time::sleep(TEST_PAUSE_POLL).await;
            }
        }
        state.flush_overflow();
        mesh.drain(index, DRAIN_BATCH, &mut batch);
        if !batch.is_empty() {
            for message in batch.drain(..) {
                state.handle_message(message);
            }
            idle_since = Instant::now();
            tokio::task::yield_now().await;
            continue;
        }
        if idle_since.elapsed() < SPIN_BEFORE_PARK || state.has_overflow() {
            tokio::task::yield_now().await;
            continue;
        }
        if !mesh.park(index) {
            continue;
        }
        match eventfd.readable().await {
            Ok(mut guard) => {
                reset_eventfd(guard.get_inner());
                guard.clear_ready();
            }
            Err(error) => {
                tracing::error!(%error, "wake-up eventfd failed; polling instead");
                tokio::time::sleep(SPIN_BEFORE_PARK).await;
            }
        }
        mesh.unpark(index);
        idle_since = Instant::now();
    }
}

/// The core's durable loop: pumps the log when its eventfd says a round finished, at its
/// periodic-fsync deadline, and when asked (`durable_changed`: a catch-up read waits, or the
/// deadline moved); applies retention every [`RETENTION_CHECK_INTERVAL`] when configured.
async fn durable_loop(state: Rc<CoreState>, wake: AsyncFd<std::os::fd::OwnedFd>) {
    let retention = state.durable.borrow().retention_configured();
    let mut next_retention = Instant::now() + RETENTION_CHECK_INTERVAL;
    loop {
        let deadline = state.durable.borrow().next_deadline();
        let wake_at = match (deadline, retention) {
            (Some(deadline), true) => Some(deadline.min(next_retention)),
            (Some(deadline), false) => Some(deadline),
            (None, true) => Some(next_retention),
            (None, false) => None,
        };
        let timer = async {
            match wake_at {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ready = wake.readable() => match ready {
                // Clear before pumping: `drive` drains the eventfd, then reaps.
                Ok(mut guard) => guard.clear_ready(),
                Err(error) => {
                    tracing::error!(%error, "log eventfd failed; polling instead");
                    tokio::time::sleep(SPIN_BEFORE_PARK).await;
                }
            },
            () = timer => {}
            () = state.durable_changed.notified() => {}
        }
        if retention && Instant::now() >= next_retention {
            state.apply_retention();
            next_retention = Instant::now() + RETENTION_CHECK_INTERVAL;
        }
        state.pump_durable();
    }
}

/// Microseconds since the Unix epoch (0 if the clock is before 1970).
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A subscription served by a stream task of this core, fed by this core's engine (shards it
/// owns) and by owner cores (`remote` batches).
struct SubscriptionSlot {
    notify: Rc<Notify>,
    /// Set when an owner ended the subscription (lagged, stream deleted).
    ended: Option<EngineError>,
    local: Option<SubscriptionId>,
    remotes: Vec<(u16, SubscriptionId)>,
    /// Batches from owner cores; bounded by REMOTE_DELIVERY_CREDITS per owner.
    remote_batches: VecDeque<(u16, SubscriptionId, Vec<DeliveredRecord>)>,
}

/// An owner-side subscription whose records go to another core.
struct RemoteSubscription {
    to: u16,
    slot: u64,
    credits: u32,
}

/// A subscription registered for a stream task.
pub(crate) struct Registered {
    pub slot: u64,
    /// `(shard, first offset delivered)` per subscribed shard.
    pub start: Vec<(u32, u64)>,
    /// Woken when records are queued or an owner ended the subscription.
    pub notify: Rc<Notify>,
}

/// A delivery batch and, if it came from another core, whom to give the credit back.
pub(crate) struct Batch {
    pub records: Vec<DeliveredRecord>,
    pub credit: Option<(u16, SubscriptionId)>,
}

/// Whether a request stream goes on after a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    Continue,
    /// The stream is unusable (an `Error` with request id 0 was written): finish it.
    Finish,
}

/// Per-core state shared by this core's tasks. Never leaves the core thread. No `RefCell`
/// borrow is ever held across an `.await`.
pub(crate) struct CoreState {
    pub index: u16,
    core_count: u16,
    engine: RefCell<Engine>,
    slots: RefCell<HashMap<u64, SubscriptionSlot>>,
    /// This core's engine subscriptions serving a local slot.
    local_subscriptions: RefCell<HashMap<SubscriptionId, u64>>,
    /// This core's engine subscriptions serving a slot on another core.
    remote_subscriptions: RefCell<HashMap<SubscriptionId, RemoteSubscription>>,
    /// Requests sent to other cores, by token, waiting for their answer.
    pending: RefCell<HashMap<u64, oneshot::Sender<CoreMessage>>>,
    next_token: Cell<u64>,
    mesh_handle: Rc<MeshHandle>,
    /// Messages that found their queue full, per destination, sent first by the pump (FIFO
    /// per pair is kept: once something waits here, later sends queue behind it). Only
    /// answers, credits and deliveries land here; each is bounded by the requests or credits
    /// that caused it. Publishes wait for room instead ([`CoreState::send`]).
    overflow: RefCell<Vec<VecDeque<CoreMessage>>>,
    admission: RefCell<Admission>,
    /// Parked publishes by ticket, with the payload bytes they asked for.
    admission_waiters: RefCell<HashMap<Ticket, (oneshot::Sender<bool>, u64)>>,
    ingress: IngressSettings,
    /// Open connections by id, so shutdown can close them.
    pub connections: RefCell<HashMap<u64, s2n_quic::connection::Handle>>,
    /// Notified whenever a connection leaves `connections`.
    pub connections_changed: Notify,
    pub metrics: Metrics,
    pub core_metrics: CoreMetrics,
    pub limits: Limits,
    pub decoder: Decoder,
    core_ports: Vec<u16>,
    /// This core's durable log. Borrowed only inside `pump_durable` & co, never across an
    /// `.await`, and always after (inside) the engine borrow order: log, then engine.
    durable: RefCell<DurableLog>,
    /// The durable catalogue: core 0 only.
    catalog: Option<RefCell<Catalog>>,
    /// Tracked durable publishes by token: their acks and whom to answer. Bounded by the
    /// ingress queues (each waiting publish holds an ingress job on its origin core).
    durable_waiters: RefCell<HashMap<u64, DurableWaiter>>,
    /// Wakes the durable loop (a catch-up read waits, or the fsync deadline moved).
    durable_changed: Notify,
    /// The engine's log-read count when the durable loop was last asked to pump.
    log_reads_seen: Cell<u64>,
    /// Log counters already exported to the metrics.
    durable_exported: RefCell<DurableExported>,
}

/// A durable publish waiting for its records to be committed.
struct DurableWaiter {
    acks: Vec<ShardAck>,
    reply: Reply,
}

/// Whom a durable publish's outcome goes to.
pub(crate) enum Reply {
    /// A task on this core.
    Local(oneshot::Sender<Result<Vec<ShardAck>, EngineError>>),
    /// The core that forwarded the records, as `PublishDone { token }`.
    Remote { from: u16, token: u64 },
}

/// The mesh as one core sees it.
pub(crate) struct MeshHandle {
    mesh: Arc<Mesh>,
}

impl std::ops::Deref for MeshHandle {
    type Target = Mesh;
    fn deref(&self) -> &Mesh {
        &self.mesh
    }
}

/// What a publish turned into once admitted.
pub(crate) enum PublishOutcome {
    /// Answer now (or nothing, for fire-and-forget).
    Done(Option<Frame>),
    /// Parts went to other cores; the answer comes later through the stream's completions.
    Pending,
}

impl CoreState {
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: u16,
        mesh: &Arc<Mesh>,
        core_ports: Vec<u16>,
        limits: Limits,
        engine: EngineConfig,
        ingress: IngressSettings,
        metrics: Metrics,
        core_metrics: CoreMetrics,
        log: DurableLog,
        catalog: Option<Catalog>,
    ) -> CoreState {
        let core_count = mesh.cores();
        let mut engine = Engine::new(engine);
        engine.enable_durable();
        let recovery = log.recovery();
        core_metrics
            .durable
            .set_recovery(recovery.seconds, recovery.truncated_bytes);
        CoreState {
            index,
            core_count,
            engine: RefCell::new(engine),
            slots: RefCell::new(HashMap::new()),
            local_subscriptions: RefCell::new(HashMap::new()),
            remote_subscriptions: RefCell::new(HashMap::new()),
            pending: RefCell::new(HashMap::new()),
            next_token: Cell::new(1),
            mesh_handle: Rc::new(MeshHandle {
                mesh: Arc::clone(mesh),
            }),
            overflow: RefCell::new((0..core_count).map(|_| VecDeque::new()).collect()),
            admission: RefCell::new(Admission::new(ingress.depth, ingress.budget_bytes)),
            admission_waiters: RefCell::new(HashMap::new()),
            ingress,
            connections: RefCell::new(HashMap::new()),
            connections_changed: Notify::new(),
            metrics,
            core_metrics,
            limits,
            decoder: Decoder::new(limits),
            core_ports,
            durable: RefCell::new(log),
            catalog: catalog.map(RefCell::new),
            durable_waiters: RefCell::new(HashMap::new()),
            durable_changed: Notify::new(),
            log_reads_seen: Cell::new(0),
            durable_exported: RefCell::new(DurableExported::default()),
        }
    }

    // ---- durable streams ----

    /// Start-up: recreates every catalogued stream from this core's log offsets.
    fn restore_durable(&self, entries: &[CatalogEntry]) -> Result<(), BrokerError> {
        let log = self.durable.borrow();
        let mut engine = self.engine.borrow_mut();
        for entry in entries {
            log.restore(&mut engine, entry)
                .map_err(|error| BrokerError::Catalog {
                    path: PathBuf::from(crate::catalog::CATALOG_FILE),
                    reason: format!("cannot restore stream {:?}: {error}", entry.name),
                })?;
        }
        Ok(())
    }

    /// Whether `stream` is durable (on this core's engine, which holds every stream).
    fn is_durable(&self, stream: &str) -> bool {
        self.engine.borrow().log_shard(stream, 0).is_some()
    }

    /// Moves appends into the log, drives it, and answers what completed. A fatal storage
    /// error exits the process here, before any later ack can be sent.
    fn pump_durable(&self) {
        let mut completions: Vec<PublishCompletion> = Vec::new();
        let outcome = {
            let mut log = self.durable.borrow_mut();
            let mut engine = self.engine.borrow_mut();
            let before = log.next_deadline();
            let result = log.pump(&mut engine, Instant::now(), &mut completions);
            self.log_reads_seen.set(engine.durable_counters().log_reads);
            let pending = engine.durable_counters().records_pending;
            self.core_metrics.durable.observe(
                log.counters(),
                pending,
                &mut self.durable_exported.borrow_mut(),
            );
            result.map(|report| (report.more, before != log.next_deadline()))
        };
        match outcome {
            Err(error) => fatal_exit(usize::from(self.index), &error),
            Ok((more, deadline_moved)) => {
                if more || deadline_moved {
                    self.durable_changed.notify_one();
                }
            }
        }
        for completion in completions {
            self.complete_durable(completion);
        }
        self.dispatch_events();
    }

    /// Asks the durable loop to pump if the engine issued log reads since the last pump
    /// (after subscribe and delivery polls, which may start or resume a catch-up).
    fn wake_for_log_reads(&self) {
        let issued = self.engine.borrow().durable_counters().log_reads;
        if issued != self.log_reads_seen.get() {
            self.log_reads_seen.set(issued);
            self.durable_changed.notify_one();
        }
    }

    /// Answers one finished durable publish.
    fn complete_durable(&self, completion: PublishCompletion) {
        let Some(waiter) = self
            .durable_waiters
            .borrow_mut()
            .remove(&completion.token.0)
        else {
            tracing::error!(
                token = completion.token.0,
                "completion of an unknown publish"
            );
            return;
        };
        let result = completion.result.map(|()| waiter.acks);
        match waiter.reply {
            Reply::Local(sender) => {
                // The publishing task may be gone (shutdown): nothing to answer then.
                let _ = sender.send(result);
            }
            Reply::Remote { from, token } => {
                self.send_now(from, CoreMessage::PublishDone { token, result });
            }
        }
    }

    /// Appends records this core owns. In-memory: the result now. Durable: the publish is
    /// tracked and `reply` gets its outcome once committed (`None` is returned).
    fn publish_here(
        &self,
        now_us: u64,
        stream: &str,
        records: Vec<Record>,
        reply: Reply,
    ) -> Option<Result<Vec<ShardAck>, EngineError>> {
        if !self.is_durable(stream) {
            let result = self.engine.borrow_mut().publish(now_us, stream, records);
            self.dispatch_events();
            return Some(result);
        }
        let token = self.token();
        let result =
            self.engine
                .borrow_mut()
                .publish_tracked(now_us, stream, records, PublishToken(token));
        match result {
            Err(error) => Some(Err(error)),
            Ok(acks) => {
                self.durable_waiters
                    .borrow_mut()
                    .insert(token, DurableWaiter { acks, reply });
                self.pump_durable();
                None
            }
        }
    }

    /// Deletes retained segments past the bounds (core's durable loop).
    fn apply_retention(&self) {
        let result = {
            let mut log = self.durable.borrow_mut();
            let mut engine = self.engine.borrow_mut();
            log.apply_retention(&mut engine, now_us())
        };
        if let Err(error) = result {
            if error.is_fatal() {
                fatal_exit(usize::from(self.index), &error);
            }
            tracing::warn!(core = self.index, %error, "retention failed; retrying later");
        }
    }

    /// Clean shutdown: write and fdatasync what the log holds.
    fn shutdown_durable(&self) {
        let result = {
            let mut log = self.durable.borrow_mut();
            let mut engine = self.engine.borrow_mut();
            log.shutdown(&mut engine, DURABLE_SHUTDOWN_FLUSH)
        };
        match result {
            Ok(()) => tracing::info!(core = self.index, "durable log flushed"),
            Err(error) if error.is_fatal() => fatal_exit(usize::from(self.index), &error),
            Err(error) => tracing::error!(core = self.index, %error, "durable log flush failed"),
        }
    }

    fn token(&self) -> u64 {
        let token = self.next_token.get();
        self.next_token.set(token + 1);
        token
    }

    fn owner(&self, shard: u32) -> u16 {
        felix_affinity::shard_core(shard, self.core_count)
    }

    // ---- sending ----

    /// Sends without waiting: straight into the queue, or behind earlier overflow.
    fn send_now(&self, to: u16, message: CoreMessage) {
        let mut overflow = self.overflow.borrow_mut();
        let waiting = &mut overflow[usize::from(to)];
        if !waiting.is_empty() {
            waiting.push_back(message);
            return;
        }
        if let Err(message) = self.mesh_handle.try_send(self.index, to, message) {
            waiting.push_back(message);
        }
    }

    /// Sends, waiting (yielding) while the destination queue is full: backpressure.
    async fn send(&self, to: u16, message: CoreMessage) {
        let mut message = message;
        loop {
            let blocked = !self.overflow.borrow()[usize::from(to)].is_empty();
            if !blocked {
                match self.mesh_handle.try_send(self.index, to, message) {
                    Ok(()) => return,
                    Err(back) => message = back,
                }
            }
            tokio::task::yield_now().await;
            self.flush_overflow();
        }
    }

    fn has_overflow(&self) -> bool {
        self.overflow.borrow().iter().any(|queue| !queue.is_empty())
    }

    fn flush_overflow(&self) {
        let mut overflow = self.overflow.borrow_mut();
        for (to, waiting) in overflow.iter_mut().enumerate() {
            // Core indices fit u16: the overflow has one entry per core.
            let to = u16::try_from(to).unwrap_or(u16::MAX);
            while let Some(message) = waiting.pop_front() {
                if let Err(message) = self.mesh_handle.try_send(self.index, to, message) {
                    waiting.push_front(message);
                    break;
                }
            }
        }
    }

    /// Sends a request and returns the receiver of its answer.
    async fn request(
        &self,
        to: u16,
        build: impl FnOnce(u64) -> CoreMessage,
    ) -> oneshot::Receiver<CoreMessage> {
        let token = self.token();
        let (sender, receiver) = oneshot::channel();
        self.pending.borrow_mut().insert(token, sender);
        self.send(to, build(token)).await;
        receiver
    }

    /// Hands an answer to the task that asked; it may be gone (connection closed).
    fn answer(&self, token: u64, message: CoreMessage) {
        let waiter = self.pending.borrow_mut().remove(&token);
        match waiter {
            Some(waiter) => {
                let _ = waiter.send(message);
            }
            None => tracing::debug!(token, "answer for a forgotten request"),
        }
    }

    // ---- handshake ----

    /// The handshake answer: version, limits, every core's own port, and every stream's route.
    pub fn hello_ok(&self) -> HelloOk {
        let streams = self.engine.borrow().list_streams();
        let budget = usize::try_from(self.limits.max_frame_bytes).unwrap_or(usize::MAX)
            / HELLO_SHARD_MAP_FRAME_SHARE;
        let mut used = 0usize;
        let mut shard_map = Vec::with_capacity(streams.len());
        for (name, kind, shard_count) in streams {
            // Generous upper bound of one route's encoding: name, fixed fields, u16 per shard.
            let cost = name.len() + 32 + 2 * usize::try_from(shard_count).unwrap_or(usize::MAX);
            used = used.saturating_add(cost);
            if used > budget {
                tracing::warn!(
                    "shard map too large for HelloOk; clients must describe the remaining streams"
                );
                break;
            }
            shard_map.push(StreamRoute {
                name,
                kind,
                shard_count,
                hash: HashKind::Fnv1a64Mod,
                shard_cores: (0..shard_count).map(|shard| self.owner(shard)).collect(),
            });
        }
        HelloOk {
            version: PROTOCOL_VERSION,
            features: 0,
            limits: self.limits,
            core_ports: self.core_ports.clone(),
            shard_map,
        }
    }

    /// Encodes an error answer and counts it.
    pub fn write_error(&self, frame: ErrorFrame, out: &mut BytesMut) {
        self.metrics.error(frame.code);
        felix_wire::encode(&Frame::Error(frame), out);
    }

    // ---- requests ----

    /// Handles one non-publish frame of a request stream, appending its answer to `out`.
    pub async fn handle_request(self: &Rc<Self>, frame: Frame, out: &mut BytesMut) -> Next {
        match frame {
            Frame::CreateStream(create) => {
                let request = AdminRequest::Create {
                    name: create.name,
                    shard_count: create.shard_count,
                    kind: create.kind,
                    stream_id: None,
                };
                match self.admin(request).await {
                    Ok(description) => self.write_stream_info(create.request_id, description, out),
                    Err(error) => self.write_error(error.to_frame(create.request_id), out),
                }
                Next::Continue
            }
            Frame::DescribeStream { request_id, name } => {
                match self.describe(&name).await {
                    Ok(description) => self.write_stream_info(request_id, description, out),
                    Err(error) => self.write_error(error.to_frame(request_id), out),
                }
                Next::Continue
            }
            Frame::ListStreams { request_id } => {
                let streams = self
                    .engine
                    .borrow()
                    .list_streams()
                    .into_iter()
                    .map(|(name, kind, shard_count)| StreamSummary {
                        name,
                        kind,
                        shard_count,
                    })
                    .collect();
                felix_wire::encode(
                    &Frame::StreamList {
                        request_id,
                        streams,
                    },
                    out,
                );
                Next::Continue
            }
            Frame::DeleteStream { request_id, name } => {
                match self.admin(AdminRequest::Delete { name }).await {
                    Ok(_) => felix_wire::encode(&Frame::Done { request_id }, out),
                    Err(error) => self.write_error(error.to_frame(request_id), out),
                }
                Next::Continue
            }
            Frame::Subscribe(subscribe) => {
                self.write_error(
                    ErrorFrame {
                        request_id: subscribe.request_id,
                        code: ErrorCode::ProtocolViolation,
                        detail: 0,
                        message: "Subscribe must be the first and only frame of its own stream"
                            .to_owned(),
                    },
                    out,
                );
                Next::Continue
            }
            other => {
                self.write_error(
                    ErrorFrame {
                        request_id: 0,
                        code: ErrorCode::ProtocolViolation,
                        detail: 0,
                        message: format!(
                            "{} is not a request a client may send on a request stream",
                            frame_name(&other)
                        ),
                    },
                    out,
                );
                Next::Finish
            }
        }
    }

    fn write_stream_info(
        &self,
        request_id: u64,
        description: StreamDescription,
        out: &mut BytesMut,
    ) {
        let shards = description
            .shards
            .iter()
            .map(|shard| ShardInfo {
                shard: shard.shard,
                core: self.owner(shard.shard),
                oldest_offset: shard.oldest_offset,
                next_offset: shard.next_offset,
            })
            .collect();
        let info = StreamInfo {
            request_id,
            name: description.name,
            kind: description.kind,
            hash: description.hash,
            shards,
        };
        felix_wire::encode(&Frame::StreamInfo(info), out);
    }

    // ---- catalogue (serialized through core 0) ----

    async fn admin(
        self: &Rc<Self>,
        request: AdminRequest,
    ) -> Result<StreamDescription, EngineError> {
        if self.index == 0 {
            return self.admin_on_core_zero(request).await;
        }
        let from = self.index;
        let answer = self
            .request(0, |token| CoreMessage::Admin {
                from,
                token,
                request,
            })
            .await;
        match answer.await {
            Ok(CoreMessage::AdminDone { result, .. }) => result,
            _ => Err(shutting_down()),
        }
    }

    /// Core 0: validate and apply locally, then on every other core; answer once all applied.
    async fn admin_on_core_zero(
        self: &Rc<Self>,
        request: AdminRequest,
    ) -> Result<StreamDescription, EngineError> {
        assert_eq!(
            self.index, 0,
            "catalogue changes are serialized through core 0"
        );
        let request = self.assign_stream_id(request);
        if let AdminRequest::Delete { name } = &request {
            // Persist the removal first: once answered, the stream stays deleted after a crash.
            self.catalog_change(|catalog| catalog.remove(name).map(|_| ()))?;
        }
        let description = self.apply(&request)?;
        if let AdminRequest::Create {
            name,
            shard_count,
            stream_id: Some(stream_id),
            ..
        } = &request
        {
            // Persist before anyone is told (the other cores, the client): a create that was
            // acknowledged exists after any crash.
            let persisted = self.catalog_change(|catalog| {
                let entry = catalog.add(name, *shard_count)?;
                assert_eq!(
                    entry.stream_id, *stream_id,
                    "ids are assigned without an await"
                );
                Ok(())
            });
            if let Err(error) = persisted {
                let _ = self.engine.borrow_mut().delete_stream(name);
                self.dispatch_events();
                return Err(error);
            }
        }
        let mut answers = Vec::with_capacity(usize::from(self.core_count));
        for core in 1..self.core_count {
            let request = request.clone();
            answers.push(
                self.request(core, |token| CoreMessage::Apply { token, request })
                    .await,
            );
        }
        for answer in answers {
            if !matches!(answer.await, Ok(CoreMessage::Applied { .. })) {
                return Err(shutting_down());
            }
        }
        Ok(description)
    }

    /// Core 0: gives a durable create the catalogue's next stream id (persisted by `add`).
    fn assign_stream_id(&self, request: AdminRequest) -> AdminRequest {
        match request {
            AdminRequest::Create {
                name,
                shard_count,
                kind: StreamKind::Durable,
                stream_id: None,
            } => {
                let stream_id = self
                    .catalog
                    .as_ref()
                    .map(|catalog| catalog.borrow().next_stream_id());
                AdminRequest::Create {
                    name,
                    shard_count,
                    kind: StreamKind::Durable,
                    stream_id,
                }
            }
            other => other,
        }
    }

    /// Core 0: applies a change to the durable catalogue (written and fsynced on this thread:
    /// admin requests are rare, and the answer must wait for the disk anyway).
    fn catalog_change(
        &self,
        change: impl FnOnce(&mut Catalog) -> Result<(), BrokerError>,
    ) -> Result<(), EngineError> {
        let Some(catalog) = &self.catalog else {
            return Err(engine_error(
                ErrorCode::StorageFailed,
                "the durable catalogue lives on core 0".to_owned(),
            ));
        };
        change(&mut catalog.borrow_mut()).map_err(|error| {
            tracing::error!(%error, "durable catalogue change failed");
            engine_error(
                ErrorCode::StorageFailed,
                format!("cannot persist the durable catalogue: {error}"),
            )
        })
    }

    /// Applies a catalogue change to this core's engine.
    fn apply(&self, request: &AdminRequest) -> Result<StreamDescription, EngineError> {
        let result = match request {
            AdminRequest::Create {
                name,
                shard_count,
                kind: StreamKind::Durable,
                stream_id,
            } => match stream_id {
                Some(stream_id) => {
                    self.engine
                        .borrow_mut()
                        .create_durable_stream(name, *shard_count, *stream_id)
                }
                None => Err(engine_error(
                    ErrorCode::StorageFailed,
                    "a durable stream needs a catalogue id from core 0".to_owned(),
                )),
            },
            AdminRequest::Create {
                name,
                shard_count,
                kind,
                ..
            } => self
                .engine
                .borrow_mut()
                .create_stream(name, *shard_count, *kind),
            AdminRequest::Delete { name } => {
                let described = self.engine.borrow().describe_stream(name);
                described.and_then(|description| {
                    self.engine.borrow_mut().delete_stream(name)?;
                    Ok(description)
                })
            }
        };
        self.dispatch_events();
        result
    }

    /// The stream with each shard's state taken from its owner core.
    async fn describe(self: &Rc<Self>, name: &str) -> Result<StreamDescription, EngineError> {
        let mut description = self.engine.borrow().describe_stream(name)?;
        let mut answers = Vec::new();
        for core in 0..self.core_count {
            if core == self.index || u32::from(core) >= description.shards.len() as u32 {
                continue;
            }
            let from = self.index;
            let stream = name.to_owned();
            answers.push(
                self.request(core, |token| CoreMessage::Describe {
                    from,
                    token,
                    stream,
                })
                .await,
            );
        }
        for answer in answers {
            match answer.await {
                Ok(CoreMessage::DescribeDone { result, .. }) => {
                    for state in result? {
                        if let Some(slot) = description.shards.get_mut(state.shard as usize) {
                            *slot = state;
                        }
                    }
                }
                _ => return Err(shutting_down()),
            }
        }
        Ok(description)
    }

    // ---- publishing ----

    /// Admits a publish through this core's ingress queue, waiting if its policy says so.
    /// `Err(())` means it was shed or refused (already answered into `out` / counted).
    pub async fn admit(
        &self,
        publish: &Publish,
        payload_bytes: u64,
        out: &mut BytesMut,
    ) -> Result<(), ()> {
        let now = Instant::now();
        let policy = match publish.ack {
            AckMode::FireAndForget if self.ingress.fire_and_forget_waits => {
                Policy::Wait { deadline: None }
            }
            AckMode::FireAndForget => Policy::Shed,
            // Durable streams ack after commit by default (SPEC section 3).
            AckMode::Acked if self.ingress.ack_on_commit || self.is_durable(&publish.stream) => {
                Policy::Wait {
                    deadline: Some(now + self.ingress.commit_wait),
                }
            }
            AckMode::Acked => Policy::Refuse,
        };
        let decision = self
            .admission
            .borrow_mut()
            .handle_request(now, payload_bytes, policy);
        self.dispatch_admission();
        let admitted = match decision {
            Decision::Admitted => true,
            Decision::Shed => false,
            Decision::Refused => false,
            Decision::Waiting(ticket) => {
                self.core_metrics.waits.inc();
                let (sender, mut receiver) = oneshot::channel();
                self.admission_waiters
                    .borrow_mut()
                    .insert(ticket, (sender, payload_bytes));
                let waited = match policy {
                    Policy::Wait {
                        deadline: Some(deadline),
                    } => tokio::time::timeout_at(deadline.into(), &mut receiver)
                        .await
                        .ok(),
                    _ => Some((&mut receiver).await),
                };
                match waited {
                    Some(Ok(admitted)) => admitted,
                    Some(Err(_)) => false,
                    None => {
                        // Deadline: expire it in the queue; it may have been admitted just now.
                        self.admission.borrow_mut().handle_timeout(Instant::now());
                        self.dispatch_admission();
                        receiver.try_recv().unwrap_or(false)
                    }
                }
            }
        };
        if admitted {
            self.core_metrics.ingress_depth.inc();
            self.metrics.ingress_depth.inc();
            return Ok(());
        }
        match publish.ack {
            AckMode::FireAndForget => {
                self.core_metrics.shed.inc();
                self.metrics.publishes_shed.inc();
            }
            AckMode::Acked => {
                self.core_metrics.refused.inc();
                self.metrics.publishes_refused.inc();
                self.write_error(
                    ErrorFrame {
                        request_id: publish.request_id,
                        code: ErrorCode::IngressBudgetExhausted,
                        detail: 0,
                        message: INGRESS_EXHAUSTED_MESSAGE.to_owned(),
                    },
                    out,
                );
            }
        }
        Err(())
    }

    /// Wakes the waiters the admission queue admitted or expired.
    fn dispatch_admission(&self) {
        loop {
            let event = self.admission.borrow_mut().poll_event();
            let Some(event) = event else { break };
            let (ticket, admitted) = match event {
                AdmissionEvent::Admitted(ticket) => (ticket, true),
                AdmissionEvent::Expired(ticket) => (ticket, false),
            };
            let waiter = self.admission_waiters.borrow_mut().remove(&ticket);
            if let Some((waiter, bytes)) = waiter
                && waiter.send(admitted).is_err()
                && admitted
            {
                // The publisher went away after being admitted: give the room back.
                tracing::debug!("admitted waiter went away");
                self.admission
                    .borrow_mut()
                    .handle_complete(Instant::now(), bytes);
            }
        }
    }

    /// An admitted publish finished (applied, or answered by its owners).
    fn complete_job(&self, payload_bytes: u64) {
        self.admission
            .borrow_mut()
            .handle_complete(Instant::now(), payload_bytes);
        self.core_metrics.ingress_depth.dec();
        self.metrics.ingress_depth.dec();
        self.dispatch_admission();
    }

    /// Runs an admitted publish: the locally owned records go to this engine, the rest to their
    /// owners; the merged answer is returned or sent to `completions` later.
    pub async fn publish(
        self: &Rc<Self>,
        publish: Publish,
        payload_bytes: u64,
        completions: &mpsc::UnboundedSender<Frame>,
    ) -> PublishOutcome {
        let Publish {
            request_id,
            ack,
            stream,
            records,
        } = publish;
        let record_count = records.len() as u64;
        self.core_metrics.publishes.inc();
        let now = now_us();
        let shard_count = self.engine.borrow().shard_count(&stream);
        let split = match shard_count {
            Some(count) if self.core_count > 1 => self.split(records, count),
            // One core, or an unknown stream (the engine answers StreamNotFound).
            _ => Split::Local(records),
        };
        match split {
            Split::Local(records) => {
                let (sender, receiver) = oneshot::channel();
                if let Some(result) = self.publish_here(now, &stream, records, Reply::Local(sender))
                {
                    self.complete_job(payload_bytes);
                    return PublishOutcome::Done(self.finish_publish(
                        request_id,
                        ack,
                        result,
                        payload_bytes,
                        record_count,
                    ));
                }
                // Durable: the ingress job and the answer wait for the commit.
                let state = Rc::clone(self);
                let completions = completions.clone();
                tokio::task::spawn_local(async move {
                    let result = receiver.await.unwrap_or_else(|_| Err(shutting_down()));
                    state.complete_job(payload_bytes);
                    if let Some(frame) =
                        state.finish_publish(request_id, ack, result, payload_bytes, record_count)
                    {
                        let _ = completions.send(frame);
                    }
                });
                PublishOutcome::Pending
            }
            Split::Spread(parts) => {
                let mut local_result = Ok(Vec::new());
                let mut local_waiting = None;
                let mut answers = Vec::new();
                for (core, records) in parts.into_iter().enumerate() {
                    if records.is_empty() {
                        continue;
                    }
                    // Core indices come from the mesh's u16 core count.
                    let core = u16::try_from(core).unwrap_or(u16::MAX);
                    if core == self.index {
                        let (sender, receiver) = oneshot::channel();
                        match self.publish_here(now, &stream, records, Reply::Local(sender)) {
                            Some(result) => local_result = result,
                            None => local_waiting = Some(receiver),
                        }
                        continue;
                    }
                    self.core_metrics.cross_core_hops.inc();
                    let from = self.index;
                    let stream = stream.clone();
                    answers.push(
                        self.request(core, |token| CoreMessage::Publish {
                            from,
                            token,
                            stream,
                            records,
                            now_us: now,
                        })
                        .await,
                    );
                }
                let state = Rc::clone(self);
                let completions = completions.clone();
                tokio::task::spawn_local(async move {
                    let mut result = match local_waiting {
                        Some(receiver) => receiver.await.unwrap_or_else(|_| Err(shutting_down())),
                        None => local_result,
                    };
                    for answer in answers {
                        let part = match answer.await {
                            Ok(CoreMessage::PublishDone { result, .. }) => result,
                            _ => Err(shutting_down()),
                        };
                        result = match (result, part) {
                            (Ok(mut acks), Ok(more)) => {
                                acks.extend(more);
                                Ok(acks)
                            }
                            (Err(error), _) | (Ok(_), Err(error)) => Err(error),
                        };
                    }
                    let result = result.map(|mut acks| {
                        acks.sort_unstable_by_key(|ack| ack.shard);
                        acks
                    });
                    state.complete_job(payload_bytes);
                    if let Some(frame) =
                        state.finish_publish(request_id, ack, result, payload_bytes, record_count)
                    {
                        // The stream task may be gone (client reset): nothing to answer then.
                        let _ = completions.send(frame);
                    }
                });
                PublishOutcome::Pending
            }
        }
    }

    fn split(&self, records: Vec<Record>, shard_count: u32) -> Split {
        let index = usize::from(self.index);
        let mut parts: Vec<Vec<Record>> = Vec::new();
        for (position, record) in records.iter().enumerate() {
            let core = usize::from(self.owner(felix_wire::shard_for_key(&record.key, shard_count)));
            if core != index && parts.is_empty() {
                // First foreign record: from here on, split.
                parts = (0..self.core_count).map(|_| Vec::new()).collect();
                parts[index].extend(records[..position].iter().cloned());
            }
            if !parts.is_empty() {
                parts[core].push(record.clone());
            }
        }
        if parts.is_empty() {
            Split::Local(records)
        } else {
            Split::Spread(parts)
        }
    }

    /// Counts a finished publish and builds its answer.
    fn finish_publish(
        &self,
        request_id: u64,
        ack: AckMode,
        result: Result<Vec<ShardAck>, EngineError>,
        payload_bytes: u64,
        record_count: u64,
    ) -> Option<Frame> {
        match result {
            Ok(shards) => {
                self.metrics.payload_bytes.inc_by(payload_bytes);
                self.metrics.records.inc_by(record_count);
                self.core_metrics.payload_bytes.inc_by(payload_bytes);
                self.core_metrics.records.inc_by(record_count);
                match ack {
                    AckMode::Acked => {
                        self.metrics.publishes_acked.inc();
                        self.metrics.acks.inc();
                        Some(Frame::Ack(felix_wire::Ack { request_id, shards }))
                    }
                    AckMode::FireAndForget => {
                        self.metrics.publishes_fire_and_forget.inc();
                        None
                    }
                }
            }
            Err(error) => {
                self.metrics.error(error.code);
                match ack {
                    AckMode::Acked => Some(Frame::Error(error.to_frame(request_id))),
                    AckMode::FireAndForget => {
                        tracing::debug!(%error, "fire-and-forget publish refused");
                        None
                    }
                }
            }
        }
    }

    // ---- subscriptions ----

    /// Registers a subscription: locally for the shards this core owns, on each owner core for
    /// the others. Catch-up may already be queued.
    pub async fn subscribe(
        self: &Rc<Self>,
        subscribe: &felix_wire::Subscribe,
    ) -> Result<Registered, EngineError> {
        let shard_count = self
            .engine
            .borrow()
            .shard_count(&subscribe.stream)
            .ok_or_else(|| {
                engine_error(
                    ErrorCode::StreamNotFound,
                    format!("stream {:?} does not exist", subscribe.stream),
                )
            })?;
        let selected = select_shards(&subscribe.shards, &subscribe.from, shard_count)?;
        let slot_id = self.token();
        let notify = Rc::new(Notify::new());
        self.slots.borrow_mut().insert(
            slot_id,
            SubscriptionSlot {
                notify: Rc::clone(&notify),
                ended: None,
                local: None,
                remotes: Vec::new(),
                remote_batches: VecDeque::new(),
            },
        );
        let mut start = Vec::with_capacity(selected.len());
        let mut failure = None;
        for core in 0..self.core_count {
            let shards: Vec<u32> = selected
                .iter()
                .copied()
                .filter(|&shard| self.owner(shard) == core)
                .collect();
            if shards.is_empty() {
                continue;
            }
            let position = match &subscribe.from {
                StartPosition::Offsets(positions) => StartPosition::Offsets(
                    positions
                        .iter()
                        .copied()
                        .filter(|(shard, _)| self.owner(*shard) == core)
                        .collect(),
                ),
                other => other.clone(),
            };
            let result = if core == self.index {
                let result = self.engine.borrow_mut().subscribe(
                    &subscribe.stream,
                    &ShardSelection::List(shards),
                    &position,
                );
                result.map(|subscription| {
                    self.local_subscriptions
                        .borrow_mut()
                        .insert(subscription.id, slot_id);
                    if let Some(slot) = self.slots.borrow_mut().get_mut(&slot_id) {
                        slot.local = Some(subscription.id);
                    }
                    subscription.start
                })
            } else {
                let from = self.index;
                let stream = subscribe.stream.clone();
                let answer = self
                    .request(core, |token| CoreMessage::Subscribe {
                        from,
                        token,
                        slot: slot_id,
                        stream,
                        shards,
                        start: position,
                    })
                    .await;
                match answer.await {
                    Ok(CoreMessage::SubscribeDone { result, .. }) => result.map(|(id, start)| {
                        if let Some(slot) = self.slots.borrow_mut().get_mut(&slot_id) {
                            slot.remotes.push((core, id));
                        }
                        start
                    }),
                    _ => Err(shutting_down()),
                }
            };
            match result {
                Ok(part) => start.extend(part),
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        if let Some(error) = failure {
            self.unsubscribe(slot_id);
            return Err(error);
        }
        start.sort_unstable_by_key(|(shard, _)| *shard);
        self.metrics.subscribers.inc();
        self.dispatch_events();
        self.wake_for_log_reads();
        Ok(Registered {
            slot: slot_id,
            start,
            notify,
        })
    }

    /// Forgets a subscription here and on its owner cores. Safe to call more than once.
    pub fn unsubscribe(&self, slot_id: u64) {
        let Some(slot) = self.slots.borrow_mut().remove(&slot_id) else {
            return;
        };
        if let Some(id) = slot.local {
            self.local_subscriptions.borrow_mut().remove(&id);
            match self.engine.try_borrow_mut() {
                Ok(mut engine) => engine.unsubscribe(id),
                // Only reachable if a task were dropped while the engine is borrowed, which the
                // synchronous borrow discipline rules out; the engine ends it on its own later.
                Err(_) => tracing::error!(?id, "engine busy while unsubscribing"),
            }
        }
        for (core, id) in slot.remotes {
            self.send_now(core, CoreMessage::Unsubscribe { id });
        }
    }

    /// Counts a subscription that was registered (paired with `subscribe`'s increment).
    pub fn subscription_closed(&self, slot_id: u64) {
        self.unsubscribe(slot_id);
        self.metrics.subscribers.dec();
    }

    /// The error that ended the subscription, if an owner ended it.
    pub fn take_ended(&self, slot_id: u64) -> Option<EngineError> {
        self.slots
            .borrow_mut()
            .get_mut(&slot_id)
            .and_then(|slot| slot.ended.take())
    }

    /// Next batch of records for a subscription (empty when nothing is queued).
    pub fn poll_delivery(&self, slot_id: u64) -> Batch {
        let max_records = DELIVERY_MAX_RECORDS
            .min(usize::try_from(self.limits.max_batch_records).unwrap_or(usize::MAX));
        let max_bytes = DELIVERY_MAX_BYTES
            .min(usize::try_from(self.limits.max_frame_bytes / 2).unwrap_or(usize::MAX));
        let local = self
            .slots
            .borrow()
            .get(&slot_id)
            .and_then(|slot| slot.local);
        if let Some(id) = local {
            let records = self
                .engine
                .borrow_mut()
                .poll_delivery(id, max_records, max_bytes);
            self.wake_for_log_reads();
            if !records.is_empty() {
                return Batch {
                    records,
                    credit: None,
                };
            }
        }
        let remote = self
            .slots
            .borrow_mut()
            .get_mut(&slot_id)
            .and_then(|slot| slot.remote_batches.pop_front());
        match remote {
            Some((owner, id, records)) => Batch {
                records,
                credit: Some((owner, id)),
            },
            None => Batch {
                records: Vec::new(),
                credit: None,
            },
        }
    }

    /// Gives one delivery credit back to an owner core.
    pub fn return_credit(&self, owner: u16, id: SubscriptionId) {
        self.send_now(owner, CoreMessage::Credit { id });
    }

    /// Drains the engine's events: wakes local subscription tasks, pushes remote ones' records.
    pub fn dispatch_events(&self) {
        loop {
            // The borrow ends with this statement, before any slot is touched.
            let event = self.engine.borrow_mut().poll_event();
            let Some(event) = event else { break };
            match event {
                EngineEvent::DeliveryReady(id) => {
                    let local = self.local_subscriptions.borrow().get(&id).copied();
                    if let Some(slot_id) = local {
                        if let Some(slot) = self.slots.borrow().get(&slot_id) {
                            slot.notify.notify_one();
                        }
                    } else {
                        self.pump_remote(id);
                    }
                }
                EngineEvent::SubscriptionEnded(id, error) => {
                    let local = self.local_subscriptions.borrow_mut().remove(&id);
                    if let Some(slot_id) = local {
                        self.end_slot(slot_id, Some(id), error);
                    } else if let Some(remote) = self.remote_subscriptions.borrow_mut().remove(&id)
                    {
                        self.send_now(
                            remote.to,
                            CoreMessage::Ended {
                                slot: remote.slot,
                                error,
                            },
                        );
                    }
                }
            }
        }
    }

    fn end_slot(&self, slot_id: u64, local: Option<SubscriptionId>, error: EngineError) {
        if let Some(slot) = self.slots.borrow_mut().get_mut(&slot_id) {
            if local.is_some() && slot.local == local {
                // The engine already forgot it.
                slot.local = None;
            }
            if slot.ended.is_none() {
                slot.ended = Some(error);
            }
            slot.notify.notify_one();
        }
    }

    /// Sends queued records of an owner-side subscription while it has credits.
    fn pump_remote(&self, id: SubscriptionId) {
        let max_records = DELIVERY_MAX_RECORDS
            .min(usize::try_from(self.limits.max_batch_records).unwrap_or(usize::MAX));
        let max_bytes = DELIVERY_MAX_BYTES
            .min(usize::try_from(self.limits.max_frame_bytes / 2).unwrap_or(usize::MAX));
        loop {
            let target = {
                let mut remotes = self.remote_subscriptions.borrow_mut();
                let Some(remote) = remotes.get_mut(&id) else {
                    return;
                };
                if remote.credits == 0 {
                    return;
                }
                (remote.to, remote.slot)
            };
            let records = self
                .engine
                .borrow_mut()
                .poll_delivery(id, max_records, max_bytes);
            self.wake_for_log_reads();
            if records.is_empty() {
                return;
            }
            if let Some(remote) = self.remote_subscriptions.borrow_mut().get_mut(&id) {
                remote.credits -= 1;
            }
            self.send_now(
                target.0,
                CoreMessage::Deliver {
                    slot: target.1,
                    owner: self.index,
                    id,
                    records,
                },
            );
        }
    }

    // ---- messages from other cores ----

    fn handle_message(self: &Rc<Self>, message: CoreMessage) {
        match message {
            CoreMessage::Publish {
                from,
                token,
                stream,
                records,
                now_us,
            } => {
                // Durable records are answered once committed (`complete_durable`).
                if let Some(result) =
                    self.publish_here(now_us, &stream, records, Reply::Remote { from, token })
                {
                    self.send_now(from, CoreMessage::PublishDone { token, result });
                }
            }
            CoreMessage::Admin {
                from,
                token,
                request,
            } => {
                let state = Rc::clone(self);
                tokio::task::spawn_local(async move {
                    let result = state.admin_on_core_zero(request).await;
                    state.send_now(from, CoreMessage::AdminDone { token, result });
                });
            }
            CoreMessage::Apply { token, request } => {
                if let Err(error) = self.apply(&request) {
                    // Core 0 validated it against the same catalogue: a mismatch is a defect.
                    tracing::error!(%error, ?request, "catalogue change refused on a non-zero core");
                }
                self.send_now(0, CoreMessage::Applied { token });
            }
            CoreMessage::Describe {
                from,
                token,
                stream,
            } => {
                let result = self
                    .engine
                    .borrow()
                    .describe_stream(&stream)
                    .map(|description| {
                        description
                            .shards
                            .into_iter()
                            .filter(|state: &ShardState| self.owner(state.shard) == self.index)
                            .collect()
                    });
                self.send_now(from, CoreMessage::DescribeDone { token, result });
            }
            CoreMessage::Subscribe {
                from,
                token,
                slot,
                stream,
                shards,
                start,
            } => {
                let result = self.engine.borrow_mut().subscribe(
                    &stream,
                    &ShardSelection::List(shards),
                    &start,
                );
                let answer = result.map(|subscription| {
                    self.remote_subscriptions.borrow_mut().insert(
                        subscription.id,
                        RemoteSubscription {
                            to: from,
                            slot,
                            credits: REMOTE_DELIVERY_CREDITS,
                        },
                    );
                    (subscription.id, subscription.start)
                });
                // The answer goes first, so the subscriber knows the part before records come.
                self.send_now(
                    from,
                    CoreMessage::SubscribeDone {
                        token,
                        result: answer,
                    },
                );
                self.dispatch_events();
                self.wake_for_log_reads();
            }
            CoreMessage::Deliver {
                slot,
                owner,
                id,
                records,
            } => {
                let mut slots = self.slots.borrow_mut();
                // No slot: the subscriber left; its Unsubscribe is on the way to the owner.
                if let Some(target) = slots.get_mut(&slot) {
                    target.remote_batches.push_back((owner, id, records));
                    target.notify.notify_one();
                }
            }
            CoreMessage::Ended { slot, error } => self.end_slot(slot, None, error),
            CoreMessage::Credit { id } => {
                if let Some(remote) = self.remote_subscriptions.borrow_mut().get_mut(&id) {
                    remote.credits = (remote.credits + 1).min(REMOTE_DELIVERY_CREDITS);
                }
                self.pump_remote(id);
            }
            CoreMessage::Unsubscribe { id } => {
                if self.remote_subscriptions.borrow_mut().remove(&id).is_some() {
                    self.engine.borrow_mut().unsubscribe(id);
                }
            }
            CoreMessage::PublishDone { token, .. }
            | CoreMessage::Applied { token }
            | CoreMessage::AdminDone { token, .. }
            | CoreMessage::DescribeDone { token, .. }
            | CoreMessage::SubscribeDone { token, .. } => {
                self.answer(token, message);
            }
        }
    }
}

enum Split {
    Local(Vec<Record>),
    /// Records per owner core, in batch order.
    Spread(Vec<Vec<Record>>),
}

fn shutting_down() -> EngineError {
    engine_error(
        ErrorCode::ShuttingDown,
        "a data-plane core stopped before answering".to_owned(),
    )
}

/// An engine-style error raised by the shell (messages stay far below the frame's text limit).
fn engine_error(code: ErrorCode, message: String) -> EngineError {
    EngineError {
        code,
        detail: 0,
        message,
    }
}

fn invalid(message: String) -> EngineError {
    engine_error(ErrorCode::InvalidArgument, message)
}

/// The shards a subscription selects, checked like the engine checks them (the engine checks
/// again on each owner for the part it gets).
fn select_shards(
    selection: &ShardSelection,
    from: &StartPosition,
    shard_count: u32,
) -> Result<Vec<u32>, EngineError> {
    let out_of_range = |shard: u32| {
        invalid(format!(
            "shard {shard} is out of range: the stream has {shard_count} shards"
        ))
    };
    let selected: Vec<u32> = match selection {
        ShardSelection::All => (0..shard_count).collect(),
        ShardSelection::List(list) => {
            if list.is_empty() {
                return Err(invalid(
                    "a subscription selects at least one shard".to_owned(),
                ));
            }
            if let Some(&shard) = list.iter().find(|&&shard| shard >= shard_count) {
                return Err(out_of_range(shard));
            }
            let mut sorted = list.clone();
            sorted.sort_unstable();
            if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
                return Err(invalid(format!(
                    "shard {} is selected more than once",
                    pair[0]
                )));
            }
            sorted
        }
    };
    if let StartPosition::Offsets(positions) = from {
        for &(shard, _) in positions {
            if shard >= shard_count {
                return Err(out_of_range(shard));
            }
            if selected.binary_search(&shard).is_err() {
                return Err(invalid(format!(
                    "shard {shard} has a start offset but is not selected"
                )));
            }
        }
    }
    Ok(selected)
}

/// Frame name for messages.
pub(crate) fn frame_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Hello(_) => "Hello",
        Frame::HelloOk(_) => "HelloOk",
        Frame::CreateStream(_) => "CreateStream",
        Frame::DescribeStream { .. } => "DescribeStream",
        Frame::ListStreams { .. } => "ListStreams",
        Frame::DeleteStream { .. } => "DeleteStream",
        Frame::StreamInfo(_) => "StreamInfo",
        Frame::StreamList { .. } => "StreamList",
        Frame::Done { .. } => "Done",
        Frame::Publish(_) => "Publish",
        Frame::Ack(_) => "Ack",
        Frame::Subscribe(_) => "Subscribe",
        Frame::Subscribed(_) => "Subscribed",
        Frame::Delivery(_) => "Delivery",
        Frame::Error(_) => "Error",
    }
}
