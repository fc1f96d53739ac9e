//! Everything that can stop the broker from starting or running.

use std::net::SocketAddr;
use std::path::PathBuf;

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
    #[error("{0}")]
    Catalog(#[from] felix_core::CatalogError),
    #[error("durable log: {0}")]
    Storage(#[from] felix_storage::StorageError),
    #[error("{env}={value:?}: {reason}")]
    Setting {
        env: &'static str,
        value: String,
        reason: String,
    },
}
