//! Reports from cell records: `cells.csv`, `summary.md` and charts (PNG and SVG).
//!
//! - `cells.csv`: one `trial` row per cell x arm x trial, then one `median` row per cell x arm
//!   (median of the finished trials, with min and max).
//! - `summary.md`: median of trials with the min-max range where trials differ by more than
//!   0.5% (as the reference prints them), shed, CPU cores, and the Little's-law prediction next to
//!   the measured ack p50 where latency was recorded; failed runs are listed.
//! - `throughput.{png,svg}`: payload MB/s by shape, bars = median, whiskers = trial min-max, one
//!   colour per arm.
//! - `latency.{png,svg}`: ack p50 against requests in flight per publisher (log-log), measured
//!   points joined per arm and shape, Little's-law predictions as crosses.
//!
//! Text in charts is drawn with plotters' `ab_glyph` from one TTF file (DejaVu Sans from
//! Debian's `fonts-dejavu-core` by default), so no system font lookup is involved.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontTransform;

use crate::BenchError;
use crate::cell::CellRecord;
use crate::plan::{Mode, Shape};
use crate::stats::{BYTES_PER_MB, TrialSpread, aggregate_trials};

/// Where Debian's `fonts-dejavu-core` puts DejaVu Sans.
pub const DEFAULT_FONT_PATH: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// The reference prints a range after a median only "where trials differ by more than half a
/// percent"; below that the range is noise not worth the width.
pub const RANGE_SHOWN_ABOVE: f64 = 0.005;

/// Largest font file accepted: DejaVu Sans is ~750 KB; 32 MiB bounds a wrong path to a big file.
const FONT_BYTES_MAX: u64 = 32 * 1024 * 1024;

/// Chart size in pixels. 1200 x 700 reads on a laptop screen and in a docs page.
const CHART_HEIGHT_PX: u32 = 700;
const CHART_WIDTH_PX_MIN: u32 = 1200;
/// Horizontal room per bar in the throughput chart, so many shapes widen the chart instead of
/// squeezing bars below a readable width.
const BAR_SLOT_PX: u32 = 28;

/// Arm and series colours (Tableau 10: distinguishable, also in grey-scale print).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Options of a report.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// TTF font for chart text.
    pub font_path: PathBuf,
}

impl Default for ReportOptions {
    fn default() -> Self {
        ReportOptions {
            font_path: PathBuf::from(DEFAULT_FONT_PATH),
        }
    }
}

/// The files a report wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportFiles {
    pub csv: PathBuf,
    pub summary: PathBuf,
    pub charts: Vec<PathBuf>,
}

/// Reads every `*.jsonl` file in `dir` (sorted by name), one record per non-empty line.
pub fn read_records(dir: &Path) -> Result<Vec<CellRecord>, BenchError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| BenchError::io(dir, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl") && p.is_file())
        .collect();
    files.sort();
    let mut records = Vec::new();
    for path in files {
        let file = std::fs::File::open(&path).map_err(|e| BenchError::io(&path, e))?;
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|e| BenchError::io(&path, e))?;
            if line.trim().is_empty() {
                continue;
            }
            let record = serde_json::from_str(&line).map_err(|source| BenchError::Record {
                path: path.clone(),
                line: i + 1,
                source,
            })?;
            records.push(record);
        }
    }
    Ok(records)
}

/// One cell x arm over its trials.
#[derive(Debug, Clone, PartialEq)]
pub struct Aggregate {
    pub shape: Shape,
    /// The cell number of the first record seen for this shape.
    pub cell_number: usize,
    pub arm: String,
    /// Trials recorded, finished or not.
    pub trials_run: usize,
    pub payload_bytes_per_s: Option<TrialSpread>,
    pub append_bytes_per_s: Option<TrialSpread>,
    pub wire_bytes_per_s: Option<TrialSpread>,
    pub records_per_s: Option<TrialSpread>,
    pub cpu_cores: Option<TrialSpread>,
    pub shed_bytes: Option<TrialSpread>,
    pub shed_fraction: Option<TrialSpread>,
    pub udp_rcvbuf_errors: Option<TrialSpread>,
    pub ack_p50_us: Option<TrialSpread>,
    pub ack_p99_us: Option<TrialSpread>,
    pub ack_p999_us: Option<TrialSpread>,
    pub delivery_p50_us: Option<TrialSpread>,
    pub delivery_p99_us: Option<TrialSpread>,
    /// Broker context switches per second and per accepted record (all its threads).
    pub ctx_switches_per_s: Option<TrialSpread>,
    pub ctx_switches_per_record: Option<TrialSpread>,
    /// Little's-law wait (bytes terms), seconds.
    pub littles_wait_s: Option<TrialSpread>,
    /// The server's CPUs (src/pin.rs) and whether they were its own, from the first finished
    /// trial that recorded them.
    pub server_cpus: Option<(usize, bool)>,
    /// Server CPU-seconds per GB and per million records.
    pub cpu_seconds_per_gb: Option<TrialSpread>,
    pub cpu_seconds_per_million_records: Option<TrialSpread>,
    /// Finished trials in which the server was the limit (used >= 95% of its CPUs).
    pub server_bound_trials: usize,
    /// Errors of the trials that did not finish, as "trial N: message".
    pub errors: Vec<String>,
}

impl Aggregate {
    /// Trials whose numbers were taken.
    pub fn trials_finished(&self) -> usize {
        self.trials_run - self.errors.len()
    }

    /// `server` when the broker used >= 95% of its CPUs in every finished trial, `generator`
    /// when in none, `mixed` otherwise; `–` without CPU figures.
    pub fn limit(&self) -> &'static str {
        if self.server_cpus.is_none() {
            return "–";
        }
        crate::pin::limit_label(self.server_bound_trials, self.trials_finished()).unwrap_or("–")
    }
}

/// Groups records by shape and arm (first-seen order) and aggregates each figure over trials.
pub fn aggregate(records: &[CellRecord]) -> Vec<Aggregate> {
    let mut order: Vec<(Shape, String)> = Vec::new();
    let mut groups: BTreeMap<(Shape, String), Vec<&CellRecord>> = BTreeMap::new();
    for r in records {
        let key = (r.cell.shape, r.arm.name.clone());
        if !groups.contains_key(&key) {
            order.push(key.clone());
        }
        groups.entry(key).or_default().push(r);
    }
    order
        .into_iter()
        .map(|key| {
            let recs = &groups[&key];
            let outs: Vec<_> = recs.iter().filter_map(|r| r.outputs.as_ref()).collect();
            let spread = |f: &dyn Fn(&crate::cell::CellOutputs) -> Option<f64>| {
                let values: Vec<f64> = outs.iter().filter_map(|o| f(o)).collect();
                aggregate_trials(&values)
            };
            Aggregate {
                shape: key.0,
                cell_number: recs[0].cell.number,
                arm: key.1.clone(),
                trials_run: recs.len(),
                payload_bytes_per_s: spread(&|o| Some(o.throughput.payload_bytes_per_s)),
                append_bytes_per_s: spread(&|o| Some(o.throughput.append_bytes_per_s)),
                wire_bytes_per_s: spread(&|o| Some(o.throughput.wire_bytes_per_s)),
                records_per_s: spread(&|o| Some(o.throughput.records_per_s)),
                cpu_cores: spread(&|o| Some(o.throughput.cpu_cores)),
                shed_bytes: spread(&|o| Some(o.shed.shed.bytes as f64)),
                shed_fraction: spread(&|o| Some(o.shed.bytes_fraction)),
                udp_rcvbuf_errors: spread(&|o| Some(o.udp_rcvbuf_errors as f64)),
                ack_p50_us: spread(&|o| o.ack_latency.map(|l| l.p50_us)),
                ack_p99_us: spread(&|o| o.ack_latency.map(|l| l.p99_us)),
                ack_p999_us: spread(&|o| o.ack_latency.map(|l| l.p999_us)),
                delivery_p50_us: spread(&|o| o.delivery_latency.map(|l| l.p50_us)),
                delivery_p99_us: spread(&|o| o.delivery_latency.map(|l| l.p99_us)),
                ctx_switches_per_s: spread(&|o| Some(o.throughput.ctx_switches_per_s)),
                ctx_switches_per_record: spread(&|o| Some(o.throughput.ctx_switches_per_record())),
                littles_wait_s: spread(&|o| o.littles_law.map(|l| l.wait_s_from_bytes)),
                server_cpus: outs
                    .iter()
                    .find_map(|o| o.server.map(|u| (u.cpus, u.pinned))),
                cpu_seconds_per_gb: spread(&|o| o.server.and_then(|u| u.cpu_seconds_per_gb)),
                cpu_seconds_per_million_records: spread(&|o| {
                    o.server.and_then(|u| u.cpu_seconds_per_million_records)
                }),
                server_bound_trials: outs
                    .iter()
                    .filter(|o| o.server.is_some_and(|u| u.server_bound))
                    .count(),
                errors: recs
                    .iter()
                    .filter_map(|r| r.error.as_ref().map(|e| format!("trial {}: {e}", r.trial)))
                    .collect(),
            }
        })
        .collect()
}

/// Writes `cells.csv`, `summary.md` and the charts into `out`.
pub fn write_report(
    records: &[CellRecord],
    out: &Path,
    options: &ReportOptions,
) -> Result<ReportFiles, BenchError> {
    std::fs::create_dir_all(out).map_err(|e| BenchError::io(out, e))?;
    let aggregates = aggregate(records);
    let csv = out.join("cells.csv");
    write_csv(records, &aggregates, &csv)?;
    let mut charts = Vec::new();
    if aggregates.iter().any(|a| a.payload_bytes_per_s.is_some()) {
        load_font(&options.font_path)?;
        charts.extend(throughput_charts(&aggregates, out)?);
        if !latency_series(&aggregates).is_empty() {
            charts.extend(latency_charts(&aggregates, out)?);
        }
    }
    let summary = out.join("summary.md");
    let text = summary_markdown(records, &aggregates, &charts);
    std::fs::write(&summary, text).map_err(|e| BenchError::io(&summary, e))?;
    Ok(ReportFiles {
        csv,
        summary,
        charts,
    })
}

// ---- CSV --------------------------------------------------------------------------------------

const CSV_HEADER: [&str; 43] = [
    "row",
    "cell",
    "shape",
    "kind",
    "payload_bytes",
    "batch",
    "mode",
    "publishers",
    "in_flight",
    "keys",
    "duration_s",
    "arm",
    "trial",
    "trials",
    "payload_mb_s",
    "payload_mb_s_min",
    "payload_mb_s_max",
    "append_mb_s",
    "wire_mb_s",
    "records_per_s",
    "cpu_cores",
    "shed_bytes",
    "shed_fraction",
    "udp_rcvbuf_errors",
    "ack_p50_us",
    "ack_p99_us",
    "ack_p999_us",
    "delivery_p50_us",
    "delivery_p99_us",
    "littles_wait_ms",
    "ctx_switches_per_s",
    "ctx_switches_per_record",
    "server_cpus",
    "server_pinned",
    "server_cpu_s_per_gb",
    "server_cpu_s_per_million_records",
    "limit",
    "steady_points",
    "commit",
    "kernel",
    "arm_env",
    "trials_failed",
    "error",
];

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(String::new, |v| format!("{v:.decimals$}"))
}

fn shape_columns(shape: &Shape) -> [String; 9] {
    [
        shape.to_string(),
        shape.kind.as_str().to_string(),
        shape.payload_bytes.to_string(),
        shape.batch.to_string(),
        shape.mode.as_str().to_string(),
        shape.publishers.to_string(),
        shape.in_flight.to_string(),
        shape.keys.as_str().to_string(),
        shape.duration_s.to_string(),
    ]
}

fn write_csv(
    records: &[CellRecord],
    aggregates: &[Aggregate],
    path: &Path,
) -> Result<(), BenchError> {
    let csv_err = |source| BenchError::Csv {
        path: path.to_path_buf(),
        source,
    };
    let mut w = csv::Writer::from_path(path).map_err(csv_err)?;
    w.write_record(CSV_HEADER).map_err(csv_err)?;
    for r in records {
        let o = r.outputs.as_ref();
        let t = o.map(|o| &o.throughput);
        let mut row: Vec<String> = vec!["trial".into(), r.cell.number.to_string()];
        row.extend(shape_columns(&r.cell.shape));
        row.extend([
            r.arm.name.clone(),
            r.trial.to_string(),
            String::new(),
            opt(t.map(|t| t.payload_bytes_per_s / BYTES_PER_MB), 3),
            String::new(),
            String::new(),
            opt(t.map(|t| t.append_bytes_per_s / BYTES_PER_MB), 3),
            opt(t.map(|t| t.wire_bytes_per_s / BYTES_PER_MB), 3),
            opt(t.map(|t| t.records_per_s), 1),
            opt(t.map(|t| t.cpu_cores), 3),
            o.map_or_else(String::new, |o| o.shed.shed.bytes.to_string()),
            opt(o.map(|o| o.shed.bytes_fraction), 6),
            o.map_or_else(String::new, |o| o.udp_rcvbuf_errors.to_string()),
            opt(o.and_then(|o| o.ack_latency).map(|l| l.p50_us), 1),
            opt(o.and_then(|o| o.ack_latency).map(|l| l.p99_us), 1),
            opt(o.and_then(|o| o.ack_latency).map(|l| l.p999_us), 1),
            opt(o.and_then(|o| o.delivery_latency).map(|l| l.p50_us), 1),
            opt(o.and_then(|o| o.delivery_latency).map(|l| l.p99_us), 1),
            opt(
                o.and_then(|o| o.littles_law)
                    .map(|l| l.wait_s_from_bytes * 1e3),
                3,
            ),
            opt(t.map(|t| t.ctx_switches_per_s), 1),
            opt(t.map(|t| t.ctx_switches_per_record()), 4),
            o.and_then(|o| o.server)
                .map_or_else(String::new, |u| u.cpus.to_string()),
            o.and_then(|o| o.server)
                .map_or_else(String::new, |u| u.pinned.to_string()),
            opt(
                o.and_then(|o| o.server).and_then(|u| u.cpu_seconds_per_gb),
                4,
            ),
            opt(
                o.and_then(|o| o.server)
                    .and_then(|u| u.cpu_seconds_per_million_records),
                4,
            ),
            o.and_then(|o| o.server).map_or_else(String::new, |u| {
                if u.server_bound {
                    "server"
                } else {
                    "generator"
                }
                .to_string()
            }),
            t.map_or_else(String::new, |t| t.points.to_string()),
            r.facts.commit.clone().unwrap_or_default(),
            r.facts.kernel.clone().unwrap_or_default(),
            r.arm
                .env
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" "),
            String::new(),
            r.error.clone().unwrap_or_default(),
        ]);
        debug_assert_eq!(row.len(), CSV_HEADER.len());
        w.write_record(&row).map_err(csv_err)?;
    }
    for a in aggregates {
        let med =
            |s: Option<TrialSpread>, scale: f64, d: usize| opt(s.map(|s| s.median / scale), d);
        let mut row: Vec<String> = vec!["median".into(), a.cell_number.to_string()];
        row.extend(shape_columns(&a.shape));
        row.extend([
            a.arm.clone(),
            String::new(),
            a.trials_finished().to_string(),
            med(a.payload_bytes_per_s, BYTES_PER_MB, 3),
            opt(a.payload_bytes_per_s.map(|s| s.min / BYTES_PER_MB), 3),
            opt(a.payload_bytes_per_s.map(|s| s.max / BYTES_PER_MB), 3),
            med(a.append_bytes_per_s, BYTES_PER_MB, 3),
            med(a.wire_bytes_per_s, BYTES_PER_MB, 3),
            med(a.records_per_s, 1.0, 1),
            med(a.cpu_cores, 1.0, 3),
            med(a.shed_bytes, 1.0, 0),
            med(a.shed_fraction, 1.0, 6),
            med(a.udp_rcvbuf_errors, 1.0, 0),
            med(a.ack_p50_us, 1.0, 1),
            med(a.ack_p99_us, 1.0, 1),
            med(a.ack_p999_us, 1.0, 1),
            med(a.delivery_p50_us, 1.0, 1),
            med(a.delivery_p99_us, 1.0, 1),
            med(a.littles_wait_s, 1e-3, 3),
            med(a.ctx_switches_per_s, 1.0, 1),
            med(a.ctx_switches_per_record, 1.0, 4),
            a.server_cpus
                .map_or_else(String::new, |(n, _)| n.to_string()),
            a.server_cpus
                .map_or_else(String::new, |(_, pinned)| pinned.to_string()),
            med(a.cpu_seconds_per_gb, 1.0, 4),
            med(a.cpu_seconds_per_million_records, 1.0, 4),
            a.limit().to_string(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            a.errors.len().to_string(),
            a.errors.join("; "),
        ]);
        debug_assert_eq!(row.len(), CSV_HEADER.len());
        w.write_record(&row).map_err(csv_err)?;
    }
    w.flush().map_err(|e| BenchError::io(path, e))
}

// ---- summary.md -------------------------------------------------------------------------------

/// "4400 (4380-4420)" when trials differ by more than [`RANGE_SHOWN_ABOVE`], else "4400".
fn with_range(s: &TrialSpread, scale: f64, decimals: usize) -> String {
    let m = s.median / scale;
    if s.trials > 1 && s.relative_range() > RANGE_SHOWN_ABOVE {
        format!(
            "{m:.decimals$} ({:.decimals$}–{:.decimals$})",
            s.min / scale,
            s.max / scale
        )
    } else {
        format!("{m:.decimals$}")
    }
}

fn cell_or_dash(s: Option<TrialSpread>, scale: f64, decimals: usize) -> String {
    s.map_or_else(|| "–".to_string(), |s| with_range(&s, scale, decimals))
}

/// 1.07e9 -> "1.07 GB", 4096 -> "4.10 kB" (decimal units, like MB/s).
fn human_decimal_bytes(b: f64) -> String {
    const UNITS: [(&str, f64); 4] = [("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0)];
    for (unit, size) in UNITS {
        if b >= size {
            return format!("{:.2} {unit}", b / size);
        }
    }
    format!("{b:.0} B")
}

/// 250 -> "250 µs", 1500 -> "1.50 ms", 2.4e6 -> "2.40 s".
fn human_us(us: f64) -> String {
    if us >= 1e6 {
        format!("{:.2} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{us:.0} µs")
    }
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn summary_markdown(
    records: &[CellRecord],
    aggregates: &[Aggregate],
    charts: &[PathBuf],
) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let failed = records.iter().filter(|r| r.error.is_some()).count();
    let distinct = |f: &dyn Fn(&CellRecord) -> Option<String>| {
        let mut v: Vec<String> = records.iter().filter_map(f).collect();
        v.sort();
        v.dedup();
        if v.is_empty() {
            "not recorded".to_string()
        } else {
            v.join(", ")
        }
    };
    // Writing to a String cannot fail; the fmt::Result is ignored on purpose below.
    let _ = writeln!(s, "# Felix bench summary\n");
    let _ = writeln!(
        s,
        "{} runs ({failed} failed) of {} cell x arm pairs. Commit: {}. Kernel: {}.\n",
        records.len(),
        aggregates.len(),
        distinct(&|r| r.facts.commit.clone()),
        distinct(&|r| r.facts.kernel.clone()),
    );
    let _ = writeln!(
        s,
        "Throughput is measured at the broker: the median one-second rate over the steady window \
         (all generators running, less the first and last 10%). Each figure is the median of the \
         finished trials; where trials differ by more than 0.5% the min–max range follows in \
         parentheses. MB = 10^6 bytes. Payload excludes shed publishes; append is payload plus \
         log framing; CPU is broker cores in use; context switches (ctx sw) are the broker \
         process's, all threads, from /proc/<pid>/task/*/status. Server CPUs: the CPUs the broker \
         could use (\"pinned\": its own, the load generator elsewhere; otherwise shared with the \
         generator); CPU-s/GB and CPU-s/M rec: broker CPU-seconds per 10^9 payload bytes and per \
         million records; Limit: \"server\" when the broker used at least 95% of its CPUs in \
         every finished trial, else \"generator\" (the load generator, the disk or pacing held \
         the rate; \"mixed\" when trials differ).\n"
    );
    let _ = writeln!(s, "## Throughput\n");
    let _ = writeln!(
        s,
        "| Cell | Shape | Arm | Trials | Payload MB/s | Append MB/s | msg/s | CPU cores | Server CPUs | CPU-s/GB | CPU-s/M rec | Limit | Ctx sw/s | Ctx sw/rec | Shed |"
    );
    let _ = writeln!(
        s,
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
    );
    for a in aggregates {
        let shed = match (a.shed_fraction, a.shed_bytes) {
            (Some(f), Some(b)) if b.median > 0.0 => format!(
                "{:.3}% ({})",
                f.median * 100.0,
                human_decimal_bytes(b.median)
            ),
            (Some(_), Some(_)) => "0".to_string(),
            _ => "–".to_string(),
        };
        let server_cpus = match a.server_cpus {
            Some((n, true)) => format!("{n} pinned"),
            Some((n, false)) => format!("{n} shared"),
            None => "–".to_string(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            a.cell_number,
            a.shape,
            md_escape(&a.arm),
            a.trials_finished(),
            a.trials_run,
            cell_or_dash(a.payload_bytes_per_s, BYTES_PER_MB, 1),
            cell_or_dash(a.append_bytes_per_s, BYTES_PER_MB, 1),
            cell_or_dash(a.records_per_s, 1.0, 0),
            cell_or_dash(a.cpu_cores, 1.0, 2),
            server_cpus,
            cell_or_dash(a.cpu_seconds_per_gb, 1.0, 2),
            cell_or_dash(a.cpu_seconds_per_million_records, 1.0, 3),
            a.limit(),
            cell_or_dash(a.ctx_switches_per_s, 1.0, 0),
            cell_or_dash(a.ctx_switches_per_record, 1.0, 3),
            shed,
        );
    }
    let latency: Vec<&Aggregate> = aggregates
        .iter()
        .filter(|a| a.ack_p50_us.is_some())
        .collect();
    if !latency.is_empty() {
        let _ = writeln!(s, "\n## Latency and Little's law\n");
        let _ = writeln!(
            s,
            "Little's law predicts the ack wait of an acked cell from throughput alone: bytes \
             outstanding (publishers × in flight × batch × payload) ÷ payload throughput. A \
             measured p50 close to it means the time is queueing the load generator chose, not \
             service time.\n"
        );
        let _ = writeln!(
            s,
            "| Cell | Shape | Arm | Outstanding | Little's law | Ack p50 | Ack p99 | Ack p999 | Delivery p50 |"
        );
        let _ = writeln!(s, "|---:|---|---|---:|---:|---:|---:|---:|---:|");
        for a in latency {
            let outstanding = if a.shape.mode == Mode::Acked {
                human_decimal_bytes(a.shape.outstanding().bytes as f64)
            } else {
                "–".to_string()
            };
            let us =
                |v: Option<TrialSpread>| v.map_or_else(|| "–".to_string(), |v| human_us(v.median));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                a.cell_number,
                a.shape,
                md_escape(&a.arm),
                outstanding,
                a.littles_wait_s
                    .map_or_else(|| "–".to_string(), |w| human_us(w.median * 1e6)),
                us(a.ack_p50_us),
                us(a.ack_p99_us),
                us(a.ack_p999_us),
                us(a.delivery_p50_us),
            );
        }
    }
    s.push_str(&crate::pairs::pairs_markdown(&crate::pairs::match_pairs(
        records,
    )));
    let failures: Vec<&CellRecord> = records.iter().filter(|r| r.error.is_some()).collect();
    if !failures.is_empty() {
        let _ = writeln!(s, "\n## Failed runs\n");
        for r in failures {
            let _ = writeln!(
                s,
                "- arm {} trial {}: {}",
                md_escape(&r.arm.name),
                r.trial,
                md_escape(r.error.as_deref().unwrap_or_default())
            );
        }
    }
    if !charts.is_empty() {
        let _ = writeln!(s, "\n## Charts\n");
        for c in charts
            .iter()
            .filter(|c| c.extension().is_some_and(|e| e == "png"))
        {
            if let Some(name) = c.file_name().and_then(|n| n.to_str()) {
                let _ = writeln!(s, "![{name}]({name})\n");
            }
        }
    }
    s
}

// ---- charts -----------------------------------------------------------------------------------

/// Whether a font has been registered with plotters in this process.
static FONT_REGISTERED: Mutex<bool> = Mutex::new(false);

/// Registers the TTF at `path` as plotters' "sans-serif" (once per process; later calls keep
/// the first font).
pub fn load_font(path: &Path) -> Result<(), BenchError> {
    let mut registered = FONT_REGISTERED.lock().unwrap_or_else(|p| p.into_inner());
    if *registered {
        return Ok(());
    }
    let bytes = read_font_file(path)?;
    // plotters keeps fonts for the life of the process and wants &'static bytes; this leak
    // happens at most once per process (guarded by FONT_REGISTERED).
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| {
        BenchError::Font {
            path: path.to_path_buf(),
            detail: "not a TrueType/OpenType font".to_string(),
        }
    })?;
    *registered = true;
    Ok(())
}

/// Reads a font file, bounded by [`FONT_BYTES_MAX`].
fn read_font_file(path: &Path) -> Result<Vec<u8>, BenchError> {
    let font_err = |detail: String| BenchError::Font {
        path: path.to_path_buf(),
        detail,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| font_err(e.to_string()))?
        .len();
    if len > FONT_BYTES_MAX {
        return Err(font_err(format!(
            "{len} bytes is larger than {FONT_BYTES_MAX}; not a font"
        )));
    }
    std::fs::read(path).map_err(|e| font_err(e.to_string()))
}

fn chart_err(path: &Path) -> impl Fn(String) -> BenchError + '_ {
    move |detail| BenchError::Chart {
        path: path.to_path_buf(),
        detail,
    }
}

fn de<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Bars of the throughput chart, by shape then arm.
struct ThroughputData {
    shapes: Vec<(Shape, usize)>,
    arms: Vec<String>,
    /// (shape index, arm index, spread in MB/s)
    bars: Vec<(usize, usize, TrialSpread)>,
}

fn throughput_data(aggregates: &[Aggregate]) -> ThroughputData {
    let mut shapes: Vec<(Shape, usize)> = Vec::new();
    let mut arms: Vec<String> = Vec::new();
    let mut bars = Vec::new();
    for a in aggregates {
        let Some(p) = a.payload_bytes_per_s else {
            continue;
        };
        let si = shapes
            .iter()
            .position(|(s, _)| *s == a.shape)
            .unwrap_or_else(|| {
                shapes.push((a.shape, a.cell_number));
                shapes.len() - 1
            });
        let ai = arms.iter().position(|n| *n == a.arm).unwrap_or_else(|| {
            arms.push(a.arm.clone());
            arms.len() - 1
        });
        let mb = TrialSpread {
            median: p.median / BYTES_PER_MB,
            min: p.min / BYTES_PER_MB,
            max: p.max / BYTES_PER_MB,
            trials: p.trials,
        };
        bars.push((si, ai, mb));
    }
    ThroughputData { shapes, arms, bars }
}

fn throughput_charts(aggregates: &[Aggregate], out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    let data = throughput_data(aggregates);
    let slots = data.shapes.len() * (data.arms.len() + 1);
    let width = CHART_WIDTH_PX_MIN.max(200 + BAR_SLOT_PX * slots as u32);
    let size = (width, CHART_HEIGHT_PX);
    let png = out.join("throughput.png");
    let svg = out.join("throughput.svg");
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        draw_throughput(&root, &data).map_err(chart_err(&png))?;
        root.present().map_err(de).map_err(chart_err(&png))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw_throughput(&root, &data).map_err(chart_err(&svg))?;
        root.present().map_err(de).map_err(chart_err(&svg))?;
    }
    Ok(vec![png, svg])
}

fn draw_throughput<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    data: &ThroughputData,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(de)?;
    let arms = data.arms.len().max(1);
    let slot = arms + 1; // one gap slot between shapes
    let x_max = (data.shapes.len() * slot) as f64;
    let y_max = data
        .bars
        .iter()
        .map(|(_, _, s)| s.max)
        .fold(0.0_f64, f64::max)
        .max(1.0)
        * 1.1;
    let mut chart = ChartBuilder::on(root)
        .caption(
            "Payload throughput by shape (bars: median of trials, whiskers: min–max)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(190)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(de)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("payload MB/s (median of one-second rates, steady window)")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(de)?;
    for (ai, arm) in data.arms.iter().enumerate() {
        let color = PALETTE[ai % PALETTE.len()];
        let bars: Vec<(f64, &TrialSpread)> = data
            .bars
            .iter()
            .filter(|(_, a, _)| *a == ai)
            .map(|(si, _, s)| ((si * slot + ai) as f64 + 0.5, s))
            .collect();
        chart
            .draw_series(bars.iter().map(|(x, s)| {
                Rectangle::new([(x - 0.45, 0.0), (x + 0.45, s.median)], color.filled())
            }))
            .map_err(de)?
            .label(arm.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
        for (x, s) in &bars {
            if s.trials < 2 {
                continue;
            }
            let whisker = [
                vec![(*x, s.min), (*x, s.max)],
                vec![(x - 0.2, s.min), (x + 0.2, s.min)],
                vec![(x - 0.2, s.max), (x + 0.2, s.max)],
            ];
            chart
                .draw_series(
                    whisker
                        .into_iter()
                        .map(|pts| PathElement::new(pts, BLACK.stroke_width(2))),
                )
                .map_err(de)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(de)?;
    // Shape labels, rotated, under each group of bars (drawn on the root: the plotting area clips).
    let label_style = ("sans-serif", 14)
        .into_font()
        .transform(FontTransform::Rotate90)
        .color(&BLACK);
    for (si, (shape, number)) in data.shapes.iter().enumerate() {
        let center = (si * slot) as f64 + arms as f64 / 2.0;
        let (px, py) = chart.backend_coord(&(center, 0.0));
        let text = format!("{number}: {}", shape.short_label());
        root.draw(&Text::new(text, (px - 7, py + 10), label_style.clone()))
            .map_err(de)?;
    }
    Ok(())
}

/// One line of the latency chart: an arm and a shape with in_flight varying.
struct LatencySeries {
    label: String,
    /// (in flight per publisher, measured p50 us, Little's-law prediction us)
    points: Vec<(f64, f64, Option<f64>)>,
}

fn latency_series(aggregates: &[Aggregate]) -> Vec<LatencySeries> {
    let mut keyed: Vec<((String, Shape), LatencySeries)> = Vec::new();
    for a in aggregates {
        let Some(p50) = a.ack_p50_us else {
            continue;
        };
        if a.shape.mode != Mode::Acked || p50.median <= 0.0 {
            continue;
        }
        let key = (
            a.arm.clone(),
            Shape {
                in_flight: 0,
                ..a.shape
            },
        );
        let point = (
            f64::from(a.shape.in_flight),
            p50.median,
            a.littles_wait_s
                .map(|w| w.median * 1e6)
                .filter(|w| *w > 0.0),
        );
        match keyed.iter_mut().find(|(k, _)| *k == key) {
            Some((_, series)) => series.points.push(point),
            None => {
                let s = a.shape;
                let label = format!(
                    "{}: {} {}B b{} p{}",
                    a.arm,
                    s.kind.as_str(),
                    s.payload_bytes,
                    s.batch,
                    s.publishers
                );
                keyed.push((
                    key,
                    LatencySeries {
                        label,
                        points: vec![point],
                    },
                ));
            }
        }
    }
    keyed
        .into_iter()
        .map(|(_, mut s)| {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
            s
        })
        .collect()
}

fn latency_charts(aggregates: &[Aggregate], out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    let series = latency_series(aggregates);
    let size = (CHART_WIDTH_PX_MIN, CHART_HEIGHT_PX);
    let png = out.join("latency.png");
    let svg = out.join("latency.svg");
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        draw_latency(&root, &series).map_err(chart_err(&png))?;
        root.present().map_err(de).map_err(chart_err(&png))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw_latency(&root, &series).map_err(chart_err(&svg))?;
        root.present().map_err(de).map_err(chart_err(&svg))?;
    }
    Ok(vec![png, svg])
}

fn draw_latency<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    series: &[LatencySeries],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(de)?;
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let ys = series
        .iter()
        .flat_map(|s| s.points.iter().flat_map(|p| [Some(p.1), p.2]).flatten());
    let (x_lo, x_hi) = xs.fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let (y_lo, y_hi) = ys.fold((f64::MAX, f64::MIN), |(lo, hi), y| (lo.min(y), hi.max(y)));
    if x_lo > x_hi || y_lo > y_hi {
        return Err("no latency point to draw".to_string());
    }
    // Half an octave of room on x, a factor of 2 on y, so end points and crosses are not clipped.
    let x_range = (x_lo / 1.5).max(0.5)..(x_hi * 1.5);
    let y_range = (y_lo / 2.0)..(y_hi * 2.0);
    let mut chart = ChartBuilder::on(root)
        .caption(
            "Ack latency against offered load (dots: measured p50, crosses: Little's law)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(60)
        .y_label_area_size(90)
        .build_cartesian_2d(x_range.log_scale(), y_range.log_scale())
        .map_err(de)?;
    chart
        .configure_mesh()
        .x_desc("requests in flight per publisher")
        .y_desc("ack latency")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| human_us(*y))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(de)?;
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let measured: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0, p.1)).collect();
        chart
            .draw_series(LineSeries::new(measured.clone(), color.stroke_width(2)))
            .map_err(de)?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        chart
            .draw_series(measured.iter().map(|&p| Circle::new(p, 5, color.filled())))
            .map_err(de)?;
        chart
            .draw_series(
                s.points
                    .iter()
                    .filter_map(|p| p.2.map(|w| (p.0, w)))
                    .map(|p| Cross::new(p, 7, color.stroke_width(2))),
            )
            .map_err(de)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(de)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::tests::{arm, cell, fixed_run, settings};
    use crate::cell::{CellRecord, Facts};
    use crate::plan::StreamKind;

    /// Fixed records: 2 shapes x 2 arms x 2 trials at known rates, a latency sweep over in-flight
    /// counts, and one failed trial.
    fn fixed_records() -> Vec<CellRecord> {
        let facts = Facts {
            commit: Some("abc123".to_string()),
            kernel: Some("6.18.0".to_string()),
            ..Facts::default()
        };
        let mut out = Vec::new();
        let shapes = [
            cell(1, StreamKind::InMemory, Mode::FireAndForget, 1),
            cell(2, StreamKind::Durable, Mode::Acked, 64),
        ];
        for c in &shapes {
            for trial in 1..=2u32 {
                for (ai, name) in ["felix-default", "felix-ack-on-commit"].iter().enumerate() {
                    let rate = 409_600_000 * (2 + ai as u64) + u64::from(trial) * 40_960_000;
                    let fire_and_forget = c.shape.mode == Mode::FireAndForget;
                    let mut run = fixed_run(rate, if fire_and_forget { 4096 * 100 } else { 0 });
                    if fire_and_forget {
                        run.ack_latency_ns = None;
                    }
                    out.push(CellRecord::from_run(
                        &settings(),
                        c,
                        &arm(name),
                        trial,
                        facts.clone(),
                        run,
                    ));
                }
            }
        }
        for (i, in_flight) in [1u32, 4, 16, 64].iter().enumerate() {
            let c = cell(3 + i, StreamKind::InMemory, Mode::Acked, *in_flight);
            let mut run = fixed_run(409_600_000, 0);
            let mut h = hdrhistogram::Histogram::<u64>::new(3).unwrap();
            h.record(u64::from(*in_flight) * 40_000 + 150_000).unwrap();
            run.ack_latency_ns = Some(h);
            out.push(CellRecord::from_run(
                &settings(),
                &c,
                &arm("felix-default"),
                1,
                facts.clone(),
                run,
            ));
        }
        let mut broken = fixed_run(409_600_000, 0);
        broken.samples[4].records = 0;
        out.push(CellRecord::from_run(
            &settings(),
            &shapes[1],
            &arm("felix-default"),
            3,
            facts,
            broken,
        ));
        out
    }

    #[test]
    fn aggregation_takes_median_min_max_per_cell_and_arm() {
        // Proves records group by shape x arm with trial medians and ranges, counting failed trials.
        let aggs = aggregate(&fixed_records());
        assert_eq!(aggs.len(), 2 * 2 + 4);
        let a = &aggs[0];
        assert_eq!(
            (a.cell_number, a.arm.as_str(), a.trials_run),
            (1, "felix-default", 2)
        );
        let p = a.payload_bytes_per_s.unwrap();
        assert_eq!(
            (p.min, p.max, p.median),
            (860_160_000.0, 901_120_000.0, 880_640_000.0)
        );
        let durable_default = aggs
            .iter()
            .find(|a| a.cell_number == 2 && a.arm == "felix-default")
            .unwrap();
        assert_eq!(durable_default.trials_run, 3);
        assert_eq!(durable_default.trials_finished(), 2);
        assert!(
            durable_default.errors[0].starts_with("trial 3: cell 2 ("),
            "{:?}",
            durable_default.errors
        );
        assert!(a.shed_fraction.unwrap().median > 0.0);
    }

    #[test]
    fn report_writes_well_formed_csv_summary_and_charts() {
        // Proves the report writes a parseable CSV (trial + median rows), a summary with its tables, and non-empty PNG/SVG charts.
        // The last CSV column is the error text.
        const ERROR_COLUMN: usize = CSV_HEADER.len() - 1;
        let dir = tempfile::tempdir().unwrap();
        let records = fixed_records();
        let files = write_report(&records, dir.path(), &ReportOptions::default()).unwrap();

        let mut reader = csv::Reader::from_path(&files.csv).unwrap();
        let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
        assert_eq!(header, CSV_HEADER);
        let rows: Vec<csv::StringRecord> = reader.records().map(|r| r.unwrap()).collect();
        let trials = rows.iter().filter(|r| &r[0] == "trial").count();
        let medians = rows.iter().filter(|r| &r[0] == "median").count();
        assert_eq!((trials, medians), (records.len(), 8));
        assert!(rows.iter().all(|r| r.len() == CSV_HEADER.len()));
        let first_median = rows.iter().find(|r| &r[0] == "median").unwrap();
        assert_eq!(&first_median[14], "880.640");
        assert_eq!(
            (&first_median[15], &first_median[16]),
            ("860.160", "901.120")
        );
        let failed = rows
            .iter()
            .find(|r| &r[0] == "trial" && !r[ERROR_COLUMN].is_empty())
            .unwrap();
        assert!(
            failed[ERROR_COLUMN].contains("payload") || failed[ERROR_COLUMN].contains("records")
        );

        let summary = std::fs::read_to_string(&files.summary).unwrap();
        assert!(summary.contains("## Throughput"), "{summary}");
        assert!(summary.contains("| 1 | in-memory 4096B b64 fire-and-forget p4 if1 spread 20s | felix-default | 2/2 | 880.6 (860.2–901.1) |"), "{summary}");
        assert!(summary.contains("## Latency and Little's law"));
        assert!(summary.contains("## Failed runs"));
        assert!(summary.contains("Commit: abc123. Kernel: 6.18.0."));
        assert!(summary.contains("![throughput.png](throughput.png)"));

        for name in [
            "throughput.png",
            "throughput.svg",
            "latency.png",
            "latency.svg",
        ] {
            let p = dir.path().join(name);
            assert!(files.charts.contains(&p), "{name} not reported");
            let len = std::fs::metadata(&p).unwrap().len();
            assert!(len > 1000, "{name} is {len} bytes");
        }
        let png = std::fs::read(dir.path().join("throughput.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let svg = std::fs::read_to_string(dir.path().join("latency.svg")).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"));

        // For looking at the output by eye: FELIX_BENCH_KEEP_REPORT=DIR keeps a copy, plus the
        // records as cells.jsonl so `felix-bench report --cells DIR` can re-render it.
        if let Ok(keep) = std::env::var("FELIX_BENCH_KEEP_REPORT") {
            let keep = Path::new(&keep);
            for name in [
                "throughput.png",
                "throughput.svg",
                "latency.png",
                "latency.svg",
                "summary.md",
                "cells.csv",
            ] {
                std::fs::copy(dir.path().join(name), keep.join(name)).unwrap();
            }
            let lines: String = records
                .iter()
                .map(|r| r.to_json_line().unwrap() + "\n")
                .collect();
            std::fs::write(keep.join("cells.jsonl"), lines).unwrap();
        }
    }

    #[test]
    fn records_are_read_back_from_jsonl_and_bad_lines_named() {
        // Proves records written as JSON lines are read back in order and a bad line is named by file and line.
        let dir = tempfile::tempdir().unwrap();
        let records = fixed_records();
        let text: String = records
            .iter()
            .map(|r| r.to_json_line().unwrap() + "\n")
            .collect();
        std::fs::write(dir.path().join("a.jsonl"), &text).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        assert_eq!(read_records(dir.path()).unwrap(), records);
        std::fs::write(dir.path().join("b.jsonl"), "\n{\"schema\": 1}\n").unwrap();
        let err = read_records(dir.path()).unwrap_err().to_string();
        assert!(err.contains("b.jsonl:2"), "{err}");
    }

    #[test]
    fn missing_font_is_a_clear_error() {
        // Proves a missing font file names the path and the Debian package to install.
        let err = read_font_file(Path::new("/nonexistent/font.ttf")).unwrap_err();
        assert!(err.to_string().contains("fonts-dejavu-core"));
    }
}
