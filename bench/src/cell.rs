//! One run of one cell: what went in, what was read, what came out, as one JSON line.
//!
//! The load generator plugs in here: it implements [`CellDriver`], runs a cell for one arm and
//! trial, and returns a [`CellRun`] (each generator's span and sent totals, the broker's counter
//! samples, latency histograms). [`CellRecord::from_run`] turns that into a self-contained record
//! with every input and output, so reports can be re-rendered from records alone.
//!
//! What a driver must deliver for the numbers to mean what docs/semantics.md, 7 Measuring
//! performance says:
//! - samples of the broker's cumulative counters about once a second, the first taken before any
//!   generator starts and the last after every generator has finished (stopped issuing at the
//!   deadline and received its outstanding acks), so the broker's accepted total covers the run;
//! - every time in seconds since the same cell start, on one clock.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::plan::{Arm, Cell, Mode, Settings};
use crate::stats::{
    self, Counts, LatencySummary, LatencyUnit, LittlesLaw, Sample, Shed, Span, Throughput,
};

/// Version of the record layout; bumped when a field changes meaning.
pub const RECORD_SCHEMA: u32 = 1;

/// What one load generator reports about its part of a cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GeneratorReport {
    /// Which generator (host or process name).
    pub id: String,
    /// When it was issuing publishes, seconds since cell start.
    pub span: Span,
    /// What it sent (payload bytes and records), its own count at the end of the cell.
    pub sent: Counts,
    /// Publishes the broker refused with an error (counted in `sent`, so they show as shed).
    #[serde(default)]
    pub refused_publishes: u64,
}

/// What a driver returns for one run.
#[derive(Debug, Clone)]
pub struct CellRun {
    pub generators: Vec<GeneratorReport>,
    pub samples: Vec<Sample>,
    /// Ack latency, nanoseconds, merged over generators (acked cells).
    pub ack_latency_ns: Option<Histogram<u64>>,
    /// Publish-to-delivery latency, nanoseconds (cells with a subscriber).
    pub delivery_latency_ns: Option<Histogram<u64>>,
}

/// The load generator seam: runs one cell for one arm and trial.
pub trait CellDriver {
    /// Runs `cell` against the broker configured as `arm`, as trial `trial` (from 1).
    fn run_cell(
        &mut self,
        settings: &Settings,
        cell: &Cell,
        arm: &Arm,
        trial: u32,
    ) -> Result<CellRun, BenchError>;
}

/// Facts about the session recorded with every cell (docs/semantics.md, 7 Measuring
/// performance: record the exact configuration, commit and kernel).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Facts {
    /// Build commit under test, from FELIX_BENCH_COMMIT when the driver sets it.
    pub commit: Option<String>,
    /// Kernel release of the machine running felix-bench.
    pub kernel: Option<String>,
    pub hostname: Option<String>,
    /// CPU model of the machine running felix-bench (`model name` in /proc/cpuinfo).
    #[serde(default)]
    pub cpu_model: Option<String>,
    /// Seconds since the Unix epoch when the run was recorded.
    pub unix_time_s: u64,
}

impl Facts {
    /// Reads the facts of this machine (missing files leave fields empty; never fails).
    pub fn gather() -> Facts {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        Facts {
            commit: std::env::var("FELIX_BENCH_COMMIT")
                .ok()
                .filter(|s| !s.is_empty()),
            kernel: read("/proc/sys/kernel/osrelease"),
            hostname: read("/proc/sys/kernel/hostname"),
            cpu_model: std::fs::read_to_string("/proc/cpuinfo")
                .ok()
                .and_then(|t| cpu_model(&t)),
            unix_time_s: now_unix_s(),
        }
    }

    /// These facts with the time set to now (one record per run, same session facts).
    pub fn now(&self) -> Facts {
        Facts {
            unix_time_s: now_unix_s(),
            ..self.clone()
        }
    }
}

fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The first `model name` of a /proc/cpuinfo text.
pub fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

impl CellRecord {
    /// One human line: the cell's result or its error.
    pub fn result_line(&self) -> String {
        let head = format!(
            "{} trial {} arm {}",
            self.cell.label(),
            self.trial,
            self.arm.name
        );
        let Some(o) = &self.outputs else {
            return format!(
                "{head}: FAILED: {}",
                self.error.as_deref().unwrap_or("no outputs")
            );
        };
        let t = &o.throughput;
        let mut line = format!(
            "{head}: {:.1} MB/s payload, {:.0} rec/s, {:.2} cores, shed {:.2}%, {} s steady",
            t.payload_bytes_per_s / stats::BYTES_PER_MB,
            t.records_per_s,
            t.cpu_cores,
            o.shed.bytes_fraction * 100.0,
            t.points
        );
        if let Some(a) = &o.ack_latency {
            line.push_str(&format!(
                ", ack p50/p99/p999 {:.0}/{:.0}/{:.0} us",
                a.p50_us, a.p99_us, a.p999_us
            ));
        }
        if let Some(l) = &o.littles_law {
            line.push_str(&format!(" (Little {:.0} us)", l.wait_s_from_bytes * 1e6));
        }
        let refused: u64 = self.generators.iter().map(|g| g.refused_publishes).sum();
        if refused > 0 {
            line.push_str(&format!(", {refused} publishes refused"));
        }
        if let Some(d) = &o.delivery_latency {
            line.push_str(&format!(
                ", delivery p50/p99/p999 {:.0}/{:.0}/{:.0} us",
                d.p50_us, d.p99_us, d.p999_us
            ));
        }
        line
    }
}

/// What a cell produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellOutputs {
    pub throughput: Throughput,
    pub shed: Shed,
    /// Little's-law wait for acked cells (none for fire-and-forget: nothing is held in flight).
    pub littles_law: Option<LittlesLaw>,
    /// Kernel UDP receive-buffer drops over the whole cell.
    pub udp_rcvbuf_errors: u64,
    pub ack_latency: Option<LatencySummary>,
    pub delivery_latency: Option<LatencySummary>,
    /// What the server used of its CPUs (absent in records made before the pinned method).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerUse>,
}

/// The server's share of the cell: its CPUs, how many it used, and what a GB and a million
/// records cost it (src/pin.rs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServerUse {
    /// CPUs the server could run on: the pinned `server_cpus`, else every CPU the bench
    /// process could use (server and generator then share them).
    pub cpus: usize,
    /// Whether the server had CPUs of its own (the pinned method).
    pub pinned: bool,
    /// Median cores in use over the steady window (the throughput's `cpu_cores`).
    pub cores_used: f64,
    /// Cores used >= SERVER_BOUND_FRACTION of `cpus`: the server was the limit; otherwise the
    /// generator (or the disk, or pacing) was.
    pub server_bound: bool,
    /// Server CPU-seconds per 10^9 payload bytes accepted.
    pub cpu_seconds_per_gb: Option<f64>,
    /// Server CPU-seconds per million records accepted.
    pub cpu_seconds_per_million_records: Option<f64>,
}

impl ServerUse {
    /// From a cell's throughput and its server's CPU count.
    pub fn new(throughput: &Throughput, cpus: usize, pinned: bool) -> ServerUse {
        let cores_used = throughput.cpu_cores;
        ServerUse {
            cpus,
            pinned,
            cores_used,
            server_bound: crate::pin::server_bound(cores_used, cpus),
            cpu_seconds_per_gb: crate::pin::cpu_seconds_per_gb(
                cores_used,
                throughput.payload_bytes_per_s,
            ),
            cpu_seconds_per_million_records: crate::pin::cpu_seconds_per_million_records(
                cores_used,
                throughput.records_per_s,
            ),
        }
    }
}

/// One line of a results file: one cell x arm x trial with all inputs and outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellRecord {
    pub schema: u32,
    pub cell: Cell,
    pub arm: Arm,
    pub trial: u32,
    pub settings: Settings,
    pub facts: Facts,
    pub generators: Vec<GeneratorReport>,
    pub samples: Vec<Sample>,
    /// Present when the cell's numbers could be taken.
    pub outputs: Option<CellOutputs>,
    /// Why the numbers could not be taken (counter reset, too short a window, driver failure).
    pub error: Option<String>,
}

impl CellOutputs {
    /// Takes a cell's numbers from what a run recorded; `server_cpus` is how many CPUs the
    /// server could use and whether they were its own (pinned).
    pub fn compute(
        cell: &Cell,
        run: &CellRun,
        server_cpus: (usize, bool),
    ) -> Result<CellOutputs, BenchError> {
        let label = cell.label();
        let spans: Vec<Span> = run.generators.iter().map(|g| g.span).collect();
        let throughput = stats::cell_throughput(&label, &run.samples, &spans)?;
        // cell_throughput refused fewer than 2 samples and empty spans.
        let (first, last) = match (run.samples.first(), run.samples.last()) {
            (Some(f), Some(l)) => (f, l),
            _ => {
                return Err(BenchError::TooFewSamples {
                    cell: label,
                    samples: run.samples.len(),
                });
            }
        };
        let window = throughput.window.all_running;
        let first_start = spans.iter().map(|s| s.start_s).fold(f64::MAX, f64::min);
        let last_end = spans.iter().map(|s| s.end_s).fold(f64::MIN, f64::max);
        if first.t_s > first_start || last.t_s < last_end {
            return Err(BenchError::SamplesDoNotCover {
                cell: label,
                detail: format!(
                    "counter samples span [{}s, {}s] but generators ran [{first_start}s, {last_end}s] \
                     (all running [{}s, {}s]); the broker's accepted total would be partial",
                    first.t_s, last.t_s, window.start_s, window.end_s
                ),
            });
        }
        let sent = run
            .generators
            .iter()
            .fold(Counts::default(), |acc, g| Counts {
                bytes: acc.bytes.saturating_add(g.sent.bytes),
                records: acc.records.saturating_add(g.sent.records),
            });
        // rates() already refused any counter that went backwards, so these cannot underflow.
        let accepted = Counts {
            bytes: last.payload_bytes.saturating_sub(first.payload_bytes),
            records: last.records.saturating_sub(first.records),
        };
        let shed = stats::shed(&label, sent, accepted)?;
        let littles_law = match cell.shape.mode {
            Mode::Acked => Some(stats::littles_law(
                &label,
                cell.shape.outstanding(),
                throughput.payload_bytes_per_s,
                throughput.records_per_s,
            )?),
            Mode::FireAndForget => None,
        };
        let summary = |h: &Option<Histogram<u64>>| {
            h.as_ref()
                .and_then(|h| LatencySummary::from_histogram(h, LatencyUnit::Nanos))
        };
        Ok(CellOutputs {
            throughput,
            shed,
            littles_law,
            udp_rcvbuf_errors: last
                .udp_rcvbuf_errors
                .saturating_sub(first.udp_rcvbuf_errors),
            ack_latency: summary(&run.ack_latency_ns),
            delivery_latency: summary(&run.delivery_latency_ns),
            server: Some(ServerUse::new(&throughput, server_cpus.0, server_cpus.1)),
        })
    }
}

impl CellRecord {
    /// A record of a finished run; if its numbers cannot be taken the error is kept instead.
    pub fn from_run(
        settings: &Settings,
        cell: &Cell,
        arm: &Arm,
        trial: u32,
        facts: Facts,
        run: CellRun,
    ) -> CellRecord {
        let server_cpus = match &settings.server_cpus {
            Some(cpus) => (cpus.len(), true),
            None => (crate::pin::allowed_cpu_count(), false),
        };
        let (outputs, error) = match CellOutputs::compute(cell, &run, server_cpus) {
            Ok(o) => (Some(o), None),
            Err(e) => (None, Some(felix_storage::ErrorChain(&e).to_string())),
        };
        CellRecord {
            schema: RECORD_SCHEMA,
            cell: *cell,
            arm: arm.clone(),
            trial,
            settings: settings.clone(),
            facts,
            generators: run.generators,
            samples: run.samples,
            outputs,
            error,
        }
    }

    /// A record of a run the driver could not complete.
    pub fn failed(
        settings: &Settings,
        cell: &Cell,
        arm: &Arm,
        trial: u32,
        facts: Facts,
        error: &BenchError,
    ) -> CellRecord {
        CellRecord {
            schema: RECORD_SCHEMA,
            cell: *cell,
            arm: arm.clone(),
            trial,
            settings: settings.clone(),
            facts,
            generators: Vec::new(),
            samples: Vec::new(),
            outputs: None,
            error: Some(felix_storage::ErrorChain(error).to_string()),
        }
    }

    /// The record as one JSON line (no trailing newline).
    pub fn to_json_line(&self) -> Result<String, BenchError> {
        serde_json::to_string(self).map_err(BenchError::Serialize)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::plan::{Keys, Shape, StreamKind};

    /// A fixed run: one generator [1, 21] s sending `rate` B/s of 4 KiB records; counters every
    /// second from 0 to 22 s; the broker accepted all but `shed_bytes`.
    pub(crate) fn fixed_run(rate: u64, shed_bytes: u64) -> CellRun {
        let records_per_s = rate / 4096;
        let samples: Vec<Sample> = (0..=22u64)
            .map(|t| {
                let active = t.clamp(1, 21) - 1;
                Sample {
                    t_s: t as f64,
                    payload_bytes: rate * active,
                    append_bytes: (rate + 28 * records_per_s) * active,
                    wire_bytes: rate * 102 / 100 * active,
                    records: records_per_s * active,
                    cpu_seconds: 1.25 * t as f64,
                    udp_rcvbuf_errors: t / 10,
                    ..Sample::default()
                }
            })
            .collect();
        let mut ack = Histogram::<u64>::new(3).unwrap();
        for v in 1..=100u64 {
            ack.record(v * 10_000).unwrap();
        }
        CellRun {
            generators: vec![GeneratorReport {
                id: "g1".to_string(),
                span: Span {
                    start_s: 1.0,
                    end_s: 21.0,
                },
                sent: Counts {
                    bytes: rate * 20 + shed_bytes,
                    records: records_per_s * 20 + shed_bytes / 4096,
                },
                refused_publishes: 0,
            }],
            samples,
            ack_latency_ns: Some(ack),
            delivery_latency_ns: None,
        }
    }

    pub(crate) fn cell(number: usize, kind: StreamKind, mode: Mode, in_flight: u32) -> Cell {
        Cell {
            number,
            shape: Shape {
                kind,
                payload_bytes: 4096,
                batch: 64,
                mode,
                publishers: 4,
                in_flight,
                keys: Keys::Spread,
                duration_s: 20,
                measure: crate::plan::Measure::Throughput,
            },
        }
    }

    pub(crate) fn settings() -> Settings {
        Settings {
            broker: "127.0.0.1:5000".to_string(),
            duration_s: 20,
            trials: 2,
            warmup_s: 0,
            shards: crate::plan::DEFAULT_SHARDS,
            server_cpus: None,
            generator_cpus: None,
        }
    }

    pub(crate) fn arm(name: &str) -> Arm {
        Arm::felix(name, Default::default())
    }

    #[test]
    fn outputs_from_a_fixed_run() {
        // Proves a run's record carries throughput, shed, Little's law, drops and latency taken from its samples.
        let c = cell(1, StreamKind::InMemory, Mode::Acked, 16);
        let run = fixed_run(409_600_000, 4096 * 10);
        let o = CellOutputs::compute(&c, &run, (2, false)).unwrap();
        assert_eq!(o.throughput.payload_bytes_per_s, 409_600_000.0);
        assert_eq!(o.throughput.cpu_cores, 1.25);
        let server = o.server.unwrap();
        assert_eq!(
            (server.cpus, server.pinned, server.cores_used),
            (2, false, 1.25)
        );
        assert!(!server.server_bound, "1.25 of 2 cores is not server-bound");
        let per_gb = server.cpu_seconds_per_gb.unwrap();
        assert!((per_gb - 1.25 / 0.4096).abs() < 1e-9, "{per_gb}");
        let per_million = server.cpu_seconds_per_million_records.unwrap();
        assert!((per_million - 1.25 / 0.1).abs() < 1e-9, "{per_million}");
        let pinned = CellOutputs::compute(&c, &run, (1, true))
            .unwrap()
            .server
            .unwrap();
        assert!(
            pinned.server_bound,
            "1.25 cores of 1 pinned CPU is server-bound"
        );
        assert_eq!(o.shed.shed.bytes, 40960);
        assert_eq!(o.shed.shed.records, 10);
        assert_eq!(o.udp_rcvbuf_errors, 2);
        let l = o.littles_law.unwrap();
        let outstanding = 4.0 * 16.0 * 64.0 * 4096.0;
        assert!((l.wait_s_from_bytes - outstanding / 409_600_000.0).abs() < 1e-12);
        let ack = o.ack_latency.unwrap();
        assert_eq!(ack.count, 100);
        assert!((ack.p50_us - 500.0).abs() <= 1.0, "{}", ack.p50_us);
        let ff = cell(2, StreamKind::InMemory, Mode::FireAndForget, 1);
        assert!(
            CellOutputs::compute(&ff, &run, (2, false))
                .unwrap()
                .littles_law
                .is_none()
        );
    }

    #[test]
    fn record_round_trips_and_keeps_errors() {
        // Proves a record survives JSON and a counter reset is recorded as the cell's error, not as numbers.
        let c = cell(3, StreamKind::Durable, Mode::Acked, 64);
        let rec = CellRecord::from_run(
            &settings(),
            &c,
            &arm("a"),
            1,
            Facts::default(),
            fixed_run(1_000_000, 0),
        );
        assert!(rec.error.is_none());
        let back: CellRecord = serde_json::from_str(&rec.to_json_line().unwrap()).unwrap();
        assert_eq!(back, rec);

        let mut broken = fixed_run(1_000_000, 0);
        broken.samples[5].payload_bytes = 0;
        let rec = CellRecord::from_run(&settings(), &c, &arm("a"), 1, Facts::default(), broken);
        assert!(rec.outputs.is_none());
        let e = rec.error.unwrap();
        assert!(
            e.contains("cell 3 (durable") && e.contains("payload_bytes"),
            "{e}"
        );
    }

    #[test]
    fn samples_must_cover_the_generators() {
        // Proves a run whose last sample precedes a generator's end is refused (shed would be wrong).
        let c = cell(1, StreamKind::InMemory, Mode::Acked, 1);
        let mut run = fixed_run(1_000_000, 0);
        run.samples.truncate(21); // last sample at 20 s, generator ends at 21 s
        assert!(matches!(
            CellOutputs::compute(&c, &run, (2, false)),
            Err(BenchError::SamplesDoNotCover { .. })
        ));
    }
}
