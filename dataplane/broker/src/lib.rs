//! Felix broker: the thread-per-core IO shell around the sans-IO shard engine. It owns the
//! QUIC glue (s2n-quic server endpoints on sockets it creates itself, TLS 1.3, ALPN
//! `felix/1`), connection and stream handling per the "Connection and stream usage" section of
//! `docs/wire-protocol.md`, the cross-core mesh, the per-core ingress admission, the
//! Prometheus metrics endpoint and the TLS certificates (including the generated development
//! pair). The design is written down in `docs/design/per-core.md`.
//!
//! Threads and cores:
//! - one pinned data-plane thread per core of the `felix_affinity::CorePlan`
//!   (`felix-core-<i>`): a [`CoreRuntime`] = one current-thread tokio runtime + `LocalSet`, the
//!   core's s2n-quic endpoints (its own port, plus its listeners on the shared SO_REUSEPORT
//!   port), one `felix_engine::Engine` and one ingress queue. Core state is `Rc`/`RefCell`,
//!   never shared with another thread; every connection and stream handler is a `spawn_local`
//!   task on its core. Shard `s` is owned by core `s % cores`.
//! - cores talk only through the mesh: one bounded lock-free queue (crossbeam `ArrayQueue`)
//!   per ordered core pair plus an eventfd per core for wake-ups. **No `Mutex`, `RwLock` or
//!   cross-thread `Notify` is used on the data path**; keep it that way.
//! - one housekeeping thread (`felix-metrics`) serving `GET /metrics` with tiny_http; it reads
//!   prometheus-client atomics the cores update and, on each scrape, each core thread's CPU
//!   time from /proc.
//! - the caller's thread starts them and joins them ([`Broker::start`], [`Broker::wait`]).
//!
//! Durable streams (`docs/design/durable.md`): each data-plane core owns one
//! `felix_storage::Log` under `<data_dir>/log/core-<i>/`, opened and recovered on the core's
//! thread before it serves, and driven from the core's event loop (`durable.rs`). The
//! catalogue of durable streams (`catalog.rs`, `<data_dir>/catalog.json`) is loaded here,
//! restored on every core, and changed only by core 0, which persists each change before it
//! is acknowledged. A fatal storage error (failed fdatasync) exits the process.

mod admission;
pub mod catalog;
mod connection;
mod core_runtime;
pub mod durable;
// Public only so benches/mesh.rs can drive it; not part of the broker's API.
#[doc(hidden)]
pub mod mesh;
mod metrics;
mod tls;
mod udp;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use felix_affinity::{CorePlan, CpuSelection, PlanOptions, Topology};
use felix_engine::EngineConfig;
use felix_tuning::Config;
use felix_wire::Limits;

pub use admission::{Admission, AdmissionEvent, Decision, Policy, Ticket};
pub use core_runtime::{CoreReport, CoreRuntime};
pub use metrics::{CoreMetrics, Metrics, MetricsServer};
pub use tls::{
    CertificatePair, DEV_CERT_NAMES, generate_self_signed, load_server_pair, write_pair,
};

/// Everything that can stop the broker from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot generate a certificate: {0}")]
    CertificateGeneration(String),
    #[error("TLS configuration failed: {0}")]
    Tls(String),
    #[error("cannot start the QUIC endpoint on {addr}: {reason}")]
    QuicBind { addr: SocketAddr, reason: String },
    #[error("cannot start the metrics endpoint on {addr}: {reason}")]
    MetricsBind { addr: SocketAddr, reason: String },
    #[error("cannot start thread {name}: {source}")]
    Thread {
        name: &'static str,
        source: std::io::Error,
    },
    #[error("core thread failed: {0}")]
    Core(String),
    #[error("{0}")]
    Plan(#[from] felix_affinity::AffinityError),
    #[error("durable catalogue {path}: {reason}")]
    Catalog { path: PathBuf, reason: String },
    #[error("durable log: {0}")]
    Storage(#[from] felix_storage::StorageError),
    #[error("{env}={value:?}: {reason}")]
    Setting {
        env: &'static str,
        value: String,
        reason: String,
    },
}

/// The largest QUIC MTU the broker uses: s2n-quic corrupts memory with GSO above 32768
/// (MACHINE-NOTES), and 16384 measured fastest below that bound.
pub const MTU_UPPER_BOUND_CLAMP: u16 = 16_384;
/// The smallest: QUIC requires 1200-byte datagrams on every path (RFC 9000 section 14).
pub const MTU_UPPER_BOUND_MIN: u16 = 1200;
/// Test-only knob: while the file it names exists, cores other than 0 leave their inbound
/// queues alone, so an integration test can hold cross-core publish jobs in core 0's ingress
/// queue without timing assumptions. Never set it in production.
pub const TEST_PAUSE_ENV: &str = "TEST_FELIX_PAUSE_CORE_EXECUTOR";

/// Parses FELIX_DATAPLANE_CORES and FELIX_QUIC_LISTENERS (`auto` = the plan's default).
pub fn plan_options(config: &Config) -> Result<PlanOptions, BrokerError> {
    let dataplane_cores = match config.dataplane_cores.trim() {
        "auto" => None,
        text => Some(CpuSelection::parse(text)?),
    };
    let quic_listeners = match config.quic_listeners.trim() {
        "auto" => None,
        text => Some(text.parse::<u32>().map_err(|error| BrokerError::Setting {
            env: "FELIX_QUIC_LISTENERS",
            value: text.to_owned(),
            reason: format!("expected auto or a whole number: {error}"),
        })?),
    };
    Ok(PlanOptions {
        dataplane_cores,
        quic_listeners,
        base_port: config.bind.port(),
    })
}

/// Detects the topology and builds the core plan from the configuration.
pub fn core_plan(config: &Config) -> Result<CorePlan, BrokerError> {
    let topology = Topology::detect()?;
    Ok(CorePlan::new(&topology, &plan_options(config)?)?)
}

/// The durable settings (FELIX_DURABLE_*, FELIX_STORAGE_IO_URING) as the logs use them.
pub fn durable_settings(config: &Config) -> Result<durable::DurableSettings, BrokerError> {
    let fsync = match config.durable_fsync_mode.as_str() {
        "on_commit" => felix_storage::FsyncMode::OnCommit,
        "periodic" => felix_storage::FsyncMode::Periodic {
            interval: std::time::Duration::from_millis(config.durable_fsync_interval_ms),
        },
        other => {
            return Err(BrokerError::Setting {
                env: "FELIX_DURABLE_FSYNC_MODE",
                value: other.to_owned(),
                reason: "expected periodic or on_commit".to_owned(),
            });
        }
    };
    Ok(durable::DurableSettings {
        fsync,
        backend: if config.storage_io_uring {
            felix_storage::BackendChoice::IoUring
        } else {
            felix_storage::BackendChoice::Pwrite
        },
        segment_bytes: config.durable_segment_bytes,
        retention_bytes: (config.durable_retention_bytes > 0)
            .then_some(config.durable_retention_bytes),
        retention_age: (config.durable_retention_seconds > 0)
            .then(|| std::time::Duration::from_secs(config.durable_retention_seconds)),
    })
}

/// FELIX_MTU_UPPER_BOUND as the broker applies it: below 1200 is an error, above 16384 is
/// clamped with a warning.
pub fn effective_mtu(config: &Config) -> Result<u16, BrokerError> {
    let requested = config.mtu_upper_bound;
    if requested < u64::from(MTU_UPPER_BOUND_MIN) {
        return Err(BrokerError::Setting {
            env: "FELIX_MTU_UPPER_BOUND",
            value: requested.to_string(),
            reason: format!("QUIC needs at least {MTU_UPPER_BOUND_MIN}"),
        });
    }
    if requested > u64::from(MTU_UPPER_BOUND_CLAMP) {
        tracing::warn!(
            requested,
            clamped = MTU_UPPER_BOUND_CLAMP,
            "FELIX_MTU_UPPER_BOUND={requested} clamped to {MTU_UPPER_BOUND_CLAMP}: s2n-quic corrupts memory with GSO above 32768"
        );
        return Ok(MTU_UPPER_BOUND_CLAMP);
    }
    // Checked against the u16 clamp just above.
    Ok(u16::try_from(requested).unwrap_or(MTU_UPPER_BOUND_CLAMP))
}

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
    // Held so the metrics thread lives as long as the broker; stopped on drop.
    _metrics_server: Option<MetricsServer>,
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
        let pair = tls::load_server_pair(config)?;
        let core_count = plan.core_count();
        let durable_settings = durable_settings(config)?;
        let mut catalog = catalog::Catalog::load(&config.data_dir)?;
        catalog.bind_cores(core_count)?;
        let catalog_entries: Vec<catalog::CatalogEntry> = catalog.entries().cloned().collect();
        let mut catalog = Some(catalog);
        let metrics = Metrics::new(core_count);
        let metrics_server = match config.metrics_bind {
            Some(addr) => Some(MetricsServer::start(addr, metrics.clone())?),
            None => None,
        };
        let metrics_addr = metrics_server.as_ref().map(MetricsServer::local_addr);
        let (sender, receiver) = tokio::sync::watch::channel(false);
        let limits = Limits {
            max_frame_bytes: config.max_frame_bytes,
            max_batch_records: config.max_batch_records,
            ..Limits::DEFAULT
        };
        let engine = EngineConfig {
            // The tuning crate bounds this to 16,777,216, which fits any usize we run on.
            ring_max_records: usize::try_from(config.replay_ring_max_records).unwrap_or(usize::MAX),
            ring_max_bytes: config.replay_ring_max_bytes,
            subscriber_queue_max_bytes: config.subscriber_queue_max_bytes,
            max_shards: limits.max_shards,
            max_name_bytes: limits.max_name_bytes,
        };
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
        let mesh =
            Arc::new(mesh::Mesh::new(core_count).map_err(|error| {
                BrokerError::Core(format!("cannot build the core mesh: {error}"))
            })?);
        let ingress = core_runtime::IngressSettings {
            depth: config.ingress_queue_depth,
            budget_bytes: config.ingress_byte_budget,
            fire_and_forget_waits: config.pub_ingress_wait,
            ack_on_commit: config.ack_on_commit,
            commit_wait: std::time::Duration::from_millis(config.publish_queue_wait_ms),
        };
        let quic = core_runtime::QuicSettings {
            max_mtu: mtu,
            conn_recv_window: config.broker_pub_conn_recv_window,
            stream_recv_window: config.broker_pub_stream_recv_window,
        };
        let test_pause_file = std::env::var_os(TEST_PAUSE_ENV).map(PathBuf::from);
        let shutdown = ShutdownTrigger {
            sender: Arc::new(sender),
        };
        let mut cores = Vec::with_capacity(usize::from(core_count));
        for ((core, own_socket), shared) in plan.cores().iter().zip(own_sockets).zip(shared_sockets)
        {
            let settings = core_runtime::CoreSettings {
                core_index: core.index,
                cpu: core.cpu.os_index,
                own_socket,
                shared_sockets: shared,
                core_ports: core_ports.clone(),
                limits,
                engine,
                quic,
                ingress,
                test_pause_file: test_pause_file.clone(),
                durable: core_runtime::DurableSetup {
                    data_dir: config.data_dir.clone(),
                    settings: durable_settings.clone(),
                    entries: catalog_entries.clone(),
                    // Core 0 owns the catalogue; the others get the entries only.
                    catalog: if core.index == 0 {
                        catalog.take()
                    } else {
                        None
                    },
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
        Ok(Broker {
            quic_addr: shared_addr,
            metrics_addr,
            shutdown,
            cores,
            plan,
            mtu,
            _metrics_server: metrics_server,
        })
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
                tracing::error!(%error, "core thread failed");
                result = Err(error);
                // One core failing stops the broker: the others cannot serve its shards.
                self.shutdown.trigger();
            }
        }
        result
    }
}
