//! The campaign plan: a TOML file of global settings, arms and cells.
//!
//! ```toml
//! [settings]
//! broker = "10.0.0.4:5000"
//! duration_s = 90      # per cell, unless a cell says otherwise
//! trials = 3           # 1..=5
//! warmup_s = 5         # load run before each cell's measured duration, not counted
//! server_cpus = "0"    # the pinned method (src/pin.rs): every broker started on these CPUs,
//! generator_cpus = "1" # the load generator on these; both or neither, disjoint
//!
//! [[arms]]             # a named set of broker environment variables
//! name = "felix-default"
//!
//! [[arms]]
//! name = "felix-ack-on-commit"
//! env = { FELIX_ACK_ON_COMMIT = 1 }
//!
//! [[cells]]            # one cell: every field a single value
//! kind = "durable"
//! payload = 4096
//! batch = 64
//! mode = "acked"
//! publishers = 64
//! in_flight = 64
//!
//! [[cells]]            # a matrix: any field may be a list; the entry expands to the product
//! kind = ["in-memory", "durable"]
//! payload = [256, 4096, 65536]
//! batch = [1, 64]
//! mode = ["acked", "fire-and-forget"]
//! publishers = 64
//! in_flight = 64
//! keys = "spread"      # spread (default) | plain
//! arms = ["felix-default"]  # optional: only these arms run this entry's cells (default: all)
//! ```
//!
//! A NATS peer is an arm with `system = "nats"` (the runner starts `nats-server` per cell):
//!
//! ```toml
//! [[arms]]
//! name = "nats-js-always"
//! system = "nats"
//! storage = "file"      # file (default) | memory: must match the cell's kind (durable | in-memory)
//! sync = "always"       # always (sync_interval: always, fsync before the ack) | default (2 min)
//! mode = "jetstream"    # jetstream (default; acked cells) | core (fire-and-forget cells)
//! atomic_batch = true   # batch > 1 as one NATS 2.12+ atomic batch (default false: B publishes
//!                       # whose acks are awaited as one unit)
//! tls = true            # TLS on the client port (default true, as the reference ran it)
//! ```
//!
//! An Apache Iggy peer is an arm with `system = "iggy"` (the runner starts the `--iggy`
//! iggy-server per cell; src/iggy.rs):
//!
//! ```toml
//! [[arms]]
//! name = "iggy-fsync"
//! system = "iggy"
//! sync = "always"       # always (enforce_fsync, a save per message: fsync before the answer)
//!                       # | off (default: the server's defaults, no fsync); acked cells only
//! ```
//!
//! Parsing is "parse, don't validate": the raw TOML becomes a [`Plan`] whose fields are already
//! in range, or an error naming the field and the cell, e.g.
//! `cell 3 (durable 0B b64): payload must be 1..=4194304, got 0`. Cells are numbered from 1 in
//! file order, each matrix entry expanded in place (last field varying fastest).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::stats::Counts;

/// Largest payload a cell may use: 4 MiB. A record must fit in the client's default
/// `publish_inflight_bytes` (4 MiB, docs/semantics.md, 3 Publishing), or one publish could
/// never be in flight.
pub const PAYLOAD_BYTES_MAX: u32 = 4 * 1024 * 1024;

/// Trials per cell and arm: 1..=5. The reference runs 2-3; more than 5 multiplies a campaign's
/// hours for a median that no longer moves.
pub const TRIALS_MAX: u32 = 5;

/// Shortest cell: 5 s. The steady window keeps 80% of the run and needs 3 whole one-second
/// rates; with samples at arbitrary phase that takes at least 4 s of window, so 5 s of run.
pub const DURATION_S_MIN: u32 = 5;

/// Longest cell: one hour. The reference's cells run 90 s; an hour is a guard against typos
/// (e.g. 9000 for 90) that would silently cost a day.
pub const DURATION_S_MAX: u32 = 3600;

/// Longest warm-up before a cell: 10 minutes, the same kind of typo guard.
pub const WARMUP_S_MAX: u32 = 600;

/// Largest batch: 65,536 records per request, 1024 times the reference's fast path of 64.
pub const BATCH_MAX: u32 = 65_536;

/// Most publishers in one cell: 4096, 64 times the reference's 64 publishers.
pub const PUBLISHERS_MAX: u32 = 4096;

/// Most requests in flight per publisher: 65,536, 1024 times the reference's 64.
pub const IN_FLIGHT_MAX: u32 = 65_536;

/// Most cells after matrix expansion: at 90 s each this is over a week per arm and trial; a
/// larger product is a mistake in a matrix, caught before expanding it.
pub const CELLS_MAX: usize = 10_000;

/// Most arms: each arm multiplies the campaign; 16 covers Felix variants plus NATS peers.
pub const ARMS_MAX: usize = 16;

/// Shards of the benchmark stream when the plan does not say: 8. On this 2-vCPU machine that
/// is 4 per core, enough for the spread keys to hit every core's shards evenly; the reference's
/// 8-vCPU broker used 48.
pub const DEFAULT_SHARDS: u32 = 8;

/// Most shards a plan may ask for: 4096, the wire protocol's default `max_shards` bound.
pub const SHARDS_MAX: u32 = 4096;

/// Smallest payload of a latency cell: the first 8 bytes carry the send timestamp.
pub const LATENCY_PAYLOAD_BYTES_MIN: u32 = 8;

/// The settings' `broker` value meaning "the runner starts a broker per cell".
pub const BROKER_SPAWN: &str = "spawn";

/// Stream kind under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StreamKind {
    InMemory,
    Durable,
}

/// Whether a publisher waits for acks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Acked,
    FireAndForget,
}

/// How keys are chosen: spread evenly over all shards, or plain `k0..kN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Keys {
    Spread,
    Plain,
}

/// What a cell measures: broker throughput over a fixed time, or service latency (a counted
/// run of warm-up and measured publishes with one subscriber; docs/semantics.md, 7 Measuring
/// performance).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Measure {
    #[default]
    Throughput,
    Latency,
}

impl Measure {
    pub fn as_str(self) -> &'static str {
        match self {
            Measure::Throughput => "throughput",
            Measure::Latency => "latency",
        }
    }
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::InMemory => "in-memory",
            StreamKind::Durable => "durable",
        }
    }
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Acked => "acked",
            Mode::FireAndForget => "fire-and-forget",
        }
    }
}

impl Keys {
    pub fn as_str(self) -> &'static str {
        match self {
            Keys::Spread => "spread",
            Keys::Plain => "plain",
        }
    }
}

/// Global settings of a campaign.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    /// `spawn` ([`BROKER_SPAWN`], the default: the runner starts a broker per cell) or the
    /// `host:port` of a broker already running.
    pub broker: String,
    /// Default measured duration of a cell, DURATION_S_MIN..=DURATION_S_MAX.
    pub duration_s: u32,
    /// Trials per cell and arm, 1..=TRIALS_MAX.
    pub trials: u32,
    /// Seconds of load before each cell's measured duration, 0..=WARMUP_S_MAX.
    pub warmup_s: u32,
    /// Shards of the benchmark stream, 1..=SHARDS_MAX (default [`DEFAULT_SHARDS`]).
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// The pinned method ([`crate::pin`]): the CPUs every broker the runner starts may use.
    /// Set together with `generator_cpus`, disjoint from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cpus: Option<Vec<usize>>,
    /// The CPUs of the `felix-bench` process (the load generator) under the pinned method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator_cpus: Option<Vec<usize>>,
}

impl Settings {
    /// Sets the pinned method's CPU sets (from flags, over the plan's), checked like a plan's.
    pub fn set_pinning(
        &mut self,
        server: Option<&str>,
        generator: Option<&str>,
    ) -> Result<(), BenchError> {
        if let Some(text) = server {
            self.server_cpus = Some(crate::pin::parse_cpus("--server-cpus", text)?);
        }
        if let Some(text) = generator {
            self.generator_cpus = Some(crate::pin::parse_cpus("--generator-cpus", text)?);
        }
        check_pinning(self)
    }
}

/// Both pinned sets or neither; disjoint; only for brokers the runner starts.
fn check_pinning(s: &Settings) -> Result<(), BenchError> {
    match (&s.server_cpus, &s.generator_cpus) {
        (None, None) => Ok(()),
        (Some(server), Some(generator)) => {
            if let Some(cpu) = server.iter().find(|cpu| generator.contains(cpu)) {
                return Err(BenchError::Plan(format!(
                    "settings: CPU {cpu} is in both server_cpus and generator_cpus; the pinned \
                     method keeps the server and the generator apart"
                )));
            }
            if s.broker != BROKER_SPAWN {
                return Err(BenchError::Plan(
                    "settings: server_cpus needs broker = \"spawn\" (a broker already running \
                     is pinned by whoever started it, e.g. taskset)"
                        .to_string(),
                ));
            }
            Ok(())
        }
        _ => Err(BenchError::Plan(
            "settings: server_cpus and generator_cpus go together (e.g. server_cpus = \"0\", \
             generator_cpus = \"1\")"
                .to_string(),
        )),
    }
}

fn default_shards() -> u32 {
    DEFAULT_SHARDS
}

/// Which broker an arm runs.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum System {
    /// `felix broker` (the default).
    #[default]
    Felix,
    /// `nats-server` 2.15 with JetStream, the side-by-side peer.
    Nats,
    /// Apache Iggy's `iggy-server` (a build the user supplies), driven over its QUIC transport.
    Iggy,
}

impl System {
    pub fn as_str(self) -> &'static str {
        match self {
            System::Felix => "felix",
            System::Nats => "nats",
            System::Iggy => "iggy",
        }
    }
}

/// Where a NATS JetStream stream keeps its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NatsStorage {
    File,
    Memory,
}

/// When a NATS file store fsyncs: before every ack (`sync_interval: always`) or on the server's
/// default interval (2 minutes, `defaultSyncInterval` in nats-server's filestore.go).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NatsSync {
    Always,
    Default,
}

/// JetStream publishes (acked, stored) or core NATS publishes (no ack, nothing stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NatsMode {
    Jetstream,
    Core,
}

/// Largest atomic batch: nats-server's default `max_batch_size` (1,000 messages per batch).
pub const NATS_ATOMIC_BATCH_MAX: u32 = 1_000;

/// The settings of a NATS arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NatsArm {
    pub storage: NatsStorage,
    pub sync: NatsSync,
    pub mode: NatsMode,
    /// Batches > 1 go as one atomic batch (ADR-50 headers, one ack for the commit message).
    pub atomic_batch: bool,
    /// TLS on the client port.
    pub tls: bool,
}

impl NatsArm {
    /// `js file always atomic tls`, for labels.
    pub fn describe(&self) -> String {
        let mut out = match self.mode {
            NatsMode::Core => "core".to_string(),
            NatsMode::Jetstream => format!(
                "js {} sync={}",
                match self.storage {
                    NatsStorage::File => "file",
                    NatsStorage::Memory => "memory",
                },
                match self.sync {
                    NatsSync::Always => "always",
                    NatsSync::Default => "default",
                }
            ),
        };
        if self.atomic_batch {
            out.push_str(" atomic");
        }
        out.push_str(if self.tls { " tls" } else { " plain-tcp" });
        out
    }
}

/// When an Iggy partition's messages reach the disk, in terms of the server's own settings
/// (`[system.partition]` of its config.toml).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IggySync {
    /// `enforce_fsync = true` and `messages_required_to_save = 1`: every send is written to
    /// its segment and fsynced (messages and index files) before the server answers.
    Always,
    /// The server's defaults: the answer comes once the batch is in the partition's in-memory
    /// journal; it is written (no fsync) when 1,024 messages or 1 MiB are buffered, or by the
    /// 30 s message saver. Iggy itself never fsyncs the partition: fsync off.
    Off,
}

/// The settings of an Iggy arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IggyArm {
    pub sync: IggySync,
}

impl IggyArm {
    /// `fsync always` / `fsync off`, for labels.
    pub fn describe(&self) -> String {
        match self.sync {
            IggySync::Always => "quic fsync always (enforce_fsync, messages_required_to_save=1)",
            IggySync::Off => "quic fsync off (server defaults)",
        }
        .to_string()
    }
}

/// A named broker configuration: Felix with environment variables, or a NATS or Iggy peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arm {
    pub name: String,
    /// Environment of the broker process (Felix: FELIX_* settings; NATS: e.g. GOMAXPROCS).
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub system: System,
    /// Present exactly when `system` is NATS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsArm>,
    /// Present exactly when `system` is Iggy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iggy: Option<IggyArm>,
}

impl Arm {
    /// A Felix arm with this environment.
    pub fn felix(name: &str, env: BTreeMap<String, String>) -> Arm {
        Arm {
            name: name.to_string(),
            env,
            system: System::Felix,
            nats: None,
            iggy: None,
        }
    }
}

/// Everything that defines what a cell measures (its identity across trials and arms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Shape {
    pub kind: StreamKind,
    pub payload_bytes: u32,
    pub batch: u32,
    pub mode: Mode,
    pub publishers: u32,
    pub in_flight: u32,
    pub keys: Keys,
    pub duration_s: u32,
    /// Throughput (default) or service latency with a subscriber.
    #[serde(default)]
    pub measure: Measure,
}

impl Shape {
    /// What all publishers together keep outstanding: publishers x in flight x batch records.
    pub fn outstanding(&self) -> Counts {
        let records =
            u64::from(self.publishers) * u64::from(self.in_flight) * u64::from(self.batch);
        Counts {
            bytes: records * u64::from(self.payload_bytes),
            records,
        }
    }

    /// A short label for chart axes, e.g. `mem 4K b64 ack p64x64`.
    pub fn short_label(&self) -> String {
        let kind = match self.kind {
            StreamKind::InMemory => "mem",
            StreamKind::Durable => "dur",
        };
        let mode = match self.mode {
            Mode::Acked => "ack",
            Mode::FireAndForget => "ff",
        };
        let keys = match self.keys {
            Keys::Spread => "",
            Keys::Plain => " plain",
        };
        let measure = match self.measure {
            Measure::Throughput => "",
            Measure::Latency => " lat",
        };
        format!(
            "{kind} {} b{} {mode} p{}x{}{keys}{measure}",
            human_bytes(self.payload_bytes),
            self.batch,
            self.publishers,
            self.in_flight
        )
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}B b{} {} p{} if{} {} {}s",
            self.kind.as_str(),
            self.payload_bytes,
            self.batch,
            self.mode.as_str(),
            self.publishers,
            self.in_flight,
            self.keys.as_str(),
            self.duration_s
        )?;
        if self.measure == Measure::Latency {
            write!(f, " latency")?;
        }
        Ok(())
    }
}

/// 256 -> "256B", 4096 -> "4K", 65536 -> "64K", 1048576 -> "1M", 1000 -> "1000B".
fn human_bytes(n: u32) -> String {
    const MIB: u32 = 1024 * 1024;
    if n >= MIB && n.is_multiple_of(MIB) {
        format!("{}M", n / MIB)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n / 1024)
    } else {
        format!("{n}B")
    }
}

/// One cell of the plan: its number (from 1, in expanded file order) and its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cell {
    pub number: usize,
    pub shape: Shape,
}

impl Cell {
    /// `cell 3 (durable 4096B b64 acked p64 if64 spread 90s)`, used in every message about it.
    pub fn label(&self) -> String {
        format!("cell {} ({})", self.number, self.shape)
    }
}

/// A validated plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub settings: Settings,
    pub arms: Vec<Arm>,
    pub cells: Vec<Cell>,
    /// For each cell (same index), the arms it runs (indices into `arms`, in arm order): every
    /// arm unless its `[[cells]]` entry names some.
    #[serde(default)]
    pub cell_arms: Vec<Vec<usize>>,
}

/// One run in a plan's schedule: a cell, a trial (from 1) and an arm (index into `arms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub cell: usize,
    pub trial: u32,
    pub arm: usize,
}

/// The arm order of a trial (trial counts from 1): arms rotate by one each trial, so trial 1
/// runs A B C, trial 2 B C A, trial 3 C A B. With two arms that is A B, B A, A B, ...; over as
/// many trials as arms, every arm takes every position once, so slow drift in the VMs, the disk
/// or the network hits every arm alike.
pub fn trial_order(arms: usize, trial: u32) -> Vec<usize> {
    assert!(trial >= 1, "trials count from 1");
    if arms == 0 {
        return Vec::new();
    }
    let shift = (trial as usize - 1) % arms;
    (0..arms).map(|i| (i + shift) % arms).collect()
}

impl Plan {
    /// Parses and validates a plan.
    pub fn parse(text: &str) -> Result<Plan, BenchError> {
        let raw: RawPlan = toml::from_str(text)?;
        raw.validate()
    }

    /// Reads, parses and validates a plan file.
    pub fn load(path: &Path) -> Result<Plan, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
        Plan::parse(&text)
    }

    /// Every run in order: for each cell, for each trial, the arms in [`trial_order`]. Arms of
    /// one cell and trial run back to back, so they see the same conditions.
    pub fn schedule(&self) -> Vec<Run> {
        let mut runs =
            Vec::with_capacity(self.cells.len() * self.arms.len() * self.settings.trials as usize);
        for cell in 0..self.cells.len() {
            let all: Vec<usize>;
            let arms = match self.cell_arms.get(cell) {
                Some(a) => a,
                None => {
                    all = (0..self.arms.len()).collect();
                    &all
                }
            };
            for trial in 1..=self.settings.trials {
                for i in trial_order(arms.len(), trial) {
                    runs.push(Run {
                        cell,
                        trial,
                        arm: arms[i],
                    });
                }
            }
        }
        runs
    }

    /// Seconds of load the schedule takes (measured durations plus warm-ups; no set-up time).
    pub fn load_seconds(&self) -> u64 {
        self.schedule()
            .iter()
            .map(|r| u64::from(self.cells[r.cell].shape.duration_s + self.settings.warmup_s))
            .sum()
    }
}

// ---- raw TOML ---------------------------------------------------------------------------------

/// A field that may be given once or as a list (a matrix axis).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    fn values(&self) -> Vec<T> {
        match self {
            OneOrMany::One(v) => vec![v.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    settings: RawSettings,
    #[serde(default)]
    arms: Vec<RawArm>,
    #[serde(default)]
    cells: Vec<RawCells>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSettings {
    broker: Option<String>,
    duration_s: i64,
    trials: i64,
    #[serde(default)]
    warmup_s: i64,
    shards: Option<i64>,
    server_cpus: Option<String>,
    generator_cpus: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawArm {
    name: String,
    #[serde(default)]
    env: BTreeMap<String, toml::Value>,
    system: Option<String>,
    storage: Option<String>,
    sync: Option<String>,
    mode: Option<String>,
    atomic_batch: Option<bool>,
    tls: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCells {
    kind: OneOrMany<String>,
    payload: OneOrMany<i64>,
    batch: OneOrMany<i64>,
    mode: OneOrMany<String>,
    publishers: OneOrMany<i64>,
    in_flight: OneOrMany<i64>,
    keys: Option<OneOrMany<String>>,
    duration_s: Option<OneOrMany<i64>>,
    measure: Option<OneOrMany<String>>,
    arms: Option<Vec<String>>,
}

/// One expanded, not yet validated cell.
#[derive(Debug, Clone)]
struct RawCell {
    kind: String,
    payload: i64,
    batch: i64,
    mode: String,
    publishers: i64,
    in_flight: i64,
    keys: String,
    duration_s: i64,
    measure: String,
}

fn in_range(what: &str, field: &str, v: i64, lo: u32, hi: u32) -> Result<u32, BenchError> {
    if v < i64::from(lo) || v > i64::from(hi) {
        return Err(BenchError::Plan(format!(
            "{what}: {field} must be {lo}..={hi}, got {v}"
        )));
    }
    // In lo..=hi, both u32, so the conversion cannot fail.
    u32::try_from(v).map_err(|_| BenchError::Plan(format!("{what}: {field} out of range")))
}

fn check_broker(addr: &str) -> Result<(), BenchError> {
    if addr == BROKER_SPAWN {
        return Ok(());
    }
    let bad = || {
        BenchError::Plan(format!(
            "settings: broker must be \"spawn\" or host:port (e.g. 10.0.0.4:5000), got {addr:?}"
        ))
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(bad());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(bad()),
    }
}

fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_uppercase() || c == '_')
        && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

fn is_arm_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl RawPlan {
    fn validate(self) -> Result<Plan, BenchError> {
        let s = &self.settings;
        let broker = s.broker.clone().unwrap_or_else(|| BROKER_SPAWN.to_string());
        check_broker(&broker)?;
        let settings = Settings {
            broker,
            duration_s: in_range(
                "settings",
                "duration_s",
                s.duration_s,
                DURATION_S_MIN,
                DURATION_S_MAX,
            )?,
            trials: in_range("settings", "trials", s.trials, 1, TRIALS_MAX)?,
            warmup_s: in_range("settings", "warmup_s", s.warmup_s, 0, WARMUP_S_MAX)?,
            shards: in_range(
                "settings",
                "shards",
                s.shards.unwrap_or(i64::from(DEFAULT_SHARDS)),
                1,
                SHARDS_MAX,
            )?,
            server_cpus: s
                .server_cpus
                .as_deref()
                .map(|text| crate::pin::parse_cpus("settings: server_cpus", text))
                .transpose()?,
            generator_cpus: s
                .generator_cpus
                .as_deref()
                .map(|text| crate::pin::parse_cpus("settings: generator_cpus", text))
                .transpose()?,
        };
        check_pinning(&settings)?;

        if self.arms.is_empty() {
            return Err(BenchError::Plan(
                "plan has no arms: add at least one [[arms]] with a name".to_string(),
            ));
        }
        if self.arms.len() > ARMS_MAX {
            return Err(BenchError::Plan(format!(
                "plan has {} arms; at most {ARMS_MAX}",
                self.arms.len()
            )));
        }
        let mut arms: Vec<Arm> = Vec::with_capacity(self.arms.len());
        for (i, raw) in self.arms.iter().enumerate() {
            let what = format!("arm {} ({:?})", i + 1, raw.name);
            if !is_arm_name(&raw.name) {
                return Err(BenchError::Plan(format!(
                    "{what}: name must be non-empty letters, digits, '-', '_' or '.'"
                )));
            }
            if let Some(j) = arms.iter().position(|a| a.name == raw.name) {
                return Err(BenchError::Plan(format!(
                    "{what}: name repeats arm {}",
                    j + 1
                )));
            }
            let mut env = BTreeMap::new();
            for (key, value) in &raw.env {
                if !is_env_name(key) {
                    return Err(BenchError::Plan(format!(
                        "{what}: env name {key:?} must be A-Z, 0-9 and _ (not starting with a digit)"
                    )));
                }
                let text = match value {
                    toml::Value::String(v) => v.clone(),
                    toml::Value::Integer(v) => v.to_string(),
                    toml::Value::Float(v) => v.to_string(),
                    toml::Value::Boolean(v) => v.to_string(),
                    other => {
                        return Err(BenchError::Plan(format!(
                            "{what}: env {key} must be a string, number or boolean, got a {}",
                            other.type_str()
                        )));
                    }
                };
                env.insert(key.clone(), text);
            }
            let (system, nats, iggy) = peer_arm(&what, raw)?;
            arms.push(Arm {
                name: raw.name.clone(),
                env,
                system,
                nats,
                iggy,
            });
        }

        if self.cells.is_empty() {
            return Err(BenchError::Plan(
                "plan has no cells: add at least one [[cells]]".to_string(),
            ));
        }
        let mut raw_cells: Vec<RawCell> = Vec::new();
        let mut cell_arms: Vec<Vec<usize>> = Vec::new();
        for (i, entry) in self.cells.iter().enumerate() {
            let before = raw_cells.len();
            expand(i + 1, entry, settings.duration_s, &mut raw_cells)?;
            let chosen = entry_arms(i + 1, entry, &arms)?;
            cell_arms.extend(std::iter::repeat_n(chosen, raw_cells.len() - before));
        }
        let cells = raw_cells
            .iter()
            .enumerate()
            .map(|(i, raw)| validate_cell(i + 1, raw))
            .collect::<Result<Vec<Cell>, BenchError>>()?;
        for (cell, chosen) in cells.iter().zip(&cell_arms) {
            for &a in chosen {
                check_arm_fits(cell, &arms[a])?;
            }
        }
        Ok(Plan {
            settings,
            arms,
            cells,
            cell_arms,
        })
    }
}

/// The system and peer settings of a raw arm: NATS or Iggy settings, or neither for Felix.
fn peer_arm(
    what: &str,
    raw: &RawArm,
) -> Result<(System, Option<NatsArm>, Option<IggyArm>), BenchError> {
    if raw.system.as_deref() != Some("iggy") {
        let (system, nats) = nats_arm(what, raw)?;
        return Ok((system, nats, None));
    }
    let given: Vec<&str> = [
        ("storage", raw.storage.is_some()),
        ("mode", raw.mode.is_some()),
        ("atomic_batch", raw.atomic_batch.is_some()),
        ("tls", raw.tls.is_some()),
    ]
    .iter()
    .filter(|(_, set)| *set)
    .map(|(f, _)| *f)
    .collect();
    if !given.is_empty() {
        return Err(BenchError::Plan(format!(
            "{what}: {} do not apply to system = \"iggy\" (only sync)",
            given.join(", ")
        )));
    }
    let sync = match raw.sync.as_deref().unwrap_or("off") {
        "always" => IggySync::Always,
        "off" => IggySync::Off,
        other => {
            return Err(BenchError::Plan(format!(
                "{what}: sync must be always or off for system = \"iggy\", got {other:?}"
            )));
        }
    };
    Ok((System::Iggy, None, Some(IggyArm { sync })))
}

/// The system and NATS settings of a raw arm; NATS fields on a Felix arm are refused.
fn nats_arm(what: &str, raw: &RawArm) -> Result<(System, Option<NatsArm>), BenchError> {
    let bad = |field: &str, allowed: &str, got: &str| {
        BenchError::Plan(format!("{what}: {field} must be {allowed}, got {got:?}"))
    };
    let system = match raw.system.as_deref().unwrap_or("felix") {
        "felix" => System::Felix,
        "nats" => System::Nats,
        other => return Err(bad("system", "felix, nats or iggy", other)),
    };
    if system == System::Felix {
        let given: Vec<&str> = [
            ("storage", raw.storage.is_some()),
            ("sync", raw.sync.is_some()),
            ("mode", raw.mode.is_some()),
            ("atomic_batch", raw.atomic_batch.is_some()),
            ("tls", raw.tls.is_some()),
        ]
        .iter()
        .filter(|(_, set)| *set)
        .map(|(f, _)| *f)
        .collect();
        if !given.is_empty() {
            return Err(BenchError::Plan(format!(
                "{what}: {} only apply to system = \"nats\"",
                given.join(", ")
            )));
        }
        return Ok((System::Felix, None));
    }
    let storage = match raw.storage.as_deref().unwrap_or("file") {
        "file" => NatsStorage::File,
        "memory" => NatsStorage::Memory,
        other => return Err(bad("storage", "file or memory", other)),
    };
    let sync = match raw.sync.as_deref().unwrap_or("default") {
        "always" => NatsSync::Always,
        "default" => NatsSync::Default,
        other => return Err(bad("sync", "always or default", other)),
    };
    let mode = match raw.mode.as_deref().unwrap_or("jetstream") {
        "jetstream" => NatsMode::Jetstream,
        "core" => NatsMode::Core,
        other => return Err(bad("mode", "jetstream or core", other)),
    };
    let atomic_batch = raw.atomic_batch.unwrap_or(false);
    if sync == NatsSync::Always && (storage == NatsStorage::Memory || mode == NatsMode::Core) {
        return Err(BenchError::Plan(format!(
            "{what}: sync = \"always\" needs storage = \"file\" and mode = \"jetstream\" \
             (nothing else is fsynced)"
        )));
    }
    if atomic_batch && mode == NatsMode::Core {
        return Err(BenchError::Plan(format!(
            "{what}: atomic_batch needs mode = \"jetstream\" (core NATS has no batches)"
        )));
    }
    let nats = NatsArm {
        storage,
        sync,
        mode,
        atomic_batch,
        tls: raw.tls.unwrap_or(true),
    };
    Ok((System::Nats, Some(nats)))
}

/// The arms one `[[cells]]` entry runs: those it names (kept in plan order), else all.
fn entry_arms(entry_number: usize, e: &RawCells, arms: &[Arm]) -> Result<Vec<usize>, BenchError> {
    let Some(names) = &e.arms else {
        return Ok((0..arms.len()).collect());
    };
    if names.is_empty() {
        return Err(BenchError::Plan(format!(
            "cells entry {entry_number}: arms is an empty list"
        )));
    }
    let mut chosen = Vec::with_capacity(names.len());
    for name in names {
        match arms.iter().position(|a| &a.name == name) {
            Some(i) if !chosen.contains(&i) => chosen.push(i),
            Some(_) => {
                return Err(BenchError::Plan(format!(
                    "cells entry {entry_number}: arm {name:?} is named twice"
                )));
            }
            None => {
                return Err(BenchError::Plan(format!(
                    "cells entry {entry_number}: no arm is named {name:?}"
                )));
            }
        }
    }
    chosen.sort_unstable();
    Ok(chosen)
}

/// A NATS arm must do what the cell asks: JetStream for acked cells and core for
/// fire-and-forget, file storage for durable cells and memory for in-memory ones, no latency
/// cell on core NATS (it has no ack), atomic batches no larger than the server allows.
fn check_arm_fits(cell: &Cell, arm: &Arm) -> Result<(), BenchError> {
    let s = &cell.shape;
    if let Some(i) = arm.iggy {
        let why = match (s.mode, s.kind, i.sync) {
            (Mode::FireAndForget, _, _) => Some(
                "Iggy has no unacknowledged publish (every SendMessages is answered): acked cells only",
            ),
            (Mode::Acked, StreamKind::InMemory, IggySync::Always) => {
                Some("an in-memory cell pairs with sync = \"off\" (Iggy is always disk-backed)")
            }
            _ => None,
        };
        return match why {
            Some(why) => Err(BenchError::Plan(format!(
                "{} with arm {:?}: {why}",
                cell.label(),
                arm.name
            ))),
            None => Ok(()),
        };
    }
    let Some(n) = arm.nats else {
        return Ok(());
    };
    let why = match (s.mode, n.mode) {
        (Mode::Acked, NatsMode::Core) => Some("an acked cell needs mode = \"jetstream\""),
        (Mode::FireAndForget, NatsMode::Jetstream) => {
            Some("a fire-and-forget cell needs mode = \"core\"")
        }
        (Mode::Acked, NatsMode::Jetstream) => match (s.kind, n.storage) {
            (StreamKind::Durable, NatsStorage::Memory) => {
                Some("a durable cell needs storage = \"file\"")
            }
            (StreamKind::InMemory, NatsStorage::File) => {
                Some("an in-memory cell needs storage = \"memory\"")
            }
            _ => None,
        },
        (Mode::FireAndForget, NatsMode::Core) => None,
    };
    let why = why.or_else(|| {
        (n.atomic_batch && s.batch > NATS_ATOMIC_BATCH_MAX)
            .then_some("batch exceeds NATS's atomic batch limit of 1000")
    });
    match why {
        Some(why) => Err(BenchError::Plan(format!(
            "{} with arm {:?}: {why}",
            cell.label(),
            arm.name
        ))),
        None => Ok(()),
    }
}

/// Expands one `[[cells]]` entry (the cartesian product of its lists) onto `out`.
fn expand(
    entry_number: usize,
    e: &RawCells,
    default_duration_s: u32,
    out: &mut Vec<RawCell>,
) -> Result<(), BenchError> {
    let kinds = e.kind.values();
    let payloads = e.payload.values();
    let batches = e.batch.values();
    let modes = e.mode.values();
    let publishers = e.publishers.values();
    let in_flights = e.in_flight.values();
    let keys = e.keys.as_ref().map_or_else(
        || vec![Keys::Spread.as_str().to_string()],
        OneOrMany::values,
    );
    let durations = e
        .duration_s
        .as_ref()
        .map_or_else(|| vec![i64::from(default_duration_s)], OneOrMany::values);
    let measures = e.measure.as_ref().map_or_else(
        || vec![Measure::Throughput.as_str().to_string()],
        OneOrMany::values,
    );
    let lens = [
        ("kind", kinds.len()),
        ("payload", payloads.len()),
        ("batch", batches.len()),
        ("mode", modes.len()),
        ("publishers", publishers.len()),
        ("in_flight", in_flights.len()),
        ("keys", keys.len()),
        ("duration_s", durations.len()),
        ("measure", measures.len()),
    ];
    let mut product: usize = 1;
    for (field, len) in lens {
        if len == 0 {
            return Err(BenchError::Plan(format!(
                "cells entry {entry_number}: {field} is an empty list"
            )));
        }
        product = product.saturating_mul(len);
    }
    if out.len().saturating_add(product) > CELLS_MAX {
        return Err(BenchError::Plan(format!(
            "cells entry {entry_number}: expands to {product} cells, more than {CELLS_MAX} in all"
        )));
    }
    for kind in &kinds {
        for &payload in &payloads {
            for &batch in &batches {
                for mode in &modes {
                    for &p in &publishers {
                        for &f in &in_flights {
                            for k in &keys {
                                for &d in &durations {
                                    for m in &measures {
                                        out.push(RawCell {
                                            kind: kind.clone(),
                                            payload,
                                            batch,
                                            mode: mode.clone(),
                                            publishers: p,
                                            in_flight: f,
                                            keys: k.clone(),
                                            duration_s: d,
                                            measure: m.clone(),
                                        });
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn validate_cell(number: usize, raw: &RawCell) -> Result<Cell, BenchError> {
    let what = format!(
        "cell {number} ({} {}B b{})",
        raw.kind, raw.payload, raw.batch
    );
    let kind = match raw.kind.as_str() {
        "in-memory" => StreamKind::InMemory,
        "durable" => StreamKind::Durable,
        other => {
            return Err(BenchError::Plan(format!(
                "{what}: kind must be in-memory or durable, got {other:?}"
            )));
        }
    };
    let mode = match raw.mode.as_str() {
        "acked" => Mode::Acked,
        "fire-and-forget" => Mode::FireAndForget,
        other => {
            return Err(BenchError::Plan(format!(
                "{what}: mode must be acked or fire-and-forget, got {other:?}"
            )));
        }
    };
    let keys = match raw.keys.as_str() {
        "spread" => Keys::Spread,
        "plain" => Keys::Plain,
        other => {
            return Err(BenchError::Plan(format!(
                "{what}: keys must be spread or plain, got {other:?}"
            )));
        }
    };
    let measure = match raw.measure.as_str() {
        "throughput" => Measure::Throughput,
        "latency" => Measure::Latency,
        other => {
            return Err(BenchError::Plan(format!(
                "{what}: measure must be throughput or latency, got {other:?}"
            )));
        }
    };
    if measure == Measure::Latency && mode != Mode::Acked {
        return Err(BenchError::Plan(format!(
            "{what}: a latency cell measures acks, so its mode must be acked"
        )));
    }
    if measure == Measure::Latency && raw.publishers != 1 {
        return Err(BenchError::Plan(format!(
            "{what}: a latency cell has one publisher (docs/semantics.md, section 7), got {}",
            raw.publishers
        )));
    }
    if measure == Measure::Latency && raw.payload < i64::from(LATENCY_PAYLOAD_BYTES_MIN) {
        return Err(BenchError::Plan(format!(
            "{what}: a latency cell carries an 8-byte send timestamp, so payload must be at \
             least {LATENCY_PAYLOAD_BYTES_MIN}, got {}",
            raw.payload
        )));
    }
    let shape = Shape {
        measure,
        kind,
        payload_bytes: in_range(&what, "payload", raw.payload, 1, PAYLOAD_BYTES_MAX)?,
        batch: in_range(&what, "batch", raw.batch, 1, BATCH_MAX)?,
        mode,
        publishers: in_range(&what, "publishers", raw.publishers, 1, PUBLISHERS_MAX)?,
        in_flight: in_range(&what, "in_flight", raw.in_flight, 1, IN_FLIGHT_MAX)?,
        keys,
        duration_s: in_range(
            &what,
            "duration_s",
            raw.duration_s,
            DURATION_S_MIN,
            DURATION_S_MAX,
        )?,
    };
    Ok(Cell { number, shape })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[settings]
broker = "127.0.0.1:5000"
duration_s = 90
trials = 2
warmup_s = 5

[[arms]]
name = "felix-default"

[[arms]]
name = "felix-ack-on-commit"
env = { FELIX_ACK_ON_COMMIT = 1, FELIX_DURABLE_FSYNC_MODE = "on_commit" }

[[cells]]
kind = "durable"
payload = 4096
batch = 64
mode = "acked"
publishers = 64
in_flight = 64
duration_s = 30

[[cells]]
kind = ["in-memory", "durable"]
payload = [256, 65536]
batch = [1, 64]
mode = "fire-and-forget"
publishers = 8
in_flight = 1
keys = ["spread", "plain"]
"#;

    /// GOOD with one line replaced (the first line starting with `from`).
    fn with(from: &str, to: &str) -> String {
        let mut done = false;
        GOOD.lines()
            .map(|l| {
                if !done && l.starts_with(from) {
                    done = true;
                    to.to_string()
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn err(text: &str) -> String {
        felix_storage::ErrorChain(&Plan::parse(text).unwrap_err()).to_string()
    }

    #[test]
    fn pinned_sets_go_together_apart_and_only_with_a_spawned_broker() {
        // Proves the pinned method's settings parse as CPU lists, and that one set alone, an
        // overlap, an empty list or an external broker is refused naming the setting.
        let spawn = |extra: &str| with("broker = ", &format!("broker = \"spawn\"\n{extra}"));
        let plan = Plan::parse(&spawn("server_cpus = \"0\"\ngenerator_cpus = \"1-2\"")).unwrap();
        assert_eq!(plan.settings.server_cpus, Some(vec![0]));
        assert_eq!(plan.settings.generator_cpus, Some(vec![1, 2]));
        assert!(Plan::parse(GOOD).unwrap().settings.server_cpus.is_none());
        assert!(err(&spawn("server_cpus = \"0\"")).contains("go together"));
        assert!(
            err(&spawn("server_cpus = \"0-1\"\ngenerator_cpus = \"1\""))
                .contains("CPU 1 is in both")
        );
        assert!(
            err(&spawn("server_cpus = \"\"\ngenerator_cpus = \"1\""))
                .contains("server_cpus: names no CPU")
        );
        let external = with(
            "broker = ",
            "broker = \"127.0.0.1:5000\"\nserver_cpus = \"0\"\ngenerator_cpus = \"1\"",
        );
        assert!(err(&external).contains("spawn"));
        // Flags over the plan's.
        let mut settings = Plan::parse(&spawn("")).unwrap().settings;
        settings.set_pinning(Some("0"), Some("1")).unwrap();
        assert_eq!(
            (settings.server_cpus, settings.generator_cpus),
            (Some(vec![0]), Some(vec![1]))
        );
    }

    #[test]
    fn good_plan_parses_and_expands_matrices_in_order() {
        // Proves a valid plan yields typed settings, arms with stringified env, and the matrix product in file order.
        let plan = Plan::parse(GOOD).unwrap();
        assert_eq!(plan.settings.broker, "127.0.0.1:5000");
        assert_eq!((plan.settings.trials, plan.settings.warmup_s), (2, 5));
        assert_eq!(plan.arms.len(), 2);
        assert_eq!(plan.arms[1].env["FELIX_ACK_ON_COMMIT"], "1");
        assert_eq!(plan.arms[1].env["FELIX_DURABLE_FSYNC_MODE"], "on_commit");
        // 1 explicit + 2 kinds x 2 payloads x 2 batches x 2 keys.
        assert_eq!(plan.cells.len(), 17);
        let first = plan.cells[0];
        assert_eq!(first.number, 1);
        assert_eq!(first.shape.duration_s, 30);
        assert_eq!(
            first.label(),
            "cell 1 (durable 4096B b64 acked p64 if64 spread 30s)"
        );
        let second = plan.cells[1].shape;
        assert_eq!(
            (second.kind, second.payload_bytes, second.batch, second.keys),
            (StreamKind::InMemory, 256, 1, Keys::Spread)
        );
        assert_eq!(
            second.duration_s, 90,
            "cells without duration_s take the default"
        );
        assert_eq!(
            plan.cells[2].shape.keys,
            Keys::Plain,
            "last field varies fastest"
        );
        let last = plan.cells[16].shape;
        assert_eq!(
            (last.kind, last.payload_bytes, last.batch, last.keys),
            (StreamKind::Durable, 65536, 64, Keys::Plain)
        );
        assert_eq!(plan.cells[16].number, 17);
        assert_eq!(plan.schedule().len(), 17 * 2 * 2);
        assert_eq!(plan.load_seconds(), (30 + 5) * 4 + (90 + 5) * 16 * 4);
    }

    #[test]
    fn bad_cell_fields_name_the_field_and_cell() {
        // Proves each out-of-range or unknown cell value is refused with the field, the cell number and the value.
        let cases = [
            (
                with("payload = 4096", "payload = 0"),
                "cell 1 (durable 0B b64): payload must be 1..=4194304, got 0",
            ),
            (
                with("payload = 4096", "payload = 4194305"),
                "cell 1 (durable 4194305B b64): payload must be 1..=4194304, got 4194305",
            ),
            (
                with("batch = 64", "batch = 0"),
                "cell 1 (durable 4096B b0): batch must be 1..=65536, got 0",
            ),
            (
                with("publishers = 64", "publishers = 0"),
                "cell 1 (durable 4096B b64): publishers must be 1..=4096, got 0",
            ),
            (
                with("in_flight = 64", "in_flight = -1"),
                "cell 1 (durable 4096B b64): in_flight must be 1..=65536, got -1",
            ),
            (
                with("duration_s = 30", "duration_s = 2"),
                "cell 1 (durable 4096B b64): duration_s must be 5..=3600, got 2",
            ),
            (
                with("kind = \"durable\"", "kind = \"disk\""),
                "cell 1 (disk 4096B b64): kind must be in-memory or durable, got \"disk\"",
            ),
            (
                with("mode = \"acked\"", "mode = \"ack\""),
                "cell 1 (durable 4096B b64): mode must be acked or fire-and-forget, got \"ack\"",
            ),
            (
                with("keys = [", "keys = [\"spread\", \"random\"]"),
                "cell 3 (in-memory 256B b1): keys must be spread or plain, got \"random\"",
            ),
            (
                with("payload = [256", "payload = [256, 0]"),
                "cell 6 (in-memory 0B b1): payload must be 1..=4194304, got 0",
            ),
            (
                with("batch = [1", "batch = []"),
                "cells entry 2: batch is an empty list",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(err(&text), want);
        }
    }

    #[test]
    fn bad_settings_and_arms_are_refused() {
        // Proves settings bounds, arm names, duplicate arms, env names and missing arms/cells give clear messages.
        let cases = [
            (
                with("trials = 2", "trials = 6"),
                "settings: trials must be 1..=5, got 6",
            ),
            (
                with("trials = 2", "trials = 0"),
                "settings: trials must be 1..=5, got 0",
            ),
            (
                with("duration_s = 90", "duration_s = 0"),
                "settings: duration_s must be 5..=3600, got 0",
            ),
            (
                with("warmup_s = 5", "warmup_s = 601"),
                "settings: warmup_s must be 0..=600, got 601",
            ),
            (
                with("broker = ", "broker = \"localhost\""),
                "settings: broker must be \"spawn\" or host:port (e.g. 10.0.0.4:5000), got \"localhost\"",
            ),
            (
                with("broker = ", "broker = \"host:0\""),
                "settings: broker must be \"spawn\" or host:port (e.g. 10.0.0.4:5000), got \"host:0\"",
            ),
            (
                with("name = \"felix-ack-on-commit\"", "name = \"felix-default\""),
                "arm 2 (\"felix-default\"): name repeats arm 1",
            ),
            (
                with("name = \"felix-default\"", "name = \"felix default\""),
                "arm 1 (\"felix default\"): name must be non-empty letters, digits, '-', '_' or '.'",
            ),
            (
                with("env = ", "env = { felix_ack = \"1\" }"),
                "arm 2 (\"felix-ack-on-commit\"): env name \"felix_ack\" must be A-Z, 0-9 and _ (not starting with a digit)",
            ),
            (
                with("env = ", "env = { FELIX_X = [1] }"),
                "arm 2 (\"felix-ack-on-commit\"): env FELIX_X must be a string, number or boolean, got a array",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(err(&text), want);
        }
        let no_arms = "[settings]\nbroker = \"h:1\"\nduration_s = 10\ntrials = 1\n[[cells]]\nkind = \"durable\"\npayload = 1\nbatch = 1\nmode = \"acked\"\npublishers = 1\nin_flight = 1\n";
        assert_eq!(
            err(no_arms),
            "plan has no arms: add at least one [[arms]] with a name"
        );
        let no_cells =
            "[settings]\nbroker = \"h:1\"\nduration_s = 10\ntrials = 1\n[[arms]]\nname = \"a\"\n";
        assert_eq!(
            err(no_cells),
            "plan has no cells: add at least one [[cells]]"
        );
    }

    /// A Felix arm, two NATS arms and one cell entry per pair, with `extra` appended.
    fn nats_plan(extra: &str) -> String {
        format!(
            "[settings]\nduration_s = 10\ntrials = 2\n\
             [[arms]]\nname = \"felix\"\n\
             [[arms]]\nname = \"nats-always\"\nsystem = \"nats\"\nsync = \"always\"\natomic_batch = true\n\
             [[arms]]\nname = \"nats-core\"\nsystem = \"nats\"\nmode = \"core\"\ntls = false\n\
             [[cells]]\nkind = \"durable\"\npayload = 256\nbatch = [1, 64]\nmode = \"acked\"\n\
             publishers = 1\nin_flight = 1\narms = [\"nats-always\", \"felix\"]\n\
             [[cells]]\nkind = \"in-memory\"\npayload = 256\nbatch = 64\nmode = \"fire-and-forget\"\n\
             publishers = 1\nin_flight = 1\narms = [\"felix\", \"nats-core\"]\n{extra}"
        )
    }

    #[test]
    fn nats_arms_parse_with_defaults_and_cells_pick_their_arms() {
        // Proves NATS arm settings and defaults are typed, and each cell runs only its named arms, Felix first on odd trials.
        let plan = Plan::parse(&nats_plan("")).unwrap();
        assert_eq!(plan.arms[0].system, System::Felix);
        assert_eq!(plan.arms[0].nats, None);
        let always = plan.arms[1].nats.unwrap();
        assert_eq!(plan.arms[1].system, System::Nats);
        assert_eq!(
            always,
            NatsArm {
                storage: NatsStorage::File,
                sync: NatsSync::Always,
                mode: NatsMode::Jetstream,
                atomic_batch: true,
                tls: true,
            }
        );
        let core = plan.arms[2].nats.unwrap();
        assert_eq!(
            (core.mode, core.tls, core.sync),
            (NatsMode::Core, false, NatsSync::Default)
        );
        assert_eq!(plan.cell_arms, vec![vec![0, 1], vec![0, 1], vec![0, 2]]);
        let runs: Vec<(usize, u32, usize)> = plan
            .schedule()
            .iter()
            .map(|r| (r.cell, r.trial, r.arm))
            .collect();
        assert_eq!(
            &runs[..4],
            &[(0, 1, 0), (0, 1, 1), (0, 2, 1), (0, 2, 0)],
            "Felix first on odd trials, NATS first on even"
        );
        assert_eq!(runs.len(), 3 * 2 * 2);
        assert_eq!(&runs[8..], &[(2, 1, 0), (2, 1, 2), (2, 2, 2), (2, 2, 0)]);
        // A record written before arms had a system reads back as a Felix arm.
        let old: Arm = serde_json::from_str(r#"{"name":"a","env":{}}"#).unwrap();
        assert_eq!((old.system, old.nats), (System::Felix, None));
    }

    #[test]
    fn bad_nats_arms_and_mismatched_cells_are_refused() {
        // Proves bad NATS settings, NATS fields on Felix arms, unknown cell arms and arm/cell mismatches name the problem.
        let arm_with = |fields: &str| {
            format!(
                "[settings]\nduration_s = 10\ntrials = 1\n[[arms]]\nname = \"n\"\n{fields}\n\
                 [[cells]]\nkind = \"durable\"\npayload = 256\nbatch = 1\nmode = \"acked\"\n\
                 publishers = 1\nin_flight = 1\n"
            )
        };
        let cases = [
            (
                arm_with("system = \"kafka\""),
                "arm 1 (\"n\"): system must be felix, nats or iggy, got \"kafka\"",
            ),
            (
                arm_with("sync = \"always\""),
                "arm 1 (\"n\"): sync only apply to system = \"nats\"",
            ),
            (
                arm_with("system = \"nats\"\nstorage = \"disk\""),
                "arm 1 (\"n\"): storage must be file or memory, got \"disk\"",
            ),
            (
                arm_with("system = \"nats\"\nsync = \"sometimes\""),
                "arm 1 (\"n\"): sync must be always or default, got \"sometimes\"",
            ),
            (
                arm_with("system = \"nats\"\nstorage = \"memory\"\nsync = \"always\""),
                "arm 1 (\"n\"): sync = \"always\" needs storage = \"file\" and mode = \"jetstream\" (nothing else is fsynced)",
            ),
            (
                arm_with("system = \"nats\"\nmode = \"core\"\natomic_batch = true"),
                "arm 1 (\"n\"): atomic_batch needs mode = \"jetstream\" (core NATS has no batches)",
            ),
            (
                arm_with("system = \"nats\"\nstorage = \"memory\""),
                "cell 1 (durable 256B b1 acked p1 if1 spread 10s) with arm \"n\": a durable cell needs storage = \"file\"",
            ),
            (
                arm_with("system = \"nats\"\nmode = \"core\""),
                "cell 1 (durable 256B b1 acked p1 if1 spread 10s) with arm \"n\": an acked cell needs mode = \"jetstream\"",
            ),
            (
                nats_plan("").replace("arms = [\"felix\", \"nats-core\"]", "arms = [\"nobody\"]"),
                "cells entry 2: no arm is named \"nobody\"",
            ),
            (
                nats_plan("").replace(
                    "arms = [\"felix\", \"nats-core\"]",
                    "arms = [\"nats-always\"]",
                ),
                "cell 3 (in-memory 256B b64 fire-and-forget p1 if1 spread 10s) with arm \"nats-always\": a fire-and-forget cell needs mode = \"core\"",
            ),
            (
                nats_plan("").replace("arms = [\"felix\", \"nats-core\"]", "arms = []"),
                "cells entry 2: arms is an empty list",
            ),
            (
                nats_plan("").replace("batch = [1, 64]", "batch = 2000"),
                "cell 1 (durable 256B b2000 acked p1 if1 spread 10s) with arm \"nats-always\": batch exceeds NATS's atomic batch limit of 1000",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(err(&text), want);
        }
    }

    #[test]
    fn unknown_and_missing_fields_are_toml_errors() {
        // Proves a misspelt field or a missing required field is refused, naming the field.
        let typo = with("in_flight = 64", "inflight = 64");
        let msg = err(&typo);
        assert!(msg.contains("inflight"), "{msg}");
        let missing = with("mode = \"acked\"", "");
        let msg = err(&missing);
        assert!(msg.contains("mode"), "{msg}");
        assert!(err("not toml [").starts_with("plan is not valid"));
    }

    #[test]
    fn oversized_matrix_is_refused_before_expanding() {
        // Proves a matrix whose product exceeds CELLS_MAX is refused without building it.
        let many: Vec<String> = (1..=101).map(|i| i.to_string()).collect();
        let list = format!("[{}]", many.join(","));
        let text = with("payload = [256", &format!("payload = {list}"));
        let text = text.replace("batch = [1, 64]", &format!("batch = {list}"));
        let msg = err(&text);
        assert!(msg.starts_with("cells entry 2: expands to"), "{msg}");
    }

    #[test]
    fn example_plan_is_valid() {
        // Proves the shipped example plan parses: 24 matrix cells + 4 latency cells, two arms.
        let plan = Plan::parse(include_str!("../plans/example.toml")).unwrap();
        assert_eq!((plan.cells.len(), plan.arms.len()), (28, 2));
    }

    #[test]
    fn trial_order_interleaves_arms() {
        // Proves arms rotate per trial: A B / B A for two arms, a Latin square for three.
        assert_eq!(trial_order(2, 1), vec![0, 1]);
        assert_eq!(trial_order(2, 2), vec![1, 0]);
        assert_eq!(trial_order(2, 3), vec![0, 1]);
        assert_eq!(trial_order(3, 1), vec![0, 1, 2]);
        assert_eq!(trial_order(3, 2), vec![1, 2, 0]);
        assert_eq!(trial_order(3, 3), vec![2, 0, 1]);
        assert_eq!(trial_order(1, 4), vec![0]);
        assert!(trial_order(0, 1).is_empty());
        // Over `arms` trials every arm takes every position exactly once.
        for arms in 1..=5 {
            for pos in 0..arms {
                let mut seen: Vec<usize> = (1..=arms as u32)
                    .map(|t| trial_order(arms, t)[pos])
                    .collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..arms).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn schedule_runs_arms_back_to_back_per_trial() {
        // Proves the schedule is cell-major, then trial, then the interleaved arm order.
        let plan = Plan::parse(GOOD).unwrap();
        let runs: Vec<(usize, u32, usize)> = plan
            .schedule()
            .iter()
            .take(6)
            .map(|r| (r.cell, r.trial, r.arm))
            .collect();
        assert_eq!(
            runs,
            vec![
                (0, 1, 0),
                (0, 1, 1),
                (0, 2, 1),
                (0, 2, 0),
                (1, 1, 0),
                (1, 1, 1)
            ]
        );
    }

    #[test]
    fn outstanding_counts_publishers_in_flight_and_batch() {
        // Proves outstanding = publishers x in_flight x batch records, times payload in bytes.
        let plan = Plan::parse(GOOD).unwrap();
        let o = plan.cells[0].shape.outstanding();
        assert_eq!(o.records, 64 * 64 * 64);
        assert_eq!(o.bytes, 64 * 64 * 64 * 4096);
        assert_eq!(plan.cells[0].shape.short_label(), "dur 4K b64 ack p64x64");
    }
    #[test]
    fn iggy_arms_parse_and_refuse_what_iggy_cannot_do() {
        // Proves an Iggy arm's sync is typed (default off), NATS-only fields and fire-and-forget or in-memory fsync cells are refused.
        let base = "[settings]\nduration_s = 10\ntrials = 1\n\
             [[arms]]\nname = \"felix\"\n\
             [[arms]]\nname = \"iggy-fsync\"\nsystem = \"iggy\"\nsync = \"always\"\n\
             [[arms]]\nname = \"iggy-off\"\nsystem = \"iggy\"\n\
             [[cells]]\nkind = \"durable\"\npayload = 256\nbatch = [1, 64]\nmode = \"acked\"\n\
             publishers = 8\nin_flight = 64\narms = [\"felix\", \"iggy-fsync\"]\n\
             [[cells]]\nkind = \"in-memory\"\npayload = 256\nbatch = 1\nmode = \"acked\"\n\
             publishers = 8\nin_flight = 64\narms = [\"felix\", \"iggy-off\"]\n";
        let plan = Plan::parse(base).unwrap();
        assert_eq!(plan.arms[1].system, System::Iggy);
        assert_eq!(plan.arms[1].nats, None);
        assert_eq!(
            plan.arms[1].iggy,
            Some(IggyArm {
                sync: IggySync::Always
            })
        );
        assert_eq!(
            plan.arms[2].iggy,
            Some(IggyArm {
                sync: IggySync::Off
            })
        );
        assert_eq!(plan.cells.len(), 3);
        assert_eq!(plan.cell_arms[2], vec![0, 2]);
        let refused = |text: String, want: &str| {
            let e = Plan::parse(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        refused(
            base.replace("sync = \"always\"", "sync = \"sometimes\""),
            "sync must be always or off for system = \"iggy\"",
        );
        refused(
            base.replace(
                "system = \"iggy\"\nsync = \"always\"",
                "system = \"iggy\"\nstorage = \"file\"",
            ),
            "storage do not apply to system = \"iggy\"",
        );
        refused(
            base.replace("mode = \"acked\"\npublishers = 8\nin_flight = 64\narms = [\"felix\", \"iggy-off\"]",
                "mode = \"fire-and-forget\"\npublishers = 8\nin_flight = 1\narms = [\"felix\", \"iggy-off\"]"),
            "Iggy has no unacknowledged publish",
        );
        refused(
            base.replace(
                "arms = [\"felix\", \"iggy-off\"]",
                "arms = [\"felix\", \"iggy-fsync\"]",
            ),
            "an in-memory cell pairs with sync = \"off\"",
        );
        for file in ["plans/iggy-pairs.toml", "plans/iggy-pairs-short.toml"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
            let plan = Plan::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
            assert_eq!(plan.cells.len(), 14, "{file}");
            assert!(plan.arms.iter().any(|a| a.system == System::Iggy), "{file}");
        }
    }
}
