//! felix-bench: the system-load benchmark tool (docs/semantics.md, 7 Measuring performance).
//!
//! What this crate owns:
//! - [`plan`]: the TOML campaign plan (settings, arms, cells, matrices), its validation and the
//!   interleaved trial order.
//! - [`stats`]: pure arithmetic on the broker's once-a-second counters: per-second rates, the
//!   steady window, medians, trial aggregation, shed, Little's law, latency summaries.
//! - [`cell`]: one run of one cell (inputs, raw samples, outputs) as a self-contained JSON line,
//!   and the [`cell::CellDriver`] seam where a load generator plugs in.
//! - [`broker`]: the broker under test: `felix broker` started per cell (fresh data directory,
//!   kernel-chosen ports read from its stdout, SIGTERM then SIGKILL) or one already running.
//! - [`sampler`]: the broker's counters once a second (`/metrics`, `/proc/<pid>/stat`,
//!   `/proc/net/snmp`); every metric name read is in [`sampler::metric_names`].
//! - [`generator`]: the Felix load generator ([`generator::FelixDriver`]): publishers and the
//!   latency subscriber over the Felix client, graceful finish, ack and delivery histograms.
//! - [`runner`]: walks a plan's schedule through a driver and records every run.
//! - [`report`]: `cells.csv`, `summary.md` and the PNG/SVG charts, re-renderable from records.
//! - [`disk`]: the built-in fsync write probe (fio's "256 KiB sequential writes, fdatasync after
//!   each, one job", plus a 4 KiB variant) used to baseline the disk in the same session.
//! - [`progress`]: a small progress-bar wrapper for the runner.
//! - [`nats`]: the NATS side-by-side peer (nats-server per cell, async-nats generator) and
//!   [`nats::SystemDriver`], which sends each arm to its system's driver.
//! - [`iggy`]: the Apache Iggy side-by-side peer's server side (config file, loopback
//!   listeners, fsync settings, the process); `iggy_driver` (cargo feature `iggy`) is its load
//!   generator over the `iggy` client crate's QUIC transport.
//! - [`pairs`]: Felix-versus-NATS and Felix-versus-Iggy pair matching, ratios and the "what still differs" text.
//! - [`instructions`]: instructions per published record under callgrind (in-process broker).
//! - [`pin`]: the pinned method: the server on one CPU set, the generator on another, and the
//!   per-server-CPU figures (CPU-seconds per GB and per million records, server-bound or not).
//!
//! Threads: the runner, disk probe and broker supervision run on the calling thread of the
//! `felix-bench` process (a load-generator or operator machine, never a broker data-plane
//! core); the generator's publishers and subscriber are tasks on its own multi-thread tokio
//! runtime; the sampler and the broker's stdout reader each have a housekeeping thread. The disk
//! probe blocks its thread on `fdatasync` by design.

pub mod broker;
pub mod cell;
pub mod cluster;
pub mod disk;
pub mod generator;
pub mod iggy;
#[cfg(feature = "iggy")]
pub mod iggy_driver;
pub mod instructions;
pub mod nats;
pub mod pairs;
pub mod pin;
pub mod plan;
pub mod progress;
pub mod report;
pub mod runner;
pub mod sampler;
pub mod stats;

use std::path::PathBuf;

/// Every failure of the library, each naming what it concerns (a cell, a field, a file).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A broker counter went backwards between two samples (broker restart or counter reset).
    #[error(
        "{cell}: broker counter `{counter}` went back from {before} to {after} at t={t_s}s \
         (broker restarted or counter reset); refusing the cell rather than reporting a negative rate"
    )]
    CounterReset {
        cell: String,
        counter: &'static str,
        t_s: f64,
        before: f64,
        after: f64,
    },
    /// Sample times are not finite or not strictly increasing, or a value is not finite.
    #[error("{cell}: sample {index}: {detail}")]
    BadSample {
        cell: String,
        index: usize,
        detail: String,
    },
    /// Fewer than two samples: no rate can be formed.
    #[error("{cell}: {samples} counter sample(s); at least 2 are needed to form a rate")]
    TooFewSamples { cell: String, samples: usize },
    /// No generator reports, or a generator span that is not a finite, ordered interval.
    #[error("{cell}: {detail}")]
    BadGenerators { cell: String, detail: String },
    /// The generators never all ran at the same time.
    #[error(
        "{cell}: the generators never all ran at once (latest start {start_s}s is not before \
         earliest end {end_s}s)"
    )]
    NeverAllRunning {
        cell: String,
        start_s: f64,
        end_s: f64,
    },
    /// The steady window holds too few one-second rates to take a median.
    #[error(
        "{cell}: only {points} one-second rate(s) lie inside the steady window \
         [{start_s:.3}s, {end_s:.3}s]; at least {min} are needed (run the cell longer)"
    )]
    TooFewSteadyPoints {
        cell: String,
        points: usize,
        min: usize,
        start_s: f64,
        end_s: f64,
    },
    /// The counter samples do not span the generators' run, so the accepted total is unknown.
    #[error("{cell}: {detail}")]
    SamplesDoNotCover { cell: String, detail: String },
    /// The broker accepted more than the generators say they sent.
    #[error(
        "{cell}: the broker accepted {accepted} {what} but the generators sent only {sent}; \
         the counters include other traffic or a generator under-reported"
    )]
    AcceptedExceedsSent {
        cell: String,
        what: &'static str,
        sent: u64,
        accepted: u64,
    },
    /// Nothing was sent, so shed has no meaning.
    #[error("{cell}: the generators sent nothing")]
    NothingSent { cell: String },
    /// Zero throughput: Little's law has no finite prediction.
    #[error("{cell}: throughput is zero; Little's law has no finite wait")]
    NoThroughput { cell: String },
    /// The plan is invalid; the message names the field and the cell.
    #[error("{0}")]
    Plan(String),
    /// The plan is not valid TOML or has unknown or missing fields.
    #[error("plan is not valid")]
    PlanToml(#[from] toml::de::Error),
    /// A file could not be read or written.
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A recorded cell line is not a valid record.
    #[error("{path}:{line}: not a cell record")]
    Record {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// A record could not be serialized.
    #[error("cannot serialize a cell record")]
    Serialize(#[source] serde_json::Error),
    /// The CSV writer failed.
    #[error("{path}")]
    Csv {
        path: PathBuf,
        #[source]
        source: csv::Error,
    },
    /// The chart font could not be loaded.
    #[error(
        "chart font {path}: {detail} (install Debian's fonts-dejavu-core, or pass another TTF)"
    )]
    Font { path: PathBuf, detail: String },
    /// Drawing a chart failed.
    #[error("chart {path}: {detail}")]
    Chart { path: PathBuf, detail: String },
    /// A disk probe argument is out of range.
    #[error("disk probe: {0}")]
    DiskProbe(String),
    /// The broker under test could not be started, configured or stopped.
    #[error("broker: {0}")]
    Broker(String),
    /// The broker's counters could not be read.
    #[error("sampler: {0}")]
    Sampler(String),
    /// The load generator failed to run a cell.
    #[error("{cell}: the load generator failed: {detail}")]
    Driver { cell: String, detail: String },
}

impl BenchError {
    /// Wraps an IO error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BenchError::Io {
            path: path.into(),
            source,
        }
    }
}
