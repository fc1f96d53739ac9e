//! Felix typed configuration: one struct, layered defaults < file < FELIX_* environment <
//! command-line flags, with the source of every effective value kept for `felix config`.
//! A bad value is an error naming the variable and the accepted range.
//!
//! API CONTRACT (implementation in progress): the broker and CLI are written against the
//! names below; keep them.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Where an effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Default,
    /// The config file, with its path.
    File(PathBuf),
    /// The named environment variable.
    Env(String),
    /// A command-line flag.
    Flag,
}

/// One line of `felix config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Environment variable name, e.g. `FELIX_REPLAY_RING_MAX_BYTES`.
    pub env: &'static str,
    /// Effective value, rendered as it would be written in the environment.
    pub value: String,
    pub source: Source,
}

/// Every setting of the broker and of the CLI/client, with its effective value.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    // ---- broker ----
    /// FELIX_BIND: QUIC (UDP) listen address. Default 127.0.0.1:7400. Restart.
    pub bind: SocketAddr,
    /// FELIX_METRICS_BIND: Prometheus HTTP address, or `off`. Default 127.0.0.1:9400. Restart.
    pub metrics_bind: Option<SocketAddr>,
    /// FELIX_DATA_DIR: data directory (logs, dev TLS pair). Default
    /// `$XDG_DATA_HOME/felix`, else `$HOME/.local/share/felix`, else `./felix-data`.
    pub data_dir: PathBuf,
    /// FELIX_TLS_CERT / FELIX_TLS_KEY: PEM certificate chain and key. Default: unset, the
    /// broker generates (once) a development pair under `<data_dir>/tls/`.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// FELIX_REPLAY_RING_MAX_BYTES: per-shard ring bound in payload bytes. Default 64 MiB.
    pub replay_ring_max_bytes: u64,
    /// FELIX_REPLAY_RING_MAX_RECORDS: per-shard ring bound in records. Default 1024.
    pub replay_ring_max_records: u64,
    /// FELIX_MAX_FRAME_BYTES: largest frame body. Default 16 MiB.
    pub max_frame_bytes: u32,
    /// FELIX_MAX_BATCH_RECORDS: largest publish batch. Default 4096.
    pub max_batch_records: u32,
    /// FELIX_SUBSCRIBER_QUEUE_MAX_BYTES: live backlog per subscription. Default 64 MiB.
    pub subscriber_queue_max_bytes: u64,
    // ---- client / CLI ----
    /// FELIX_ADDR: broker address the CLI connects to. Default 127.0.0.1:7400.
    pub addr: SocketAddr,
    /// FELIX_SERVER_NAME: TLS server name the client verifies. Default `localhost`.
    pub server_name: String,
    /// FELIX_CA: CA certificate (PEM) the client trusts. Default
    /// `<data_dir>/tls/dev-cert.pem` (the generated development certificate).
    pub ca: Option<PathBuf>,
    /// FELIX_INSECURE: skip server certificate verification (development only). Default 0.
    pub insecure: bool,
    /// FELIX_PUBLISH_INFLIGHT_BYTES: client publish budget. Default 4 MiB.
    pub publish_inflight_bytes: u64,
}
