//! THE table of settings. Parsing, validation, `felix config` (`Config::entries`) and the
//! reference in docs/configuration.md all read it, so a new setting is one entry in the
//! `settings!` invocation below (plus its field in `Config`; the compiler refuses a field
//! without an entry and an entry without a field).

use crate::values::{FieldValue, GIB, KIB, Kind, MIB, TIB};
use crate::{Config, ConfigError, Layers, Sources};

// ---- bounds (inclusive) ----
// These catch mistakes (wrong unit, extra digits) rather than tune anything: each is far from
// where a sane deployment sits, and the reason is given so a change can be argued with.

/// No machine Felix targets has 1 TiB of memory for one shard's ring.
const REPLAY_RING_MAX_BYTES_MAX: u64 = TIB;
/// 2^24 records per shard, times tens of shards, is far beyond any replay window.
const REPLAY_RING_MAX_RECORDS_MAX: u64 = 1 << 24;
/// Below 64 KiB a frame could not carry an ordinary batch plus its headers.
const MAX_FRAME_BYTES_MIN: u64 = 64 * KIB;
/// A connection may buffer one whole frame: 64 MiB bounds that per-connection memory.
const MAX_FRAME_BYTES_MAX: u64 = 64 * MIB;
/// A batch holds at least one record.
const MAX_BATCH_RECORDS_MIN: u64 = 1;
/// 2^16 records is 1024 times the reference fast path (batches of 64).
const MAX_BATCH_RECORDS_MAX: u64 = 1 << 16;
/// A subscription's backlog must hold at least one frame of the smallest allowed size.
const SUBSCRIBER_QUEUE_MAX_BYTES_MIN: u64 = MAX_FRAME_BYTES_MIN;
/// 16 GiB for one subscription's live backlog exceeds any broker's memory budget.
const SUBSCRIBER_QUEUE_MAX_BYTES_MAX: u64 = 16 * GIB;
/// One page: less could not keep even one small publish in flight.
const PUBLISH_INFLIGHT_BYTES_MIN: u64 = 4 * KIB;
/// More than 4 GiB in flight from one client would only queue inside the broker.
const PUBLISH_INFLIGHT_BYTES_MAX: u64 = 4 * GIB;

/// 64 KiB: below this a loaded core drops datagrams during any scheduling hiccup.
const UDP_BUFFER_MIN: u64 = 64 * KIB;
/// 1 GiB of kernel socket buffer per socket is far beyond any useful burst.
const UDP_BUFFER_MAX: u64 = GIB;
/// QUIC requires every path to carry 1200-byte datagrams (RFC 9000 section 14).
const MTU_UPPER_BOUND_MIN: u64 = 1200;
/// The largest UDP payload an IPv4 datagram can carry; the broker clamps further (16384).
const MTU_UPPER_BOUND_MAX: u64 = 65_507;
/// A receive window below 64 KiB cannot hold one ordinary publish batch.
const RECV_WINDOW_MIN: u64 = 64 * KIB;
/// 1 GiB of flow-control credit per connection exceeds any broker's memory budget.
const RECV_WINDOW_MAX: u64 = GIB;
/// 64 publish streams per connection is 16 times the default; more only costs state.
const PUB_SHARD_STREAMS_MAX: u64 = 64;
/// The ingress queue holds at least one job.
const INGRESS_QUEUE_DEPTH_MIN: u64 = 1;
/// 2^20 jobs per core is far beyond what the byte budget lets queue usefully.
const INGRESS_QUEUE_DEPTH_MAX: u64 = 1 << 20;
/// 64 GiB of queued payload per core exceeds any broker's memory.
const INGRESS_BYTE_BUDGET_MAX: u64 = 64 * GIB;
/// Ten minutes: a publish waiting longer than that is surely a stuck broker.
const PUBLISH_QUEUE_WAIT_MS_MAX: u64 = 600_000;
/// One hour between fsyncs already risks an hour of data on power loss; more is a typo.
const DURABLE_FSYNC_INTERVAL_MS_MAX: u64 = 3_600_000;
/// `felix_storage::ROUNDS_IN_FLIGHT_MAX` (this crate does not depend on the storage crate).
const STORAGE_ROUNDS_IN_FLIGHT_MAX: u64 = 2;
/// The storage crate's segment bounds (felix_storage::SEGMENT_BYTES_MIN / SEGMENT_BYTES_MAX):
/// 16 KiB holds a few records (tests), 64 GiB keeps one deleted segment a bounded amount.
const DURABLE_SEGMENT_BYTES_MIN: u64 = 16 * KIB;
const DURABLE_SEGMENT_BYTES_MAX: u64 = 64 * GIB;
/// 1 PiB of log per core is beyond any disk we run on.
const DURABLE_RETENTION_BYTES_MAX: u64 = 1024 * TIB;
/// Ten years of retention by age.
const DURABLE_RETENTION_SECONDS_MAX: u64 = 10 * 366 * 24 * 3600;
/// The fsync modes of docs/semantics.md, 3 Publishing.
const FSYNC_MODES: &[&str] = &["periodic", "on_commit"];
/// Member ids fit the broker's u16 node numbering; 0 means no cluster.
const CLUSTER_NODE_ID_MAX: u64 = 65_535;
/// The host profiles of `felix tune` and `felix preflight` (felix_tuning::host::Profile).
const HOST_PROFILES: &[&str] = &["azure", "baremetal", "test"];
/// The authentication modes of docs/security.md: `off` admits clients without credentials.
const AUTH_MODES: &[&str] = &["off", "required"];

/// A core that admits no connection serves nothing.
const MAX_CONNECTIONS_PER_CORE_MIN: u64 = 1;
/// A million connections' QUIC and stream buffers exceed one core's share of any machine.
const MAX_CONNECTIONS_PER_CORE_MAX: u64 = 1_000_000;
/// As many as one core may hold: more for a single identity is a typo (0 means no limit).
const MAX_CONNECTIONS_PER_PRINCIPAL_MAX: u64 = MAX_CONNECTIONS_PER_CORE_MAX;
/// A broker that may hold no stream is of no use.
const MAX_STREAMS_MIN: u64 = 1;
/// The protocol's StreamList bound (felix_wire::LISTED_STREAMS_MAX): more could not be listed.
const MAX_STREAMS_MAX: u64 = 65_536;
/// A stream has at least one shard.
const MAX_SHARDS_PER_STREAM_MIN: u64 = 1;
/// The protocol's bound on shards per stream (every per-shard list in a frame).
const MAX_SHARDS_PER_STREAM_MAX: u64 = 4096;
/// A connection needs at least its request stream.
const MAX_STREAMS_PER_CONNECTION_MIN: u64 = 1;
/// 2^16 open streams is 256 times the default; each one holds buffers.
const MAX_STREAMS_PER_CONNECTION_MAX: u64 = 1 << 16;
/// A connection may subscribe at least once.
const MAX_SUBSCRIPTIONS_PER_CONNECTION_MIN: u64 = 1;
/// 2^16 is 1024 times the default: each holds a backlog, so more would bound no memory.
const MAX_SUBSCRIPTIONS_PER_CONNECTION_MAX: u64 = 1 << 16;
/// Below 100 ms a handshake across a wide-area round trip or two cannot finish.
const HELLO_TIMEOUT_MS_MIN: u64 = 100;
/// Ten minutes to complete a handshake is surely a stuck or hostile client.
const HELLO_TIMEOUT_MS_MAX: u64 = 600_000;
/// 1 KiB holds a Hello with a short client name and a Felix token (87 bytes).
const HELLO_MAX_BYTES_MIN: u64 = KIB;
/// More than 1 MiB read per connection before authentication hands memory to anyone.
const HELLO_MAX_BYTES_MAX: u64 = MIB;
/// Below one second a connection could time out between keep-alives.
const IDLE_TIMEOUT_MS_MIN: u64 = 1000;
/// An hour: holding a silent connection longer only pins its state.
const IDLE_TIMEOUT_MS_MAX: u64 = 3_600_000;
/// The protocol encodes a record key's length as a u16.
const MAX_KEY_BYTES_MAX: u64 = u16::MAX as u64;
/// A cap below 1 KiB would refuse ordinary small records.
const MAX_PAYLOAD_BYTES_MIN: u64 = KIB;
/// A record must fit in one frame, and no frame may exceed MAX_FRAME_BYTES_MAX.
const MAX_PAYLOAD_BYTES_MAX: u64 = MAX_FRAME_BYTES_MAX;

// The u32 fields must be able to hold their whole accepted range.
const _: () = assert!(MAX_FRAME_BYTES_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_BATCH_RECORDS_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_FRAME_BYTES_MIN <= MAX_FRAME_BYTES_MAX);
const _: () = assert!(SUBSCRIBER_QUEUE_MAX_BYTES_MIN >= MAX_FRAME_BYTES_MIN);
const _: () = assert!(MAX_CONNECTIONS_PER_CORE_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_CONNECTIONS_PER_PRINCIPAL_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_STREAMS_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_SHARDS_PER_STREAM_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_STREAMS_PER_CONNECTION_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_SUBSCRIPTIONS_PER_CONNECTION_MAX <= u32::MAX as u64);
const _: () = assert!(HELLO_MAX_BYTES_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_PAYLOAD_BYTES_MAX <= u32::MAX as u64);
const _: () = assert!(MAX_KEY_BYTES_MAX <= u16::MAX as u64);
const _: () = assert!(MAX_PAYLOAD_BYTES_MAX <= MAX_FRAME_BYTES_MAX);

/// One setting's description; the field it fills is bound by the `settings!` macro.
#[derive(Debug)]
pub(crate) struct Setting {
    /// Environment variable name; the file key and flag name derive from it.
    pub(crate) env: &'static str,
    pub(crate) kind: Kind,
    pub(crate) default: DefaultValue,
    pub(crate) restart: Restart,
    /// One or two sentences for the reference.
    pub(crate) doc: &'static str,
}

impl Setting {
    /// The key in the config file: the variable name without `FELIX_`, lowercased.
    pub(crate) fn file_key(&self) -> String {
        self.env
            .strip_prefix(crate::ENV_PREFIX)
            .unwrap_or(self.env)
            .to_ascii_lowercase()
    }

    /// The tail of an invalid-value message: what is accepted, with examples.
    pub(crate) fn expected(&self) -> String {
        let accepts = self.kind.accepts();
        let examples = match self.default {
            DefaultValue::Fixed(raw) => self.kind.examples(raw),
            DefaultValue::Derived { .. } => None,
        };
        match examples {
            Some(examples) => format!("{accepts}, such as {examples}"),
            None => accepts,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum DefaultValue {
    /// Raw text parsed by the setting's kind like any other value; empty means unset.
    Fixed(&'static str),
    /// Computed from the environment given to `Config::load`; `doc` says how.
    Derived {
        compute: fn(&BaseDirs) -> String,
        doc: &'static str,
    },
}

/// When a changed value takes effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Restart {
    /// Read once when the broker starts: restart it to apply a change.
    Broker,
    /// Read by each `felix` client command: the next command uses the new value.
    PerCommand,
    /// Read at start-up and again whenever the broker receives SIGHUP; no restart needed.
    Sighup,
}

/// The environment variables the derived defaults look at.
#[derive(Debug, Default)]
pub(crate) struct BaseDirs {
    pub(crate) xdg_data_home: Option<String>,
    pub(crate) home: Option<String>,
}

/// `$XDG_DATA_HOME/felix`, else `$HOME/.local/share/felix`, else `./felix-data`. The XDG
/// base-directory spec says to ignore an empty or relative `XDG_DATA_HOME`.
fn default_data_dir(dirs: &BaseDirs) -> String {
    if let Some(xdg) = dirs
        .xdg_data_home
        .as_deref()
        .filter(|xdg| xdg.starts_with('/'))
    {
        return format!("{}/felix", xdg.trim_end_matches('/'));
    }
    if let Some(home) = dirs.home.as_deref().filter(|home| !home.is_empty()) {
        return format!("{}/.local/share/felix", home.trim_end_matches('/'));
    }
    "./felix-data".to_owned()
}

macro_rules! settings {
    (@render $config:ident, $field:ident) => {
        FieldValue::render(&$config.$field, by_field::$field.kind)
    };
    (@render $config:ident, $field:ident, $render:expr) => {
        ($render)($config)
    };
    ($(
        $field:ident {
            env: $env:literal,
            kind: $kind:expr,
            default: $default:expr,
            restart: $restart:expr,
            doc: $doc:literal,
            $(render: $render:expr,)?
        }
    )*) => {
        /// One constant per setting, named after the `Config` field it fills.
        #[allow(non_upper_case_globals)]
        pub(crate) mod by_field {
            use super::*;
            $(
                pub(crate) const $field: Setting = Setting {
                    env: $env,
                    kind: $kind,
                    default: $default,
                    restart: $restart,
                    doc: $doc,
                };
            )*
        }

        /// Every setting, in `felix config` and reference order.
        pub(crate) static SETTINGS: &[Setting] = &[$(by_field::$field),*];

        /// Resolves every field through the layers, recording where each value came from.
        pub(crate) fn build(layers: &Layers<'_>) -> Result<Config, ConfigError> {
            let mut sources = Sources::default();
            $( let $field = layers.resolve(&by_field::$field, &mut sources)?; )*
            Ok(Config { $($field,)* sources })
        }

        /// Every setting's effective value as it would be written in the environment
        /// (secrets as `(hidden)`).
        pub(crate) fn render_values(config: &Config) -> Vec<(&'static str, String)> {
            vec![$( (by_field::$field.env, settings!(@render config, $field $(, $render)?)) ),*]
        }

        /// Every field, secrets shown as `(hidden)` or `(unset)`, so that no `{:?}` of a
        /// `Config` (a log line, a panic message) can leak one.
        impl std::fmt::Debug for Config {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let mut out = f.debug_struct("Config");
                $(
                    if by_field::$field.kind.is_secret() {
                        let shown = FieldValue::render(&self.$field, by_field::$field.kind);
                        let shown = if shown.is_empty() { "(unset)".to_owned() } else { shown };
                        out.field(stringify!($field), &format_args!("{shown}"));
                    } else {
                        out.field(stringify!($field), &self.$field);
                    }
                )*
                out.field("sources", &self.sources).finish()
            }
        }
    };
}

use DefaultValue::{Derived, Fixed};

settings! {
    // ---- broker ----
    bind {
        env: "FELIX_BIND",
        kind: Kind::Addr,
        default: Fixed("127.0.0.1:7400"),
        restart: Restart::Broker,
        doc: "QUIC (UDP) address the broker listens on.",
    }
    metrics_bind {
        env: "FELIX_METRICS_BIND",
        kind: Kind::AddrOrOff,
        default: Fixed("127.0.0.1:9400"),
        restart: Restart::Broker,
        doc: "HTTP address of the Prometheus `/metrics` endpoint, or `off` for none.",
    }
    data_dir {
        env: "FELIX_DATA_DIR",
        kind: Kind::Path,
        default: Derived {
            compute: default_data_dir,
            doc: "`$XDG_DATA_HOME/felix`, else `$HOME/.local/share/felix`, else `./felix-data`",
        },
        restart: Restart::Broker,
        doc: "Data directory: durable stream logs and the development TLS pair (`tls/`). \
              The CLI reads it to find the development certificate.",
    }
    tls_cert {
        env: "FELIX_TLS_CERT",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "PEM certificate chain the broker presents. Set together with FELIX_TLS_KEY, or \
              leave both unset and the broker generates (once) a development pair under \
              `<data_dir>/tls/`.",
    }
    tls_key {
        env: "FELIX_TLS_KEY",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "PEM private key of FELIX_TLS_CERT. Set both or neither.",
    }
    replay_ring_max_bytes {
        env: "FELIX_REPLAY_RING_MAX_BYTES",
        kind: Kind::Size { min: 0, max: REPLAY_RING_MAX_BYTES_MAX },
        default: Fixed("64MiB"),
        restart: Restart::Broker,
        doc: "Per-shard bound of an in-memory stream's replay ring, in bytes of the \
              received frames its records keep alive, each counted once (docs/semantics.md); \
              the oldest records leave first.",
    }
    replay_ring_max_records {
        env: "FELIX_REPLAY_RING_MAX_RECORDS",
        kind: Kind::Count { min: 0, max: REPLAY_RING_MAX_RECORDS_MAX },
        default: Fixed("1024"),
        restart: Restart::Broker,
        doc: "Per-shard bound of an in-memory stream's replay ring, in records.",
    }
    max_frame_bytes {
        env: "FELIX_MAX_FRAME_BYTES",
        kind: Kind::Size { min: MAX_FRAME_BYTES_MIN, max: MAX_FRAME_BYTES_MAX },
        default: Fixed("16MiB"),
        restart: Restart::Broker,
        doc: "Largest frame body on a connection, in bytes.",
    }
    max_batch_records {
        env: "FELIX_MAX_BATCH_RECORDS",
        kind: Kind::Count { min: MAX_BATCH_RECORDS_MIN, max: MAX_BATCH_RECORDS_MAX },
        default: Fixed("4096"),
        restart: Restart::Broker,
        doc: "Most records in one publish batch.",
    }
    subscriber_queue_max_bytes {
        env: "FELIX_SUBSCRIBER_QUEUE_MAX_BYTES",
        kind: Kind::Size {
            min: SUBSCRIBER_QUEUE_MAX_BYTES_MIN,
            max: SUBSCRIBER_QUEUE_MAX_BYTES_MAX,
        },
        default: Fixed("64MiB"),
        restart: Restart::Broker,
        doc: "Live backlog the broker holds for one subscription, in payload bytes.",
    }
    log {
        env: "FELIX_LOG",
        kind: Kind::Text { what: "a non-empty tracing filter" },
        default: Fixed("info"),
        restart: Restart::Broker,
        doc: "Log filter (tracing `EnvFilter` syntax, e.g. `info,felix_broker=debug`), for \
              the broker and the CLI.",
    }
    dataplane_cores {
        env: "FELIX_DATAPLANE_CORES",
        kind: Kind::Text { what: "auto, a core count (e.g. 2) or a CPU list (e.g. 0,2-3)" },
        default: Fixed("auto"),
        restart: Restart::Broker,
        doc: "Data-plane cores: `auto` (every usable CPU below 4 CPUs, else all but one kept \
              for housekeeping), a count, or a CPU list (`3-3` for the single CPU 3). Each \
              core is one pinned thread owning shards `s % cores`.",
    }
    quic_listeners {
        env: "FELIX_QUIC_LISTENERS",
        kind: Kind::Text { what: "auto or a whole number of endpoints (at least 1)" },
        default: Fixed("auto"),
        restart: Restart::Broker,
        doc: "QUIC endpoints on the shared port (SO_REUSEPORT group), spread over the \
              data-plane cores: `auto` is one per core. Each core also has its own port \
              (base + 1 + core index).",
    }
    udp_recv_buffer {
        env: "FELIX_UDP_RECV_BUFFER",
        kind: Kind::Size { min: UDP_BUFFER_MIN, max: UDP_BUFFER_MAX },
        default: Fixed("8MiB"),
        restart: Restart::Broker,
        doc: "SO_RCVBUF of every broker UDP socket. Above net.core.rmem_max the broker uses \
              SO_RCVBUFFORCE when root; the effective size is logged at start-up.",
    }
    udp_send_buffer {
        env: "FELIX_UDP_SEND_BUFFER",
        kind: Kind::Size { min: UDP_BUFFER_MIN, max: UDP_BUFFER_MAX },
        default: Fixed("8MiB"),
        restart: Restart::Broker,
        doc: "SO_SNDBUF of every broker UDP socket (SO_SNDBUFFORCE above net.core.wmem_max \
              when root); the effective size is logged at start-up.",
    }
    mtu_upper_bound {
        env: "FELIX_MTU_UPPER_BOUND",
        kind: Kind::Count { min: MTU_UPPER_BOUND_MIN, max: MTU_UPPER_BOUND_MAX },
        default: Fixed("4096"),
        restart: Restart::Broker,
        doc: "Largest QUIC datagram the broker probes for (path MTU discovery upper bound), \
              on its client endpoints and, in a cluster, its peer endpoints. Values above 16384 are clamped to 16384 with a warning: s2n-quic corrupts \
              memory with GSO above 32768.",
    }
    broker_pub_conn_recv_window {
        env: "FELIX_BROKER_PUB_CONN_RECV_WINDOW",
        kind: Kind::Size { min: RECV_WINDOW_MIN, max: RECV_WINDOW_MAX },
        default: Fixed("32MiB"),
        restart: Restart::Broker,
        doc: "QUIC connection-level receive window the broker grants each client (flow \
              control over all its streams).",
    }
    broker_pub_stream_recv_window {
        env: "FELIX_BROKER_PUB_STREAM_RECV_WINDOW",
        kind: Kind::Size { min: RECV_WINDOW_MIN, max: RECV_WINDOW_MAX },
        default: Fixed("8MiB"),
        restart: Restart::Broker,
        doc: "QUIC receive window the broker grants each client-opened stream.",
    }
    ingress_queue_depth {
        env: "FELIX_INGRESS_QUEUE_DEPTH",
        kind: Kind::Count { min: INGRESS_QUEUE_DEPTH_MIN, max: INGRESS_QUEUE_DEPTH_MAX },
        default: Fixed("512"),
        restart: Restart::Broker,
        doc: "Publish jobs one data-plane core holds from admission until they complete; \
              when full, publishes are shed, wait or are refused (see docs/operations.md).",
    }
    ingress_byte_budget {
        env: "FELIX_INGRESS_BYTE_BUDGET",
        kind: Kind::Size { min: 0, max: INGRESS_BYTE_BUDGET_MAX },
        default: Fixed("64MiB"),
        restart: Restart::Broker,
        doc: "Payload bytes of the publish jobs one data-plane core holds; a single larger \
              job is admitted only when the queue is empty.",
    }
    pub_ingress_wait {
        env: "FELIX_PUB_INGRESS_WAIT",
        kind: Kind::Bool,
        default: Fixed("0"),
        restart: Restart::Broker,
        doc: "When the ingress queue is full, fire-and-forget publishes wait for room \
              instead of being shed (and counted).",
    }
    ack_on_commit {
        env: "FELIX_ACK_ON_COMMIT",
        kind: Kind::Bool,
        default: Fixed("0"),
        restart: Restart::Broker,
        doc: "Ack after the write is committed; such acked publishes wait up to \
              FELIX_PUBLISH_QUEUE_WAIT_MS for ingress room instead of being refused at once.",
    }
    publish_queue_wait_ms {
        env: "FELIX_PUBLISH_QUEUE_WAIT_MS",
        kind: Kind::Count { min: 0, max: PUBLISH_QUEUE_WAIT_MS_MAX },
        default: Fixed("2000"),
        restart: Restart::Broker,
        doc: "Milliseconds an ack-on-commit publish waits for ingress room before it is \
              refused with `publish ingress byte budget exhausted`.",
    }
    durable_fsync_mode {
        env: "FELIX_DURABLE_FSYNC_MODE",
        kind: Kind::Choice { options: FSYNC_MODES },
        default: Fixed("periodic"),
        restart: Restart::Broker,
        doc: "When durable records are fsynced. `on_commit`: before the ack, many waiting \
              publishes sharing one fdatasync; a crash, power loss included, loses nothing \
              acked. `periodic`: acks after the write (a process crash loses nothing acked) \
              and fdatasync every FELIX_DURABLE_FSYNC_INTERVAL_MS (a power loss can lose up \
              to one interval).",
    }
    durable_fsync_interval_ms {
        env: "FELIX_DURABLE_FSYNC_INTERVAL_MS",
        kind: Kind::Count { min: 1, max: DURABLE_FSYNC_INTERVAL_MS_MAX },
        default: Fixed("250"),
        restart: Restart::Broker,
        doc: "Milliseconds between fdatasyncs of written durable records in `periodic` mode; \
              on a cluster member also of its copies of replicated streams created `--fsync \
              periodic` (docs/cluster.md).",
    }
    storage_io_uring {
        env: "FELIX_STORAGE_IO_URING",
        kind: Kind::Bool,
        default: Fixed("1"),
        restart: Restart::Broker,
        doc: "Write durable logs with io_uring (falls back to the pwrite writer thread, with \
              a warning, where io_uring cannot be set up); 0 always uses pwrite + fdatasync.",
    }
    storage_direct_io {
        env: "FELIX_STORAGE_DIRECT_IO",
        kind: Kind::Bool,
        default: Fixed("1"),
        restart: Restart::Broker,
        doc: "Write durable log rounds with O_DIRECT, straight from an aligned buffer to the \
              device (no page-cache copy, no writeback at fdatasync); where the file system \
              refuses O_DIRECT the log warns once and writes through the page cache. 0 always \
              writes through the page cache.",
    }
    storage_rounds_in_flight {
        env: "FELIX_STORAGE_ROUNDS_IN_FLIGHT",
        kind: Kind::Count { min: 1, max: STORAGE_ROUNDS_IN_FLIGHT_MAX },
        default: Fixed("2"),
        restart: Restart::Broker,
        doc: "Write rounds in flight per durable log. 2: the next round's write runs while \
              the previous round's fdatasync does (once that round's write finished), so a \
              core's log writes and syncs at the same time; 1: one write + fdatasync at a \
              time.",
    }
    durable_segment_bytes {
        env: "FELIX_DURABLE_SEGMENT_BYTES",
        kind: Kind::Size { min: DURABLE_SEGMENT_BYTES_MIN, max: DURABLE_SEGMENT_BYTES_MAX },
        default: Fixed("1GiB"),
        restart: Restart::Broker,
        doc: "Preallocated size of each durable log segment file (one log per data-plane \
              core under `<data_dir>/log/core-<i>/`, whose first segment is made when the \
              core gets its first durable shard); smaller (a power of two, at least 16 MiB) \
              when the data volume lacks room for four per core; retention deletes whole \
              segments.",
    }
    durable_retention_bytes {
        env: "FELIX_DURABLE_RETENTION_BYTES",
        kind: Kind::Size { min: 0, max: DURABLE_RETENTION_BYTES_MAX },
        default: Fixed("0"),
        restart: Restart::Broker,
        doc: "Per core: delete the oldest log segments while the core's log exceeds this \
              many bytes (never the active segment); on a cluster member, per replicated \
              shard's record log too. 0 keeps everything.",
    }
    durable_retention_seconds {
        env: "FELIX_DURABLE_RETENTION_SECONDS",
        kind: Kind::Count { min: 0, max: DURABLE_RETENTION_SECONDS_MAX },
        default: Fixed("0"),
        restart: Restart::Broker,
        doc: "Delete log segments whose newest record is older than this many seconds \
              (never the active segment), replicated shards' record logs included. 0 keeps \
              everything.",
    }
    host_profile {
        env: "FELIX_HOST_PROFILE",
        kind: Kind::Choice { options: HOST_PROFILES },
        default: Fixed("baremetal"),
        restart: Restart::Broker,
        doc: "Host profile of `felix tune`, `felix preflight` and the start-up host check: \
              `azure` (storage-optimized L-series VMs: MTU 3900, RAID0 of the local NVMe \
              drives), `baremetal`, `test` (the image self-test). docs/operations.md lists \
              what each requires.",
    }
    data_nic {
        env: "FELIX_DATA_NIC",
        kind: Kind::Text { what: "a network interface name, or auto" },
        default: Fixed("auto"),
        restart: Restart::Broker,
        doc: "The network interface clients reach the broker on, whose MTU `felix tune` sets \
              and `felix preflight` checks; `auto`: the interface of the default route.",
    }
    auth {
        env: "FELIX_AUTH",
        kind: Kind::Choice { options: AUTH_MODES },
        default: Fixed("off"),
        restart: Restart::Broker,
        doc: "`off`: clients without credentials connect as the principal `anonymous` \
              (credentials that are presented are still verified: a wrong token or a \
              certificate from another CA is refused); `required`: a Hello without a valid \
              client certificate or token is refused with `unauthenticated`. The development \
              default is `off`; docs/security.md says what it does not protect.",
    }
    client_ca {
        env: "FELIX_CLIENT_CA",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "PEM CA certificate(s) that client certificates must chain to (mutual TLS). Set: \
              clients may present a certificate, which must verify against it; its subject \
              Common Name (else its first subject alternative name) becomes the connection's \
              principal. Unset: client certificates are not requested.",
    }
    tokens_file {
        env: "FELIX_TOKENS_FILE",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::Sighup,
        doc: "File of bearer-token hashes (`felix token add PRINCIPAL` appends one; lines \
              `<id> <principal> <argon2 hash>`), re-read on SIGHUP without dropping \
              connections (connections of removed tokens are closed).",
    }
    rules {
        env: "FELIX_RULES",
        kind: Kind::TextList {
            what: "rules `PRINCIPAL PERMISSIONS STREAMS` separated by ; or newlines \
                   (see docs/security.md)",
        },
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "Authorization rules, e.g. `alice publish,subscribe orders.*; ops admin *`; in \
              the config file also an array of strings, one rule each. No rules: every \
              principal may publish, subscribe and administer every stream. With rules: a \
              principal may do only what a rule grants it (`*` names every principal). The \
              broker parses them at start-up and names FELIX_RULES in a syntax error.",
    }
    max_connections_per_core {
        env: "FELIX_MAX_CONNECTIONS_PER_CORE",
        kind: Kind::Count { min: MAX_CONNECTIONS_PER_CORE_MIN, max: MAX_CONNECTIONS_PER_CORE_MAX },
        default: Fixed("10000"),
        restart: Restart::Broker,
        doc: "Connections one data-plane core holds at once; bounds per-connection state on \
              one core (each connection holds QUIC and stream buffers).",
    }
    max_connections_per_principal {
        env: "FELIX_MAX_CONNECTIONS_PER_PRINCIPAL",
        kind: Kind::Count { min: 0, max: MAX_CONNECTIONS_PER_PRINCIPAL_MAX },
        default: Fixed("1024"),
        restart: Restart::Broker,
        doc: "Connections one principal holds at once, across all cores (0 = no limit), so \
              that one misbehaving client identity cannot take every connection slot. A \
              core-aware client uses one connection per core plus one; in open mode all \
              clients without credentials share `anonymous`.",
    }
    max_streams {
        env: "FELIX_MAX_STREAMS",
        kind: Kind::Count { min: MAX_STREAMS_MIN, max: MAX_STREAMS_MAX },
        default: Fixed("1024"),
        restart: Restart::Broker,
        doc: "Streams in the catalogue; every core holds every stream's metadata. 65,536 is \
              the protocol's StreamList bound.",
    }
    max_shards_per_stream {
        env: "FELIX_MAX_SHARDS_PER_STREAM",
        kind: Kind::Count { min: MAX_SHARDS_PER_STREAM_MIN, max: MAX_SHARDS_PER_STREAM_MAX },
        default: Fixed("1024"),
        restart: Restart::Broker,
        doc: "Shards of one stream; also bounds every per-shard list in frames (`max_shards` \
              in HelloOk). 4096 is the protocol's bound.",
    }
    max_streams_per_connection {
        env: "FELIX_MAX_STREAMS_PER_CONNECTION",
        kind: Kind::Count {
            min: MAX_STREAMS_PER_CONNECTION_MIN,
            max: MAX_STREAMS_PER_CONNECTION_MAX,
        },
        default: Fixed("256"),
        restart: Restart::Broker,
        doc: "Client-opened QUIC streams open at once on one connection (request, publish and \
              subscription streams); a stream beyond it is answered `limit_exceeded` and \
              finished.",
    }
    max_subscriptions_per_connection {
        env: "FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION",
        kind: Kind::Count {
            min: MAX_SUBSCRIPTIONS_PER_CONNECTION_MIN,
            max: MAX_SUBSCRIPTIONS_PER_CONNECTION_MAX,
        },
        default: Fixed("64"),
        restart: Restart::Broker,
        doc: "Subscriptions open at once on one connection; each holds a backlog of up to \
              FELIX_SUBSCRIBER_QUEUE_MAX_BYTES.",
    }
    hello_timeout_ms {
        env: "FELIX_HELLO_TIMEOUT_MS",
        kind: Kind::Count { min: HELLO_TIMEOUT_MS_MIN, max: HELLO_TIMEOUT_MS_MAX },
        default: Fixed("10000"),
        restart: Restart::Broker,
        doc: "Milliseconds a new connection has to complete its handshake (Hello answered); a \
              connection that sends nothing is closed with `protocol_violation` after it.",
    }
    hello_max_bytes {
        env: "FELIX_HELLO_MAX_BYTES",
        kind: Kind::Size { min: HELLO_MAX_BYTES_MIN, max: HELLO_MAX_BYTES_MAX },
        default: Fixed("16KiB"),
        restart: Restart::Broker,
        doc: "Largest Hello frame body the broker reads before the handshake completes (a \
              client name and a token fit in 2 KiB); a larger one is refused with \
              `frame_too_large` and the connection closed.",
    }
    idle_timeout_ms {
        env: "FELIX_IDLE_TIMEOUT_MS",
        kind: Kind::Count { min: IDLE_TIMEOUT_MS_MIN, max: IDLE_TIMEOUT_MS_MAX },
        default: Fixed("30000"),
        restart: Restart::Broker,
        doc: "QUIC idle timeout in milliseconds: a connection that sends nothing (not even \
              keep-alives, which the Felix client sends) for this long is closed.",
    }
    max_key_bytes {
        env: "FELIX_MAX_KEY_BYTES",
        kind: Kind::Count { min: 0, max: MAX_KEY_BYTES_MAX },
        default: Fixed("1024"),
        restart: Restart::Broker,
        doc: "Largest record key, in bytes; bounded by the protocol's u16 length.",
    }
    max_payload_bytes {
        env: "FELIX_MAX_PAYLOAD_BYTES",
        kind: Kind::Size { min: MAX_PAYLOAD_BYTES_MIN, max: MAX_PAYLOAD_BYTES_MAX },
        default: Fixed("4MiB"),
        restart: Restart::Broker,
        doc: "Largest record payload, in bytes; a record must also fit in \
              FELIX_MAX_FRAME_BYTES, and a larger value than that stops start-up.",
    }
    // ---- cluster (docs/cluster.md) ----
    cluster_node_id {
        env: "FELIX_CLUSTER_NODE_ID",
        kind: Kind::Count { min: 0, max: CLUSTER_NODE_ID_MAX },
        default: Fixed("0"),
        restart: Restart::Broker,
        doc: "This broker's id in its cluster, 1..=65535; 0 (the default) runs a single \
              broker with no cluster. Set: FELIX_CLUSTER_PEERS, FELIX_CLUSTER_CA, \
              FELIX_CLUSTER_CERT and FELIX_CLUSTER_KEY are required.",
    }
    cluster_peers {
        env: "FELIX_CLUSTER_PEERS",
        kind: Kind::TextList {
            what: "members `ID=IP:PORT` separated by commas, semicolons or newlines",
        },
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "Every member of the cluster, this broker included, as `ID=IP:PORT` peer \
              addresses (the same list on every broker, e.g. \
              `1=10.0.0.1:7500,2=10.0.0.2:7500,3=10.0.0.3:7500`). This broker's peer endpoint \
              binds its own entry's address.",
    }
    cluster_ca {
        env: "FELIX_CLUSTER_CA",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "PEM CA certificate every member's peer certificate must chain to (mutual TLS \
              between brokers). `felix cluster dev-certs` writes one for development.",
    }
    cluster_cert {
        env: "FELIX_CLUSTER_CERT",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "This broker's peer certificate (PEM), issued by FELIX_CLUSTER_CA with the \
              common name `felix-node-<FELIX_CLUSTER_NODE_ID>`.",
    }
    cluster_key {
        env: "FELIX_CLUSTER_KEY",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::Broker,
        doc: "PEM private key of FELIX_CLUSTER_CERT.",
    }
    cluster_raft_compact_entries {
        env: "FELIX_CLUSTER_RAFT_COMPACT_ENTRIES",
        kind: Kind::Count { min: 16, max: 1_000_000 },
        default: Fixed("10000"),
        restart: Restart::Broker,
        doc: "Applied entries (publish batches) a replicated shard's Raft log keeps in memory \
              before it compacts behind a snapshot (also after 64 MiB of entries). Records \
              stay in the shard's record log either way (kept by FELIX_DURABLE_RETENTION_*); \
              a member further behind than this catches up from a snapshot and fetches the \
              records it missed from a peer.",
    }
    // ---- client / CLI ----
    addr {
        env: "FELIX_ADDR",
        kind: Kind::Addr,
        default: Fixed("127.0.0.1:7400"),
        restart: Restart::PerCommand,
        doc: "Broker address the CLI connects to.",
    }
    server_name {
        env: "FELIX_SERVER_NAME",
        kind: Kind::Text { what: "a non-empty TLS server name" },
        default: Fixed("localhost"),
        restart: Restart::PerCommand,
        doc: "TLS server name the client verifies the broker's certificate against.",
    }
    ca {
        env: "FELIX_CA",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::PerCommand,
        doc: "CA certificate (PEM) the client trusts. Unset: `<data_dir>/tls/dev-cert.pem`, \
              the broker's generated development certificate.",
        render: |config: &Config| config.ca_path().display().to_string(),
    }
    insecure {
        env: "FELIX_INSECURE",
        kind: Kind::Bool,
        default: Fixed("0"),
        restart: Restart::PerCommand,
        doc: "Skip verification of the broker's certificate. Development only.",
    }
    publish_inflight_bytes {
        env: "FELIX_PUBLISH_INFLIGHT_BYTES",
        kind: Kind::Size { min: PUBLISH_INFLIGHT_BYTES_MIN, max: PUBLISH_INFLIGHT_BYTES_MAX },
        default: Fixed("4MiB"),
        restart: Restart::PerCommand,
        doc: "Client publish budget: payload bytes sent and not yet acknowledged.",
    }
    pub_shard_streams {
        env: "FELIX_PUB_SHARD_STREAMS",
        kind: Kind::Count { min: 0, max: PUB_SHARD_STREAMS_MAX },
        default: Fixed("4"),
        restart: Restart::PerCommand,
        doc: "Client publish streams per connection, assigned to shards first come first \
              served (shard i of the order seen uses stream i % count); 0 = a pool used \
              round-robin.",
    }
    token {
        env: "FELIX_TOKEN",
        kind: Kind::Secret { what: "a bearer token (felix_<id>_<secret>)" },
        default: Fixed(""),
        restart: Restart::PerCommand,
        doc: "Bearer token the client sends in its Hello (`felix token add` prints one); never \
              printed. Prefer the environment or a config file readable only by you over a \
              command-line flag, which other users can see in the process list.",
    }
    client_cert {
        env: "FELIX_CLIENT_CERT",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::PerCommand,
        doc: "Client certificate chain (PEM) presented for mutual TLS. Set together with \
              FELIX_CLIENT_KEY, or leave both unset and the client presents no certificate.",
    }
    client_key {
        env: "FELIX_CLIENT_KEY",
        kind: Kind::OptionalPath,
        default: Fixed(""),
        restart: Restart::PerCommand,
        doc: "PEM private key of FELIX_CLIENT_CERT. Set both or neither.",
    }
}
