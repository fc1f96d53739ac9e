//! Felix typed configuration: one struct, layered defaults < config file (TOML) < FELIX_*
//! environment < command-line flags, with the source of every effective value kept for
//! `felix config`. A bad value is an error naming the variable, the value (`(hidden)` for a
//! secret), where it came from and what is accepted; nothing silently falls back.
//!
//! The crate owns the settings table (`settings.rs`: one entry per setting drives parsing,
//! validation, [`Config::entries`] and [`reference_markdown`]) and the value syntax
//! (`values.rs`). It runs once, on the thread that starts the broker or a CLI command, before
//! any data-plane core starts; it keeps no per-core state and does no IO besides reading the
//! config file. The broker copies the values it needs to each core.

pub mod host;
pub mod preflight;
mod settings;
mod values;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use settings::{BaseDirs, DefaultValue, Restart, SETTINGS, Setting};
use values::{FieldValue, Kind};

/// Every setting's environment variable starts with this; so does [`CONFIG_ENV`].
const ENV_PREFIX: &str = "FELIX_";

/// Names the config file when `Config::load` is not given one. Not a setting itself.
pub const CONFIG_ENV: &str = "FELIX_CONFIG";

/// Directory under the data directory holding the development TLS pair.
const DEV_TLS_DIR: &str = "tls";
const DEV_CERT_FILE: &str = "dev-cert.pem";
const DEV_KEY_FILE: &str = "dev-key.pem";

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

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File(path) => write!(f, "file {}", path.display()),
            Source::Env(_) => f.write_str("environment"),
            Source::Flag => f.write_str("command-line flag"),
        }
    }
}

/// One line of `felix config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Environment variable name, e.g. `FELIX_REPLAY_RING_MAX_BYTES`.
    pub env: &'static str,
    /// Effective value, rendered as it would be written in the environment; a secret
    /// (FELIX_TOKEN) is `(hidden)` when set.
    pub value: String,
    pub source: Source,
}

/// Where each setting's value came from, by variable name. A setting missing here (a `Config`
/// built by hand) reports [`Source::Default`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources(BTreeMap<&'static str, Source>);

impl Sources {
    /// The source of the setting named `env` (its environment variable name).
    pub fn of(&self, env: &str) -> Source {
        self.0.get(env).cloned().unwrap_or(Source::Default)
    }
}

/// Every setting of the broker and of the CLI/client, with its effective value.
///
/// Ranges are inclusive. "Restart" means the broker reads the value once at start-up; client
/// settings are read by each `felix` command. The settings table in `settings.rs` is the
/// authority; docs/configuration.md is generated from it. `Debug` (written by the `settings!`
/// macro) shows secrets as `(hidden)`.
#[derive(Clone, PartialEq)]
pub struct Config {
    // ---- broker ----
    /// FELIX_BIND: QUIC (UDP) listen address. Default 127.0.0.1:7400. Restart.
    pub bind: SocketAddr,
    /// FELIX_METRICS_BIND: Prometheus HTTP address, or `off`. Default 127.0.0.1:9400. Restart.
    pub metrics_bind: Option<SocketAddr>,
    /// FELIX_DATA_DIR: data directory (logs, dev TLS pair), non-empty. Default
    /// `$XDG_DATA_HOME/felix`, else `$HOME/.local/share/felix`, else `./felix-data`. Restart.
    pub data_dir: PathBuf,
    /// FELIX_TLS_CERT / FELIX_TLS_KEY: PEM certificate chain and key, both set or both unset.
    /// Default: unset, the broker generates (once) a development pair under `<data_dir>/tls/`.
    /// Restart.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// FELIX_REPLAY_RING_MAX_BYTES: per-shard ring bound in payload bytes, 0..=1 TiB.
    /// Default 64 MiB. Restart.
    pub replay_ring_max_bytes: u64,
    /// FELIX_REPLAY_RING_MAX_RECORDS: per-shard ring bound in records, 0..=16777216.
    /// Default 1024. Restart.
    pub replay_ring_max_records: u64,
    /// FELIX_MAX_FRAME_BYTES: largest frame body, 64 KiB..=64 MiB. Default 16 MiB. Restart.
    pub max_frame_bytes: u32,
    /// FELIX_MAX_BATCH_RECORDS: largest publish batch, 1..=65536. Default 4096. Restart.
    pub max_batch_records: u32,
    /// FELIX_SUBSCRIBER_QUEUE_MAX_BYTES: live backlog per subscription, 64 KiB..=16 GiB.
    /// Default 64 MiB. Restart.
    pub subscriber_queue_max_bytes: u64,
    /// FELIX_LOG: tracing filter for the broker and the CLI, non-empty. Default `info`.
    /// Restart.
    pub log: String,
    /// FELIX_DATAPLANE_CORES: `auto`, a count or a CPU list (parsed by felix-affinity).
    /// Default `auto`. Restart.
    pub dataplane_cores: String,
    /// FELIX_QUIC_LISTENERS: `auto` (one per core) or a count >= 1. Default `auto`. Restart.
    pub quic_listeners: String,
    /// FELIX_UDP_RECV_BUFFER: SO_RCVBUF per UDP socket, 64 KiB..=1 GiB. Default 8 MiB. Restart.
    pub udp_recv_buffer: u64,
    /// FELIX_UDP_SEND_BUFFER: SO_SNDBUF per UDP socket, 64 KiB..=1 GiB. Default 8 MiB. Restart.
    pub udp_send_buffer: u64,
    /// FELIX_MTU_UPPER_BOUND: QUIC max MTU, 1200..=65507 (the broker clamps to 16384).
    /// Default 4096. Restart.
    pub mtu_upper_bound: u64,
    /// FELIX_BROKER_PUB_CONN_RECV_WINDOW: connection receive window, 64 KiB..=1 GiB.
    /// Default 32 MiB. Restart.
    pub broker_pub_conn_recv_window: u64,
    /// FELIX_BROKER_PUB_STREAM_RECV_WINDOW: per-stream receive window, 64 KiB..=1 GiB.
    /// Default 8 MiB. Restart.
    pub broker_pub_stream_recv_window: u64,
    /// FELIX_INGRESS_QUEUE_DEPTH: jobs per core, 1..=1048576. Default 512. Restart.
    pub ingress_queue_depth: u64,
    /// FELIX_INGRESS_BYTE_BUDGET: payload bytes per core, 0..=64 GiB. Default 64 MiB. Restart.
    pub ingress_byte_budget: u64,
    /// FELIX_PUB_INGRESS_WAIT: fire-and-forget waits instead of being shed. Default 0. Restart.
    pub pub_ingress_wait: bool,
    /// FELIX_ACK_ON_COMMIT: ack after commit (waits for ingress room). Default 0. Restart.
    pub ack_on_commit: bool,
    /// FELIX_PUBLISH_QUEUE_WAIT_MS: ack-on-commit ingress wait, 0..=600000. Default 2000.
    /// Restart.
    pub publish_queue_wait_ms: u64,
    /// FELIX_DURABLE_FSYNC_MODE: `periodic` or `on_commit`. Default periodic. Restart.
    pub durable_fsync_mode: String,
    /// FELIX_DURABLE_FSYNC_INTERVAL_MS: periodic fsync interval, 1..=3600000. Default 250.
    /// Restart.
    pub durable_fsync_interval_ms: u64,
    /// FELIX_STORAGE_IO_URING: io_uring writer (1) or pwrite (0). Default 1. Restart.
    pub storage_io_uring: bool,
    /// FELIX_STORAGE_DIRECT_IO: O_DIRECT log writes (1) or the page cache (0). Default 1.
    /// Restart.
    pub storage_direct_io: bool,
    /// FELIX_STORAGE_ROUNDS_IN_FLIGHT: write rounds in flight per durable log, 1..=2.
    /// Default 2. Restart.
    pub storage_rounds_in_flight: u64,
    /// FELIX_DURABLE_SEGMENT_BYTES: log segment size, 16KiB..=64GiB. Default 1GiB. Restart.
    pub durable_segment_bytes: u64,
    /// FELIX_DURABLE_RETENTION_BYTES: per-core log size bound, 0 = none. Default 0. Restart.
    pub durable_retention_bytes: u64,
    /// FELIX_DURABLE_RETENTION_SECONDS: age bound of log segments, 0 = none. Default 0.
    /// Restart.
    pub durable_retention_seconds: u64,
    /// FELIX_HOST_PROFILE: `azure`, `baremetal` or `test`. Default `baremetal`. Restart.
    pub host_profile: String,
    /// FELIX_DATA_NIC: the clients' network interface, or `auto` (the default route's).
    /// Default `auto`. Restart.
    pub data_nic: String,
    /// FELIX_AUTH: `off` (no credentials: principal `anonymous`) or `required`. Default `off`.
    /// Restart.
    pub auth: String,
    /// FELIX_CLIENT_CA: PEM CA(s) client certificates must chain to; unset: client
    /// certificates are not requested. Default unset. Restart.
    pub client_ca: Option<PathBuf>,
    /// FELIX_TOKENS_FILE: bearer-token hashes, lines `<id> <principal> <argon2 hash>`.
    /// Default unset. Re-read on SIGHUP.
    pub tokens_file: Option<PathBuf>,
    /// FELIX_RULES: authorization rules as text (`;` or newline separated; an array of
    /// strings in the file is joined one per line), parsed by the broker. Default empty (no
    /// rules: everything allowed). Restart.
    pub rules: String,
    /// FELIX_MAX_CONNECTIONS_PER_CORE: connections per data-plane core, 1..=1000000.
    /// Default 10000. Restart.
    pub max_connections_per_core: u32,
    /// FELIX_MAX_CONNECTIONS_PER_PRINCIPAL: connections per principal across all cores,
    /// 0..=1000000 (0 = no limit). Default 1024. Restart.
    pub max_connections_per_principal: u32,
    /// FELIX_MAX_STREAMS: streams in the catalogue, 1..=65536. Default 1024. Restart.
    pub max_streams: u32,
    /// FELIX_MAX_SHARDS_PER_STREAM: shards of one stream, 1..=4096. Default 1024. Restart.
    pub max_shards_per_stream: u32,
    /// FELIX_MAX_STREAMS_PER_CONNECTION: client-opened QUIC streams open at once, 1..=65536.
    /// Default 256. Restart.
    pub max_streams_per_connection: u32,
    /// FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION: open subscriptions per connection, 1..=65536.
    /// Default 64. Restart.
    pub max_subscriptions_per_connection: u32,
    /// FELIX_HELLO_TIMEOUT_MS: handshake deadline, 100..=600000. Default 10000. Restart.
    pub hello_timeout_ms: u64,
    /// FELIX_HELLO_MAX_BYTES: largest Hello body, 1 KiB..=1 MiB. Default 16 KiB. Restart.
    pub hello_max_bytes: u32,
    /// FELIX_IDLE_TIMEOUT_MS: QUIC idle timeout, 1000..=3600000. Default 30000. Restart.
    pub idle_timeout_ms: u64,
    /// FELIX_MAX_KEY_BYTES: largest record key, 0..=65535. Default 1024. Restart.
    pub max_key_bytes: u16,
    /// FELIX_MAX_PAYLOAD_BYTES: largest record payload, 1 KiB..=64 MiB and at most
    /// FELIX_MAX_FRAME_BYTES. Default 4 MiB. Restart.
    pub max_payload_bytes: u32,
    // ---- cluster ----
    /// FELIX_CLUSTER_NODE_ID: this broker's member id, 1..=65535; 0 = no cluster. Default 0.
    /// Restart.
    pub cluster_node_id: u16,
    /// FELIX_CLUSTER_PEERS: every member as `ID=IP:PORT`, this broker included; parsed by the
    /// broker. Default empty. Restart.
    pub cluster_peers: String,
    /// FELIX_CLUSTER_CA / FELIX_CLUSTER_CERT / FELIX_CLUSTER_KEY: the cluster CA and this
    /// broker's peer certificate and key (PEM). Default unset. Restart.
    pub cluster_ca: Option<PathBuf>,
    pub cluster_cert: Option<PathBuf>,
    pub cluster_key: Option<PathBuf>,
    /// FELIX_CLUSTER_RAFT_COMPACT_ENTRIES: applied entries a replicated shard's Raft log keeps
    /// before it compacts. Default 10,000. Restart.
    pub cluster_raft_compact_entries: u64,
    // ---- client / CLI ----
    /// FELIX_ADDR: broker address the CLI connects to. Default 127.0.0.1:7400.
    pub addr: SocketAddr,
    /// FELIX_SERVER_NAME: TLS server name the client verifies, non-empty. Default `localhost`.
    pub server_name: String,
    /// FELIX_CA: CA certificate (PEM) the client trusts. Default
    /// `<data_dir>/tls/dev-cert.pem` (the generated development certificate); see
    /// [`Config::ca_path`].
    pub ca: Option<PathBuf>,
    /// FELIX_INSECURE: skip server certificate verification (development only), 0/1/true/false.
    /// Default 0.
    pub insecure: bool,
    /// FELIX_PUBLISH_INFLIGHT_BYTES: client publish budget, 4 KiB..=4 GiB. Default 4 MiB.
    pub publish_inflight_bytes: u64,
    /// FELIX_PUB_SHARD_STREAMS: client publish streams per connection, 0..=64 (0 = pooled).
    /// Default 4.
    pub pub_shard_streams: u64,
    /// FELIX_TOKEN: bearer token sent in the Hello. Default unset. Never printed: `felix
    /// config`, `Debug` and error messages show `(hidden)`.
    pub token: Option<String>,
    /// FELIX_CLIENT_CERT / FELIX_CLIENT_KEY: PEM client certificate chain and key for mutual
    /// TLS, both set or both unset. Default unset (no client certificate).
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    // ---- bookkeeping ----
    /// Where each value above came from, for `felix config`.
    pub sources: Sources,
}

/// Why a configuration was refused. Every message names what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value its setting does not accept. For a secret setting `value` is `(hidden)`, and
    /// the message shows it unquoted, so neither Display nor Debug can leak the secret.
    #[error(
        "{env}={} (from {origin}) is invalid: expected {expected}",
        shown_value(env, value)
    )]
    Invalid {
        env: &'static str,
        value: String,
        origin: Source,
        expected: String,
    },
    /// A config-file value of a TOML type no setting takes (array, table, date-time).
    #[error(
        "{env} (key `{key}` in config file {}) is a TOML {found}: expected {expected}",
        path.display()
    )]
    FileValueType {
        env: &'static str,
        key: String,
        path: PathBuf,
        found: &'static str,
        expected: String,
    },
    #[error("unknown setting {name}; `felix config` lists the known ones")]
    UnknownEnv { name: String },
    #[error(
        "unknown setting {name} given as a command-line flag; `felix config` lists the known ones"
    )]
    UnknownFlag { name: String },
    #[error(
        "unknown key `{key}` in config file {}; keys are the FELIX_* names without FELIX_, \
         lowercased, and `felix config` lists the known ones",
        path.display()
    )]
    UnknownFileKey { key: String, path: PathBuf },
    #[error("cannot read config file {}: {error}", path.display())]
    ReadFile {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("config file {} is not valid TOML: {message}", path.display())]
    ParseFile { path: PathBuf, message: String },
    #[error(
        "{set} is set (from {origin}) but {missing} is not: set both (certificate chain and \
         its key) or neither (the broker then generates a development pair)"
    )]
    TlsPairIncomplete {
        set: &'static str,
        missing: &'static str,
        origin: Source,
    },
    #[error(
        "{set} is set (from {origin}) but {missing} is not: set both (client certificate \
         chain and its key) or neither (the client then presents no certificate)"
    )]
    ClientCertPairIncomplete {
        set: &'static str,
        missing: &'static str,
        origin: Source,
    },
    /// FELIX_MAX_PAYLOAD_BYTES above FELIX_MAX_FRAME_BYTES: no record that large could be sent.
    #[error(
        "FELIX_MAX_PAYLOAD_BYTES={} (from {payload_origin}) exceeds FELIX_MAX_FRAME_BYTES={} \
         (from {frame_origin}): a record must fit in one frame; raise FELIX_MAX_FRAME_BYTES or \
         lower FELIX_MAX_PAYLOAD_BYTES",
        values::format_size(u64::from(*payload)),
        values::format_size(u64::from(*frame))
    )]
    PayloadExceedsFrame {
        payload: u32,
        payload_origin: Source,
        frame: u32,
        frame_origin: Source,
    },
    /// FELIX_MAX_SHARDS_PER_STREAM too large for FELIX_MAX_FRAME_BYTES: the description of
    /// such a stream (22 bytes per shard) would not fit in one frame.
    #[error(
        "FELIX_MAX_SHARDS_PER_STREAM={shards} (from {shards_origin}) does not fit \
         FELIX_MAX_FRAME_BYTES={} (from {frame_origin}): describing a stream of {shards} shards \
         takes {needed} bytes in one frame; raise FELIX_MAX_FRAME_BYTES or lower \
         FELIX_MAX_SHARDS_PER_STREAM",
        values::format_size(u64::from(*frame))
    )]
    ShardsExceedFrame {
        shards: u32,
        shards_origin: Source,
        frame: u32,
        frame_origin: Source,
        needed: u64,
    },
    #[error("environment variable {name} is not valid UTF-8")]
    NotUnicode { name: String },
}

impl Config {
    /// Layers defaults < `file` (else the file named by FELIX_CONFIG in `env`; no file is
    /// fine) < FELIX_* variables of `env` < `flags`. Each flag is (variable name, raw value),
    /// so CLI flags map onto the same settings; a later flag wins over an earlier one.
    /// Variables of `env` outside FELIX_* are ignored except `XDG_DATA_HOME` and `HOME`, which
    /// give the default data directory.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &[(&str, String)],
    ) -> Result<Config, ConfigError> {
        let mut dirs = BaseDirs::default();
        let mut config_env = None;
        let mut felix_env = BTreeMap::new();
        for (name, value) in env {
            match name.as_str() {
                CONFIG_ENV => config_env = Some(value),
                "XDG_DATA_HOME" => dirs.xdg_data_home = Some(value),
                "HOME" => dirs.home = Some(value),
                _ if name.starts_with(ENV_PREFIX) => match setting_named(&name) {
                    Some(setting) => {
                        felix_env.insert(setting.env, value);
                    }
                    None => return Err(ConfigError::UnknownEnv { name }),
                },
                _ => {}
            }
        }
        if let Some((name, _)) = flags.iter().find(|(name, _)| setting_named(name).is_none()) {
            return Err(ConfigError::UnknownFlag {
                name: (*name).to_owned(),
            });
        }
        let file_path = match file {
            Some(path) => Some(path.to_path_buf()),
            None => config_env
                .filter(|path| !path.is_empty())
                .map(PathBuf::from),
        };
        let file = match file_path {
            Some(path) => Some(read_file(path)?),
            None => None,
        };
        let layers = Layers {
            dirs,
            file,
            env: felix_env,
            flags,
        };
        let config = settings::build(&layers)?;
        config.check_tls_pair()?;
        config.check_client_cert_pair()?;
        config.check_payload_fits_frame()?;
        config.check_shards_fit_frame()?;
        Ok(config)
    }

    /// [`Config::load`] with this process's environment.
    pub fn from_process(
        file: Option<&Path>,
        flags: &[(&str, String)],
    ) -> Result<Config, ConfigError> {
        let mut env = Vec::new();
        // vars_os, not vars: std::env::vars panics on a non-UTF-8 variable, and variables
        // Felix does not read may hold any bytes.
        for (name, value) in std::env::vars_os() {
            let Ok(name) = name.into_string() else {
                continue;
            };
            match value.into_string() {
                Ok(value) => env.push((name, value)),
                Err(_)
                    if name.starts_with(ENV_PREFIX)
                        || name == "HOME"
                        || name == "XDG_DATA_HOME" =>
                {
                    return Err(ConfigError::NotUnicode { name });
                }
                Err(_) => {}
            }
        }
        Self::load(file, env, flags)
    }

    /// Every setting in table order, with its effective value rendered as it would be written
    /// in the environment (empty: unset; a set secret: `(hidden)`) and where it came from.
    pub fn entries(&self) -> Vec<Entry> {
        settings::render_values(self)
            .into_iter()
            .map(|(env, value)| Entry {
                env,
                value,
                source: self.sources.of(env),
            })
            .collect()
    }

    /// The text of `felix config`: one aligned `NAME  VALUE  SOURCE` line per setting.
    pub fn render_table(&self) -> String {
        let mut rows = vec![["NAME".to_owned(), "VALUE".to_owned(), "SOURCE".to_owned()]];
        rows.extend(self.entries().into_iter().map(|entry| {
            let value = if entry.value.is_empty() {
                "(unset)".to_owned()
            } else {
                one_line(&entry.value)
            };
            [entry.env.to_owned(), value, entry.source.to_string()]
        }));
        let name_width = rows
            .iter()
            .map(|row| row[0].chars().count())
            .max()
            .unwrap_or(0);
        let value_width = rows
            .iter()
            .map(|row| row[1].chars().count())
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        for [name, value, source] in rows {
            out.push_str(&format!(
                "{name:<name_width$}  {value:<value_width$}  {source}\n"
            ));
        }
        out
    }

    /// The CA certificate the client trusts: FELIX_CA, else the development certificate.
    pub fn ca_path(&self) -> PathBuf {
        self.ca.clone().unwrap_or_else(|| self.dev_cert_path())
    }

    /// `<data_dir>/tls/dev-cert.pem`: where the broker writes its development certificate.
    pub fn dev_cert_path(&self) -> PathBuf {
        self.data_dir.join(DEV_TLS_DIR).join(DEV_CERT_FILE)
    }

    /// `<data_dir>/tls/dev-key.pem`: where the broker writes its development key.
    pub fn dev_key_path(&self) -> PathBuf {
        self.data_dir.join(DEV_TLS_DIR).join(DEV_KEY_FILE)
    }

    /// One line saying who may do what, for the end of `felix config` and the broker's
    /// start-up log. Rules are only counted here; the broker parses them.
    pub fn auth_summary(&self) -> String {
        let rules = rule_count(&self.rules);
        if self.auth == "off"
            && self.client_ca.is_none()
            && self.tokens_file.is_none()
            && rules == 0
        {
            return "auth: off (no client certificate CA, no tokens file, no rules): any client \
                    that reaches the broker may create, delete, publish to and read every stream"
                .to_owned();
        }
        let certificates = self
            .client_ca
            .as_ref()
            .map_or_else(|| "not requested".to_owned(), |ca| ca.display().to_string());
        let tokens = self
            .tokens_file
            .as_ref()
            .map_or_else(|| "none".to_owned(), |file| file.display().to_string());
        let rules = match rules {
            0 => "none (every principal may do everything)".to_owned(),
            1 => "1 rule".to_owned(),
            n => format!("{n} rules"),
        };
        format!(
            "auth: {}, client certificates: {certificates}, tokens: {tokens}, rules: {rules}",
            self.auth
        )
    }

    fn check_tls_pair(&self) -> Result<(), ConfigError> {
        let cert = settings::by_field::tls_cert.env;
        let key = settings::by_field::tls_key.env;
        let (set, missing) = match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => (cert, key),
            (None, Some(_)) => (key, cert),
            _ => return Ok(()),
        };
        Err(ConfigError::TlsPairIncomplete {
            set,
            missing,
            origin: self.sources.of(set),
        })
    }

    fn check_client_cert_pair(&self) -> Result<(), ConfigError> {
        let cert = settings::by_field::client_cert.env;
        let key = settings::by_field::client_key.env;
        let (set, missing) = match (&self.client_cert, &self.client_key) {
            (Some(_), None) => (cert, key),
            (None, Some(_)) => (key, cert),
            _ => return Ok(()),
        };
        Err(ConfigError::ClientCertPairIncomplete {
            set,
            missing,
            origin: self.sources.of(set),
        })
    }

    fn check_shards_fit_frame(&self) -> Result<(), ConfigError> {
        let needed = stream_info_bytes_max(self.max_shards_per_stream);
        if needed <= u64::from(self.max_frame_bytes) {
            return Ok(());
        }
        Err(ConfigError::ShardsExceedFrame {
            shards: self.max_shards_per_stream,
            shards_origin: self
                .sources
                .of(settings::by_field::max_shards_per_stream.env),
            frame: self.max_frame_bytes,
            frame_origin: self.sources.of(settings::by_field::max_frame_bytes.env),
            needed,
        })
    }

    fn check_payload_fits_frame(&self) -> Result<(), ConfigError> {
        if self.max_payload_bytes <= self.max_frame_bytes {
            return Ok(());
        }
        Err(ConfigError::PayloadExceedsFrame {
            payload: self.max_payload_bytes,
            payload_origin: self.sources.of(settings::by_field::max_payload_bytes.env),
            frame: self.max_frame_bytes,
            frame_origin: self.sources.of(settings::by_field::max_frame_bytes.env),
        })
    }
}

/// The rules in FELIX_RULES text: its `;`- or newline-separated parts that are neither blank
/// nor `#` comments. A count for [`Config::auth_summary`], not a parse.
fn rule_count(rules: &str) -> usize {
    rules
        .split([';', '\n'])
        .map(str::trim)
        .filter(|part| !part.is_empty() && !part.starts_with('#'))
        .count()
}

/// `value` on one line of `felix config`: line breaks and tabs (a multi-line FELIX_RULES from
/// the file) written as `\n`, `\r`, `\t`.
fn one_line(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

/// How an invalid value appears in its error message: quoted, or `(hidden)` for a secret.
fn shown_value(env: &str, value: &str) -> String {
    match setting_named(env) {
        Some(setting) if setting.kind.is_secret() => values::HIDDEN.to_owned(),
        _ => format!("{value:?}"),
    }
}

/// The configuration reference (a Markdown table, one row per setting), generated from the
/// settings table. docs/configuration.md embeds it verbatim; a test keeps the two equal.
pub fn reference_markdown() -> String {
    let mut out = String::from(
        "<!-- Generated by felix_tuning::reference_markdown() from tuning/src/settings.rs; \
         edit the table there, not this text. -->\n\
         | Variable | File key | Default | Accepted | Restart needed | Description |\n\
         |---|---|---|---|---|---|\n",
    );
    for setting in SETTINGS {
        let default = match setting.default {
            DefaultValue::Fixed("") => "unset".to_owned(),
            DefaultValue::Fixed(raw) => format!("`{raw}`"),
            DefaultValue::Derived { doc, .. } => doc.to_owned(),
        };
        let restart = match setting.restart {
            Restart::Broker => "yes",
            Restart::PerCommand => "no, read by each command",
            Restart::Sighup => "no: re-read on SIGHUP",
        };
        let cells = [
            format!("`{}`", setting.env),
            format!("`{}`", setting.file_key()),
            default,
            setting.kind.accepts(),
            restart.to_owned(),
            setting.doc.to_owned(),
        ];
        let cells: Vec<String> = cells.iter().map(|cell| cell.replace('|', "\\|")).collect();
        out.push_str(&format!("| {} |\n", cells.join(" | ")));
    }
    out
}

/// A byte size written as the size settings accept it (`67108864`, `64MiB`, `64 MiB`), in bytes;
/// `None` for anything else. Public so that text written in that syntax elsewhere (the docs'
/// stated defaults, checked by tests/doc_defaults.rs) is read by the same parser.
#[must_use]
pub fn parse_byte_size(text: &str) -> Option<u64> {
    values::parse_size(text)
}

/// The setting whose variable is `name`.
fn setting_named(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|setting| setting.env == name)
}

/// The values a config file gives, by variable name.
#[derive(Debug)]
struct FileValues {
    path: PathBuf,
    values: BTreeMap<&'static str, String>,
}

fn read_file(path: PathBuf) -> Result<FileValues, ConfigError> {
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) => return Err(ConfigError::ReadFile { path, error }),
    };
    let table = match text.parse::<toml::Table>() {
        Ok(table) => table,
        Err(error) => {
            return Err(ConfigError::ParseFile {
                path,
                message: error.to_string(),
            });
        }
    };
    let mut values = BTreeMap::new();
    for (key, value) in table {
        let Some(setting) = SETTINGS.iter().find(|setting| setting.file_key() == key) else {
            return Err(ConfigError::UnknownFileKey { key, path });
        };
        // Scalars become the text they would have in the environment; `64MiB` has to be a
        // TOML string, 67108864 may be an integer, `insecure = true` a boolean. A text list
        // (FELIX_RULES) may also be an array of strings, joined one per line.
        let raw = match value {
            toml::Value::String(text) => text,
            toml::Value::Integer(number) => number.to_string(),
            toml::Value::Float(number) => number.to_string(),
            toml::Value::Boolean(flag) => flag.to_string(),
            toml::Value::Array(items) if matches!(setting.kind, Kind::TextList { .. }) => {
                let mut parts = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        toml::Value::String(text) => parts.push(text),
                        other => {
                            return Err(ConfigError::FileValueType {
                                env: setting.env,
                                key,
                                path,
                                found: array_element_type(&other),
                                expected: file_expected(setting),
                            });
                        }
                    }
                }
                // One rule per line: a `#` comment in one element ends with its line, so it
                // cannot swallow the rules of the elements after it.
                parts.join("\n")
            }
            other => {
                return Err(ConfigError::FileValueType {
                    env: setting.env,
                    key,
                    path,
                    found: other.type_str(),
                    expected: file_expected(setting),
                });
            }
        };
        values.insert(setting.env, raw);
    }
    Ok(FileValues { path, values })
}

/// What a config-file value of `setting` may be, for a FileValueType message.
fn file_expected(setting: &Setting) -> String {
    match setting.kind {
        Kind::TextList { .. } => format!(
            "{} (a TOML string or an array of strings)",
            setting.expected()
        ),
        _ => setting.expected(),
    }
}

/// The `found` of a FileValueType message for an array with a non-string element.
fn array_element_type(element: &toml::Value) -> &'static str {
    match element {
        toml::Value::String(_) => "array of strings",
        toml::Value::Integer(_) => "array with an integer element",
        toml::Value::Float(_) => "array with a float element",
        toml::Value::Boolean(_) => "array with a boolean element",
        toml::Value::Datetime(_) => "array with a datetime element",
        toml::Value::Array(_) => "array with an array element",
        toml::Value::Table(_) => "array with a table element",
    }
}

/// The layers a value can come from, lowest first: default, file, environment, flags.
struct Layers<'a> {
    dirs: BaseDirs,
    file: Option<FileValues>,
    env: BTreeMap<&'static str, String>,
    flags: &'a [(&'a str, String)],
}

impl Layers<'_> {
    /// The typed value of `setting` from the highest layer that sets it; records its source.
    fn resolve<T: FieldValue>(
        &self,
        setting: &Setting,
        sources: &mut Sources,
    ) -> Result<T, ConfigError> {
        let (raw, source) = self.raw(setting);
        let Some(value) = T::parse(setting.kind, &raw) else {
            // A secret never enters the error, so neither its Display nor its Debug shows it.
            let value = if setting.kind.is_secret() {
                values::HIDDEN.to_owned()
            } else {
                raw
            };
            return Err(ConfigError::Invalid {
                env: setting.env,
                value,
                origin: source,
                expected: setting.expected(),
            });
        };
        sources.0.insert(setting.env, source);
        Ok(value)
    }

    fn raw(&self, setting: &Setting) -> (String, Source) {
        if let Some((_, raw)) = self
            .flags
            .iter()
            .rev()
            .find(|(name, _)| *name == setting.env)
        {
            return (raw.clone(), Source::Flag);
        }
        if let Some(raw) = self.env.get(setting.env) {
            return (raw.clone(), Source::Env(setting.env.to_owned()));
        }
        if let Some(file) = &self.file
            && let Some(raw) = file.values.get(setting.env)
        {
            return (raw.clone(), Source::File(file.path.clone()));
        }
        let raw = match setting.default {
            DefaultValue::Fixed(raw) => raw.to_owned(),
            DefaultValue::Derived { compute, .. } => compute(&self.dirs),
        };
        (raw, Source::Default)
    }
}

#[cfg(test)]
mod tests;

/// The largest `StreamInfo` body of a stream of `shards` shards (docs/wire-protocol.md 4.6):
/// 16 fixed bytes, a name of at most 255 bytes, 22 bytes per shard. The frame carrying the
/// most per-shard bytes, so every per-shard answer fits when it does.
#[must_use]
pub fn stream_info_bytes_max(shards: u32) -> u64 {
    16 + 255 + 22 * u64::from(shards)
}
