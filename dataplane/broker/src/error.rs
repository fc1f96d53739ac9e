//! Everything that can stop the broker from starting or running.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Everything that can stop the broker from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
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
    #[error("cannot start thread {name}")]
    Thread {
        name: &'static str,
        source: std::io::Error,
    },
    #[error("core thread failed: {0}")]
    Core(String),
    #[error(transparent)]
    Plan(#[from] felix_affinity::AffinityError),
    #[error(transparent)]
    Catalog(#[from] felix_core::CatalogError),
    #[error("durable log")]
    Storage(#[from] felix_storage::StorageError),
    #[error("cluster: {0}")]
    Cluster(String),
    #[error("{env}={value:?}: {reason}")]
    Setting {
        env: &'static str,
        value: String,
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use std::io;

    use felix_storage::{ErrorChain, StorageError};

    use super::BrokerError;

    /// The chain that used to repeat its cause three times (issue: "durable log: create
    /// DIR/log/core-0: Not a directory (os error 20): create ...: Not a directory (os error
    /// 20): Not a directory (os error 20)"): each error says its own part once.
    #[test]
    fn a_nested_error_says_each_part_once() {
        let io = io::Error::from_raw_os_error(libc::ENOTDIR);
        let cause = io.to_string();
        let storage = StorageError::Io {
            context: "create DIR/log/core-0".to_owned(),
            source: std::sync::Arc::new(io),
        };
        let error = BrokerError::from(storage);
        let rendered = ErrorChain(&error).to_string();
        assert_eq!(
            rendered,
            format!("durable log: create DIR/log/core-0: {cause}")
        );
        assert_eq!(rendered.matches(&cause).count(), 1);
        // anyhow's alternate form (what `felix` prints) walks the same chain.
        let top = anyhow::Error::from(error).context("cannot start the broker");
        assert_eq!(
            format!("{top:#}"),
            format!("cannot start the broker: durable log: create DIR/log/core-0: {cause}")
        );
        // A transparent wrapper adds nothing of its own.
        let plan = BrokerError::from(felix_affinity::AffinityError::NoListeners);
        assert_eq!(ErrorChain(&plan).to_string(), plan.to_string());
    }
}
