//! Felix broker: the thread-per-core IO shell around the per-core state machine
//! (`felix_core::Core`). It owns what touches the operating system: the pinned core threads,
//! the UDP sockets and s2n-quic server endpoints (TLS 1.3, ALPN `felix/1`), the connection and
//! stream tasks, the cross-core mesh, the durable log's eventfd and timers, the TLS
//! certificates (including the generated development pair) and the Prometheus metrics
//! endpoint. Every decision is the state machine's; the shell feeds it inputs and carries out
//! its outputs. The split is written down in `docs/architecture.md` and
//! `docs/design/per-core.md`.
//!
//! Threads and cores:
//! - one pinned data-plane thread per core of the `felix_affinity::CorePlan`
//!   (`felix-core-<i>`): a [`CoreRuntime`] = one current-thread tokio runtime + `LocalSet`, the
//!   core's s2n-quic endpoints (its own port, plus its listeners on the shared SO_REUSEPORT
//!   port), its `felix_core::Core` and its durable log. Everything is `Rc`/`RefCell`, never
//!   shared with another thread; every connection and stream handler is a `spawn_local` task
//!   on its core.
//! - cores talk only through the mesh: one bounded lock-free queue (crossbeam `ArrayQueue`)
//!   per ordered core pair plus an eventfd per core for wake-ups. **No `Mutex`, `RwLock` or
//!   cross-thread `Notify` is used on the data path**; keep it that way.
//! - one housekeeping thread (`felix-metrics`) serving `GET /metrics` with tiny_http; it reads
//!   prometheus-client atomics the cores update and, on each scrape, each core thread's CPU
//!   time from /proc.
//! - the caller's thread starts them and joins them ([`Broker::start`], [`Broker::wait`]).
//!
//! Durable streams (`docs/design/durable.md`): each data-plane core owns one
//! `felix_core::DurableLog` under `<data_dir>/log/core-<i>/`, opened and recovered on the
//! core's thread before it serves. The catalogue of durable streams (`<data_dir>/catalog.json`)
//! is loaded here, restored on every core, and written by core 0's shell when core 0's state
//! machine asks, before the change is applied or acknowledged. A fatal storage error (failed
//! fdatasync) exits the process.

mod auth;
mod cluster;
mod connection;
mod error;
// Public only so benches/mesh.rs can drive it; not part of the broker's API.
#[doc(hidden)]
pub mod mesh;
mod metrics;
mod runtime;
mod settings;
mod shell;
mod tls;
mod udp;

use std::net::SocketAddr;
use std::sync::Arc;

use felix_affinity::CorePlan;
use felix_tuning::Config;

pub use auth::{TokenReloader, load_tokens};
pub use error::BrokerError;
pub use metrics::{ClusterSlot, CoreMetrics, Metrics, MetricsServer};
pub use runtime::{CoreReport, CoreRuntime};
pub use settings::{
    ConnectionSettings, MTU_UPPER_BOUND_CLAMP, MTU_UPPER_BOUND_MIN, STREAMS_REFUSED_SLACK,
    connection_settings, core_plan, durable_settings, effective_mtu, plan_options, security,
};
pub use shell::FATAL_STORAGE_EXIT_CODE;
pub use tls::{
    CertificatePair, DEV_CERT_NAMES, generate_self_signed, load_server_pair, write_pair,
};

/// Asks a running broker to stop (close every connection with `ShuttingDown`, then exit).
/// Cheap to clone and usable from any thread (e.g. a signal handler thread).
#[derive(Clone)]
pub struct ShutdownTrigger {
    sender: Arc<tokio::sync::watch::Sender<bool>>,
}

impl ShutdownTrigger {
    pub fn trigger(&self) {
        self.sender.send_replace(true);
    }
}

/// A running broker: its core threads and its metrics thread.
pub struct Broker {
    quic_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    shutdown: ShutdownTrigger,
    cores: Vec<CoreRuntime>,
    plan: CorePlan,
    mtu: u16,
    tokens: TokenReloader,
    // The control plane's service of a cluster member; stopped when the broker is dropped.
    cluster: Option<Arc<felix_cluster::service::Service>>,
    // Held so the metrics thread lives as long as the broker; stopped on drop.
    _metrics_server: Option<MetricsServer>,
}

/// Says once at start-up how clients are authenticated and authorized: a development broker
/// says plainly that it is open.
fn log_security(config: &Config, security: &felix_core::Security, tokens: usize) {
    let summary = config.auth_summary();
    if !security.auth_required && security.policy.is_open() {
        tracing::warn!(tokens, "{summary}");
    } else {
        tracing::info!(tokens, "{summary}");
    }
}

fn size(bytes: u64) -> usize {
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

impl Broker {
    /// Builds the core plan, loads (or generates) the TLS pair, binds the metrics endpoint and
    /// every UDP socket, starts one pinned thread per data-plane core and returns once all
    /// listen. The bound addresses are the real ones (port 0 resolved).
    pub fn start(config: &Config) -> Result<Broker, BrokerError> {
        let plan = core_plan(config)?;
        let mtu = effective_mtu(config)?;
        let security = Arc::new(settings::security(config)?);
        let client_ca = tls::load_client_ca(config)?;
        let (tokens, token_receiver) = TokenReloader::start(config.tokens_file.as_deref())?;
        log_security(config, &security, tokens.count());
        let pair = tls::load_server_pair(config)?;
        let core_count = plan.core_count();
        let mut durable = durable_settings(config)?;
        let mut catalog = felix_core::Catalog::load(&config.data_dir)?;
        settings::fit_segments(&mut durable, &config.data_dir, usize::from(core_count));
        catalog.bind_cores(core_count)?;
        let catalog_entries: Vec<felix_core::CatalogEntry> = catalog.entries().cloned().collect();
        let next_stream_id = catalog.next_stream_id();
        let mut catalog = Some(catalog);
        let metrics = Metrics::new(core_count);
        let cluster_slot = ClusterSlot::default();
        let metrics_server = match config.metrics_bind {
            Some(addr) => Some(MetricsServer::start(
                addr,
                metrics.clone(),
                Arc::clone(&cluster_slot),
            )?),
            None => None,
        };
        let metrics_addr = metrics_server.as_ref().map(MetricsServer::local_addr);
        let (sender, receiver) = tokio::sync::watch::channel(false);
        // Sockets first, on this thread: the shared port may be OS-assigned by its first bind.
        let recv = size(config.udp_recv_buffer);
        let send = size(config.udp_send_buffer);
        let bind_error = |addr: SocketAddr, error: std::io::Error| BrokerError::QuicBind {
            addr,
            reason: error.to_string(),
        };
        let mut shared_addr = config.bind;
        let mut own_sockets = Vec::with_capacity(usize::from(core_count));
        let mut shared_sockets = Vec::with_capacity(usize::from(core_count));
        for core in plan.cores() {
            let mut sockets = Vec::new();
            for _ in 0..core.listeners {
                let socket = udp::bind(shared_addr, true, recv, send)
                    .map_err(|error| bind_error(shared_addr, error))?;
                shared_addr = socket.local_addr;
                sockets.push(socket);
            }
            shared_sockets.push(sockets);
            let own_addr = SocketAddr::new(config.bind.ip(), core.own_port);
            let socket = udp::bind(own_addr, false, recv, send)
                .map_err(|error| bind_error(own_addr, error))?;
            tracing::info!(
                core = core.index,
                addr = %socket.local_addr,
                recv_buffer_bytes = socket.recv_buffer_bytes,
                send_buffer_bytes = socket.send_buffer_bytes,
                "UDP socket bound (effective kernel buffer sizes)"
            );
            own_sockets.push(socket);
        }
        let core_ports: Vec<u16> = own_sockets.iter().map(|s| s.local_addr.port()).collect();
        // The control plane, when this broker is a cluster member: prepared once the client
        // address is known; core 0 opens the member before it serves, and runs its loop.
        let (cluster, mut cluster_task) =
            match cluster::prepare(config, shared_addr, core_count, mtu)? {
                Some((service, task)) => (Some(service), Some(task)),
                None => (None, None),
            };
        let mesh =
            Arc::new(mesh::Mesh::new(core_count).map_err(|error| {
                BrokerError::Core(format!("cannot build the core mesh: {error}"))
            })?);
        let quic = runtime::QuicSettings {
            max_mtu: mtu,
            conn_recv_window: config.broker_pub_conn_recv_window,
            stream_recv_window: config.broker_pub_stream_recv_window,
            connection: settings::connection_settings(config),
        };
        // Announce (and decode) shard lists as long as the widest restored stream, even when
        // FELIX_MAX_SHARDS_PER_STREAM was lowered since it was created; creates still obey
        // the setting (the engine's bound).
        let mut limits = settings::limits(config);
        let widest = catalog_entries.iter().map(|entry| entry.shards).max();
        if let Some(widest) = widest.filter(|&widest| widest > limits.max_shards) {
            tracing::warn!(
                widest,
                max_shards_per_stream = limits.max_shards,
                "a durable stream has more shards than FELIX_MAX_SHARDS_PER_STREAM allows new ones"
            );
            limits.max_shards = widest;
        }
        let shutdown = ShutdownTrigger {
            sender: Arc::new(sender),
        };
        let mut cores = Vec::with_capacity(usize::from(core_count));
        for ((core, own_socket), shared) in plan.cores().iter().zip(own_sockets).zip(shared_sockets)
        {
            let settings = runtime::CoreSettings {
                cpu: core.cpu.os_index,
                own_socket,
                shared_sockets: shared,
                quic,
                core: felix_core::CoreConfig {
                    index: core.index,
                    core_count,
                    core_ports: core_ports.clone(),
                    limits,
                    engine: settings::engine_config(config),
                    ingress: settings::ingress_settings(config),
                    next_stream_id,
                    security: Arc::clone(&security),
                },
                data_dir: config.data_dir.clone(),
                durable: durable.clone(),
                entries: catalog_entries.clone(),
                // Core 0 writes the catalogue; the others get the entries only.
                catalog: if core.index == 0 {
                    catalog.take()
                } else {
                    None
                },
                client_ca: client_ca.clone(),
                tokens: token_receiver.clone(),
                cluster: cluster.clone(),
                cluster_task: if core.index == 0 {
                    cluster_task.take()
                } else {
                    None
                },
            };
            match CoreRuntime::spawn(
                settings,
                pair.clone(),
                metrics.clone(),
                Arc::clone(&mesh),
                receiver.clone(),
            ) {
                Ok(runtime) => cores.push(runtime),
                Err(error) => {
                    shutdown.trigger();
                    for started in cores {
                        let _ = started.join();
                    }
                    return Err(error);
                }
            }
        }
        // Core 0 reported ready, so the member is open: its status is real from here.
        if let Some(service) = &cluster {
            let _ = cluster_slot.set(Arc::clone(service));
        }
        Ok(Broker {
            quic_addr: shared_addr,
            metrics_addr,
            shutdown,
            cores,
            plan,
            mtu,
            tokens,
            cluster,
            _metrics_server: metrics_server,
        })
    }

    /// Re-reads FELIX_TOKENS_FILE (what SIGHUP does); see [`TokenReloader::reload`].
    #[must_use]
    pub fn token_reloader(&self) -> TokenReloader {
        self.tokens.clone()
    }

    /// The shared UDP address (SO_REUSEPORT group) any client may use.
    #[must_use]
    pub fn quic_addr(&self) -> SocketAddr {
        self.quic_addr
    }

    /// Each core's report: pinning, own address, shared listeners.
    #[must_use]
    pub fn core_reports(&self) -> Vec<CoreReport> {
        self.cores
            .iter()
            .map(|core| core.report().clone())
            .collect()
    }

    /// The core plan the broker runs.
    #[must_use]
    pub fn plan(&self) -> &CorePlan {
        &self.plan
    }

    /// The QUIC MTU upper bound in force (after clamping).
    #[must_use]
    pub fn mtu(&self) -> u16 {
        self.mtu
    }

    /// The control plane's service, when this broker is a cluster member.
    #[must_use]
    pub fn cluster(&self) -> Option<&Arc<felix_cluster::service::Service>> {
        self.cluster.as_ref()
    }

    /// The TCP address of the metrics endpoint, if enabled.
    #[must_use]
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    #[must_use]
    pub fn shutdown_trigger(&self) -> ShutdownTrigger {
        self.shutdown.clone()
    }

    /// Blocks until every core thread stops (after a shutdown trigger, or on a fatal error).
    pub fn wait(self) -> Result<(), BrokerError> {
        let mut result = Ok(());
        for core in self.cores {
            if let Err(error) = core.join() {
                tracing::error!(error = %felix_storage::ErrorChain(&error), "core thread failed");
                result = Err(error);
                // One core failing stops the broker: the others cannot serve its shards.
                self.shutdown.trigger();
            }
        }
        result
    }
}
