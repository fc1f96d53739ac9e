//! One data-plane core's thread: pinned, running a current-thread tokio runtime and a
//! `LocalSet` with the core's s2n-quic endpoints (its own port, plus its listeners on the
//! shared SO_REUSEPORT port), its state machine and its durable log (see [`Shell`]). Three
//! kinds of task run there: the accept loops (one per endpoint, each connection and stream a
//! task of `connection.rs`), the mesh pump (messages from other cores), and the timer task
//! (the log's eventfd and periodic fsync, admission deadlines, retention).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use felix_auth::TokenStore;
use felix_core::{Catalog, CatalogEntry, Core, CoreConfig, DurableLog, DurableSettings};
use felix_storage::ErrorChain;
use felix_wire::{Decoder, ErrorCode, Limits};
use s2n_quic::Server;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use crate::BrokerError;
use crate::connection;
use crate::mesh::{DRAIN_BATCH, Mesh, SPIN_BEFORE_PARK};
use crate::metrics::Metrics;
use crate::settings::ConnectionSettings;
use crate::shell::{Shell, close_code};
use crate::tls::CertificatePair;
use crate::udp::BoundSocket;

/// How long shutdown waits for connection tasks to end after closing them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// After the last connection task ended: time for the endpoint to transmit the
/// CONNECTION_CLOSE packets before the runtime (and the endpoint task) is dropped.
const CLOSE_PACKET_LINGER: Duration = Duration::from_millis(100);
/// How often the timer task applies retention (when FELIX_DURABLE_RETENTION_* is set):
/// deleting whole segments is coarse, so checking every few seconds is plenty.
const RETENTION_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// How long a clean shutdown waits for the cluster member (on core 0) to close its logs.
const CLUSTER_SHUTDOWN: Duration = Duration::from_secs(10);
/// How long a clean shutdown waits for the log to write and fdatasync what it holds.
const DURABLE_SHUTDOWN_FLUSH: Duration = Duration::from_secs(10);

/// QUIC endpoint settings shared by every endpoint of a core.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QuicSettings {
    pub max_mtu: u16,
    pub conn_recv_window: u64,
    pub stream_recv_window: u64,
    /// Hello bounds, idle timeout, QUIC's open-stream bound.
    pub connection: ConnectionSettings,
}

/// What a core needs to start.
#[derive(Debug)]
pub(crate) struct CoreSettings {
    pub cpu: usize,
    pub own_socket: BoundSocket,
    pub shared_sockets: Vec<BoundSocket>,
    pub quic: QuicSettings,
    pub core: CoreConfig,
    pub data_dir: PathBuf,
    pub durable: DurableSettings,
    /// The catalogue's streams, restored on every core at start-up.
    pub entries: Vec<CatalogEntry>,
    /// The catalogue file itself: core 0 only (it serializes catalogue changes).
    pub catalog: Option<Catalog>,
    /// FELIX_CLIENT_CA's PEM (mutual TLS), if set.
    pub client_ca: Option<String>,
    /// The tokens in force, replaced on SIGHUP.
    pub tokens: watch::Receiver<Arc<TokenStore>>,
    /// The cluster service, when this broker is a cluster member.
    pub cluster: Option<Arc<felix_cluster::service::Service>>,
    /// The cluster service's loop: core 0 opens the member and runs it (`cluster::host`).
    pub cluster_task: Option<felix_cluster::service::ServiceTask>,
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
            .name(format!("felix-core-{}", settings.core.index))
            .spawn(move || {
                let index = settings.core.index;
                let result = run_thread(settings, &pair, &metrics, mesh, shutdown, &ready_tx);
                if let Err(error) = result {
                    // Start-up failed, before the report: the channel carries the error.
                    tracing::debug!(core = index, error = %ErrorChain(&error), "core start-up failed");
                    let _ = ready_tx.send(Err(error));
                }
                Ok(())
            })
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
            // The thread ended without reporting: it panicked.
            Err(_) => match thread.join() {
                Ok(_) => Err(BrokerError::Core(
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

/// Start-up, then serving until shutdown. An error returned here happened before the core
/// reported ready; after that, the core stops only by shutdown (or exits the process on a
/// fatal storage error).
fn run_thread(
    settings: CoreSettings,
    pair: &CertificatePair,
    metrics: &Metrics,
    mesh: Arc<Mesh>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    ready: &std::sync::mpsc::SyncSender<Result<CoreReport, BrokerError>>,
) -> Result<(), BrokerError> {
    let index = settings.core.index;
    let core_error = |what: &str, error: &dyn std::fmt::Display| {
        BrokerError::Core(format!("core {index}: {what}: {error}"))
    };
    // Pin first, then record the tid, so the CPU time read later is this core's only.
    felix_affinity::pin_current_thread(settings.cpu)
        .map_err(|error| core_error("cannot pin the thread", &error))?;
    let core_metrics = metrics.core(index);
    core_metrics.set_tid(felix_affinity::Tid::current().0);
    let allowed_cpus = felix_affinity::current_thread_allowed_cpus()
        .map_err(|error| core_error("cannot read the affinity", &error))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| core_error("cannot build the tokio runtime", &error))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        // Open and recover this core's log before serving (blocks while recovery scans).
        let log =
            DurableLog::open_system(&settings.data_dir, usize::from(index), &settings.durable)?;
        let recovery = log.recovery();
        core_metrics.durable.set_recovery(
            recovery.seconds,
            recovery.truncated_bytes,
            log.counters().quarantined_records,
        );
        let log_wake = register(log.wake_fd().try_clone_to_owned())
            .map_err(|error| core_error("cannot watch the log's eventfd", &error))?;
        let mesh_wake = register(mesh.eventfd_of(index))
            .map_err(|error| core_error("cannot watch the wake-up eventfd", &error))?;
        let own_addr = settings.own_socket.local_addr;
        let report = CoreReport {
            index,
            cpu: settings.cpu,
            allowed_cpus,
            own_addr,
            shared_addrs: settings
                .shared_sockets
                .iter()
                .map(|s| s.local_addr)
                .collect(),
            recv_buffer_bytes: settings.own_socket.recv_buffer_bytes,
            send_buffer_bytes: settings.own_socket.send_buffer_bytes,
        };
        let mut servers = Vec::with_capacity(1 + settings.shared_sockets.len());
        for socket in std::iter::once(settings.own_socket).chain(settings.shared_sockets) {
            servers.push(start_endpoint(
                socket,
                pair,
                settings.client_ca.as_deref(),
                settings.quic,
                core_metrics.wire_bytes_counter(),
            )?);
        }
        let decoder = Decoder::new(settings.core.limits);
        let hello_decoder = Decoder::new(Limits {
            max_frame_bytes: settings.quic.connection.hello_max_bytes,
            ..settings.core.limits
        });
        let read_budget =
            settings.quic.conn_recv_window + u64::from(settings.core.limits.max_frame_bytes);
        let mut core = Core::new(settings.core);
        core.restore_durable(&log, &settings.entries)
            .map_err(|(name, error)| {
                BrokerError::Catalog(felix_core::CatalogError::Invalid {
                    path: PathBuf::from(felix_core::CATALOG_FILE),
                    reason: format!("cannot restore stream {name:?}: {}", ErrorChain(&error)),
                })
            })?;
        // The cluster member opens here, before the core serves: its recovery, like the log's.
        let hosted = match settings.cluster_task {
            Some(task) => Some(crate::cluster::host(task, shutdown.clone()).await?),
            None => None,
        };
        let (cluster_link, cluster_parts) = match settings.cluster {
            Some(service) => {
                let streams = service.view();
                let (link, answers) = crate::cluster::CoreLink::new(service, index);
                (Some(link), Some((answers, streams)))
            }
            None => (None, None),
        };
        let shell = Rc::new(Shell::new(
            core,
            log,
            settings.catalog,
            mesh,
            (decoder, hello_decoder),
            settings.tokens.clone(),
            settings.quic.connection.hello_timeout,
            read_budget,
            metrics.clone(),
            core_metrics,
            cluster_link,
        ));
        let _ = ready.send(Ok(report));
        tracing::info!(core = index, cpu = settings.cpu, %own_addr, "core serving");
        tokio::task::spawn_local(pump(Rc::clone(&shell), mesh_wake));
        let tokens =
            tokio::task::spawn_local(crate::auth::token_task(Rc::clone(&shell), settings.tokens));
        let timers = tokio::task::spawn_local(timers(Rc::clone(&shell), log_wake));
        let cluster = cluster_parts.map(|(answers, streams)| {
            tokio::task::spawn_local(crate::cluster::core_task(
                Rc::clone(&shell),
                answers,
                streams,
            ))
        });
        serve(Rc::clone(&shell), servers, shutdown).await;
        timers.abort();
        tokens.abort();
        if let Some(cluster) = cluster {
            cluster.abort();
        }
        if let Some(hosted) = hosted {
            // The member saw the shutdown too: it closes its logs and answers what waits.
            if tokio::time::timeout(CLUSTER_SHUTDOWN, hosted)
                .await
                .is_err()
            {
                tracing::warn!(
                    core = index,
                    "the cluster member did not stop within {CLUSTER_SHUTDOWN:?}"
                );
            }
        }
        shell.shutdown_log(DURABLE_SHUTDOWN_FLUSH);
        Ok(())
    })
}

/// Registers an eventfd duplicate with the core's reactor.
fn register(
    fd: std::io::Result<std::os::fd::OwnedFd>,
) -> std::io::Result<AsyncFd<std::os::fd::OwnedFd>> {
    fd.and_then(|fd| {
        // SAFETY: `fd` is an OwnedFd this AsyncFd takes by value: it stays open exactly as long
        // as the registration and nothing else can close it under the reactor.
        unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
    })
}

fn start_endpoint(
    socket: BoundSocket,
    pair: &CertificatePair,
    client_ca: Option<&str>,
    quic: QuicSettings,
    wire_bytes: crate::metrics::WireBytes,
) -> Result<Server, BrokerError> {
    let addr = socket.local_addr;
    let bind_error = |reason: String| BrokerError::QuicBind { addr, reason };
    let tls = crate::tls::server_tls(pair, client_ca)?;
    let io = s2n_quic::provider::io::tokio::Builder::default()
        .with_rx_socket(socket.socket)
        .and_then(|builder| builder.with_gso(true))
        .and_then(|builder| builder.with_gro(true))
        .and_then(|builder| builder.with_max_mtu(quic.max_mtu))
        .and_then(|builder| builder.build())
        .map_err(|error| bind_error(error.to_string()))?;
    let limits = s2n_quic::provider::limits::Limits::new()
        .with_max_open_remote_bidirectional_streams(quic.connection.quic_streams_max)
        .and_then(|limits| limits.with_max_idle_timeout(quic.connection.idle_timeout))
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
        .with_event((wire_bytes, crate::auth::PeerIdentity))
        .map_err(|error| bind_error(error.to_string()))?
        .start()
        .map_err(|error| bind_error(error.to_string()))
}

async fn accept_loop(shell: Rc<Shell>, mut server: Server) {
    while let Some(connection) = server.accept().await {
        tokio::task::spawn_local(connection::serve_connection(Rc::clone(&shell), connection));
    }
}

/// Accepts until shutdown, then closes every connection with `ShuttingDown`.
async fn serve(
    shell: Rc<Shell>,
    servers: Vec<Server>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let accept_tasks: Vec<_> = servers
        .into_iter()
        .map(|server| tokio::task::spawn_local(accept_loop(Rc::clone(&shell), server)))
        .collect();
    loop {
        // An error means every trigger is gone: nobody can ask us to stop any more, so stop
        // now rather than run unowned.
        if shutdown.changed().await.is_err() || *shutdown.borrow() {
            break;
        }
    }
    tracing::info!(core = shell.index, "shutting down: closing connections");
    for handle in shell.connections.borrow().values() {
        handle.close(close_code(ErrorCode::ShuttingDown));
    }
    for task in &accept_tasks {
        task.abort();
    }
    let all_closed = async {
        while !shell.connections.borrow().is_empty() {
            shell.connections_changed.notified().await;
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

/// The core's message pump: drains its inbound queues in batches into the machine, spins
/// briefly when idle, then parks on its eventfd. While a destination queue is full it retries
/// the outbox once after announcing it waits for room, then parks at once (no spin): the
/// receiver's drain, or an inbound message, wakes it (the room protocol of mesh.rs).
async fn pump(shell: Rc<Shell>, eventfd: AsyncFd<std::os::fd::OwnedFd>) {
    let index = shell.index;
    let mut batch = Vec::with_capacity(DRAIN_BATCH);
    let mut idle_since = Instant::now();
    loop {
        shell.mesh.drain(index, DRAIN_BATCH, &mut batch);
        if !batch.is_empty() {
            shell.input(|core, now| {
                for message in batch.drain(..) {
                    core.handle_message(now, message);
                }
            });
            idle_since = Instant::now();
            tokio::task::yield_now().await;
            continue;
        }
        if shell.core.borrow().outbox_len() > 0 {
            // Announces it waits for room and retries once (Shell::send_messages).
            shell.send_messages(&mut shell.core.borrow_mut());
        }
        let blocked = shell.core.borrow().outbox_len() > 0;
        if !blocked && idle_since.elapsed() < SPIN_BEFORE_PARK {
            tokio::task::yield_now().await;
            continue;
        }
        // Idle past the spin, or blocked by a full queue: park. Inbound messages wake it
        // (they are drained above, so two cores blocked on each other both make progress),
        // and so does a receiver that drained one of its queues while it waits for room.
        if !shell.mesh.park(index) {
            continue;
        }
        match eventfd.readable().await {
            Ok(mut guard) => {
                shell.mesh.reset(index);
                guard.clear_ready();
            }
            Err(error) => {
                tracing::error!(%error, "wake-up eventfd failed; polling instead");
                tokio::time::sleep(SPIN_BEFORE_PARK).await;
            }
        }
        shell.mesh.unpark(index);
        idle_since = Instant::now();
    }
}

/// The core's timer task: pumps the log when its eventfd says a round finished, at its
/// periodic-fsync deadline and when asked (`timers_changed`: reads left for later, or a
/// deadline moved); expires admission waiters at their deadline; applies retention every
/// [`RETENTION_CHECK_INTERVAL`] when configured.
async fn timers(shell: Rc<Shell>, wake: AsyncFd<std::os::fd::OwnedFd>) {
    let retention = shell.log.borrow().retention_configured();
    let mut next_retention = Instant::now() + RETENTION_CHECK_INTERVAL;
    loop {
        let log_deadline = shell.log.borrow().next_deadline();
        let admission_deadline = shell.core.borrow().poll_timeout();
        let deadline = [
            log_deadline,
            admission_deadline,
            retention.then_some(next_retention),
        ]
        .into_iter()
        .flatten()
        .min();
        shell.next_deadline.set(deadline);
        let timer = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ready = wake.readable() => match ready {
                // Clear before pumping: the pump drains the eventfd, then reaps.
                Ok(mut guard) => guard.clear_ready(),
                Err(error) => {
                    tracing::error!(%error, "log eventfd failed; polling instead");
                    tokio::time::sleep(SPIN_BEFORE_PARK).await;
                }
            },
            () = timer => {}
            () = shell.timers_changed.notified() => {}
        }
        shell.input(|core, now| {
            if admission_deadline.is_some_and(|at| at <= now.at) {
                core.handle_timeout(now);
            }
            if retention && now.at >= next_retention {
                shell.apply_retention(core, now);
                next_retention = now.at + RETENTION_CHECK_INTERVAL;
            }
            shell.pump_log(core, now);
        });
    }
}
