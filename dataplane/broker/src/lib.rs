//! Felix broker: the IO shell around the sans-IO shard engine. It owns the QUIC glue (one
//! s2n-quic server endpoint, TLS 1.3, ALPN `felix/1`), connection and stream handling per the
//! "Connection and stream usage" section of `docs/wire-protocol.md`, the Prometheus metrics
//! endpoint and the TLS certificates (including the generated development pair).
//!
//! Threads and cores:
//! - one data-plane core thread (`felix-core-0`): a [`CoreRuntime`] = one current-thread tokio
//!   runtime + `LocalSet` + one s2n-quic endpoint + one `felix_engine::Engine`. The engine is
//!   `Rc<RefCell<..>>`, never shared with another thread; every connection and stream handler is
//!   a `spawn_local` task on that thread. The next step replicates this unit per pinned core.
//! - one housekeeping thread (`felix-metrics`) serving `GET /metrics` with tiny_http; it only
//!   reads prometheus-client atomics that the core thread updates.
//! - the caller's thread starts both and joins them ([`Broker::start`], [`Broker::wait`]).

mod connection;
mod core_runtime;
mod metrics;
mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use felix_engine::EngineConfig;
use felix_tuning::Config;
use felix_wire::Limits;

pub use core_runtime::CoreRuntime;
pub use metrics::{Metrics, MetricsServer};
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

/// A running broker: its core thread and its metrics thread.
pub struct Broker {
    quic_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    shutdown: ShutdownTrigger,
    core: CoreRuntime,
    // Held so the metrics thread lives as long as the broker; stopped on drop.
    _metrics_server: Option<MetricsServer>,
}

impl Broker {
    /// Loads (or generates) the TLS pair, binds the metrics endpoint and the QUIC endpoint, and
    /// returns once both are listening. The bound addresses are the real ones (port 0 resolved).
    pub fn start(config: &Config) -> Result<Broker, BrokerError> {
        let pair = tls::load_server_pair(config)?;
        let metrics = Metrics::new();
        let metrics_server = match config.metrics_bind {
            Some(addr) => Some(MetricsServer::start(addr, metrics.registry())?),
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
        let core = CoreRuntime::spawn(
            core_runtime::CoreSettings {
                core_index: 0,
                bind: config.bind,
                limits,
                engine,
            },
            pair,
            metrics,
            receiver,
        )?;
        Ok(Broker {
            quic_addr: core.local_addr(),
            metrics_addr,
            shutdown: ShutdownTrigger {
                sender: Arc::new(sender),
            },
            core,
            _metrics_server: metrics_server,
        })
    }

    /// The UDP address the QUIC endpoint is bound to.
    #[must_use]
    pub fn quic_addr(&self) -> SocketAddr {
        self.quic_addr
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

    /// Blocks until the core thread stops (after a shutdown trigger, or on a fatal error).
    pub fn wait(self) -> Result<(), BrokerError> {
        self.core.join()
    }
}
