//! Instructions per published record, counted by callgrind on a fixed in-process workload,
//! the broker's threads apart from the client's.
//!
//! [`run_workload`] starts a broker in this process (`felix_broker::Broker::start`, one
//! data-plane core, loopback, kernel-chosen ports, a temporary data directory) and one client,
//! creates a stream of one shard and publishes `publishes` requests of `batch` records of
//! `payload_bytes`: acked ones one at a time (one in flight, so the order of work is the same
//! every run), or fire-and-forget ones followed by one acked publish on the same QUIC stream (so
//! every record has been taken in before the run ends). [`measure`] runs that workload under
//! `valgrind --tool=callgrind --separate-threads=yes` twice, with N and 2N publishes, and
//! divides the difference in instructions by the records the second run added, so start-up and
//! shut-down cost cancel out ([`per_record`]).
//!
//! Broker and client apart: the client runs on the process's main thread (a current-thread
//! tokio runtime; callgrind's thread 1), which also starts and stops the broker (that cancels
//! in the difference); every other thread is the broker's (its data-plane core, the log writer,
//! housekeeping). Per function, [`self_costs`] reads each thread's exclusive cost, so the same
//! difference gives each broker function's instructions per record.
//!
//! What is counted includes the broker core's short spin before it parks (`SPIN_BEFORE_PARK`, a
//! wall-clock bound), which callgrind's slowdown makes cost more instructions than natively.
//! Compare builds with each other, not with other systems.
//!
//! Threads: the broker's own threads, plus a current-thread tokio runtime on the calling thread
//! for the client; under callgrind every thread is serialised, which is why the counts are
//! deterministic enough to difference.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use bytes::Bytes;
use felix_client::{Client, ClientConfig, Record, ShardSelection, StartPosition, StreamKind};
use futures::StreamExt as _;

use crate::BenchError;

/// One workload shape: payload size, records per publish, acked or not, and the stream kind
/// (durable streams use `on_commit`: fdatasync before the ack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub payload_bytes: u32,
    pub batch: u32,
    pub acked: bool,
    pub durable: bool,
    /// One live subscriber (on the client's thread) receives every record: the delivery
    /// path's cost is in the broker's figure.
    pub subscribed: bool,
}

impl Shape {
    /// "256 B batch 1", "4 KiB batch 64 durable on_commit", "256 B batch 1 fire-and-forget".
    pub fn label(&self) -> String {
        let p = self.payload_bytes;
        let size = if p >= 1024 && p.is_multiple_of(1024) {
            format!("{} KiB", p / 1024)
        } else {
            format!("{p} B")
        };
        let mut label = format!("{size} batch {}", self.batch);
        if !self.acked {
            label.push_str(" fire-and-forget");
        }
        if self.durable {
            label.push_str(" durable on_commit");
        }
        if self.subscribed {
            label.push_str(" + 1 subscriber");
        }
        label
    }

    /// `256B-b1-ack-mem`, for file names.
    pub fn slug(&self) -> String {
        format!(
            "{}B-b{}-{}-{}{}",
            self.payload_bytes,
            self.batch,
            if self.acked { "ack" } else { "ff" },
            if self.durable { "dur" } else { "mem" },
            if self.subscribed { "-sub" } else { "" }
        )
    }
}

/// The shapes `make bench-instructions` reports, with their default N (publishes): 256 B batch
/// 1 acked, 256 B batch 64, 4 KiB batch 64, 256 B batch 1 fire-and-forget (in-memory), and
/// 4 KiB batch 64 durable on_commit, and 4 KiB batch 64 with one live subscriber. N keeps each near a minute under callgrind here; the
/// per-record figure did not move between N = 200, 2,000 and 20,000 (256 B batch 1).
pub const DEFAULT_SHAPES: [(Shape, u64); 6] = [
    (
        Shape {
            payload_bytes: 256,
            batch: 1,
            acked: true,
            durable: false,
            subscribed: false,
        },
        10_000,
    ),
    (
        Shape {
            payload_bytes: 256,
            batch: 64,
            acked: true,
            durable: false,
            subscribed: false,
        },
        1_000,
    ),
    (
        Shape {
            payload_bytes: 4096,
            batch: 64,
            acked: true,
            durable: false,
            subscribed: false,
        },
        1_000,
    ),
    (
        Shape {
            payload_bytes: 256,
            batch: 1,
            acked: false,
            durable: false,
            subscribed: false,
        },
        10_000,
    ),
    (
        Shape {
            payload_bytes: 4096,
            batch: 64,
            acked: true,
            durable: true,
            subscribed: false,
        },
        500,
    ),
    (
        Shape {
            payload_bytes: 4096,
            batch: 64,
            acked: true,
            durable: false,
            subscribed: true,
        },
        500,
    ),
];

/// Shards of the workload's stream: 1, so every record takes the same path.
const WORKLOAD_SHARDS: u32 = 1;

/// Instructions per record from two runs: (instructions at 2N - instructions at N) / records
/// added by the second run. Refuses a second run that counted fewer instructions than the first
/// (the runs were not the same workload) and zero records.
pub fn per_record(instr_n: u64, instr_2n: u64, records_added: u64) -> Result<f64, BenchError> {
    if records_added == 0 {
        return Err(BenchError::Driver {
            cell: "instructions".to_string(),
            detail: "no records between the two runs".to_string(),
        });
    }
    let Some(delta) = instr_2n.checked_sub(instr_n) else {
        return Err(BenchError::Driver {
            cell: "instructions".to_string(),
            detail: format!(
                "the 2N run counted fewer instructions ({instr_2n}) than the N run ({instr_n})"
            ),
        });
    };
    Ok(delta as f64 / records_added as f64)
}

/// The total instruction count of a callgrind output file: its `summary:` line (or `totals:`,
/// which callgrind writes instead in some versions), first event (Ir).
pub fn parse_callgrind_total(text: &str) -> Option<u64> {
    let line = text
        .lines()
        .find(|l| l.starts_with("summary:"))
        .or_else(|| text.lines().find(|l| l.starts_with("totals:")))?;
    line.split_once(':')?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Runs the workload: an in-process broker and one client, `publishes` publishes of `shape`
/// (acked: one in flight; fire-and-forget: then one acked publish of the same records as a
/// barrier). Returns the records published.
pub fn run_workload(shape: Shape, publishes: u64) -> Result<u64, BenchError> {
    let fail = |detail: String| BenchError::Driver {
        cell: format!("instructions {}", shape.label()),
        detail,
    };
    let dir = tempfile::tempdir().map_err(|e| BenchError::io(std::env::temp_dir(), e))?;
    let env = vec![
        (
            "FELIX_DATA_DIR".to_string(),
            dir.path().display().to_string(),
        ),
        ("FELIX_BIND".to_string(), "127.0.0.1:0".to_string()),
        ("FELIX_METRICS_BIND".to_string(), "127.0.0.1:0".to_string()),
        ("FELIX_DATAPLANE_CORES".to_string(), "1".to_string()),
        ("FELIX_LOG".to_string(), "warn".to_string()),
        (
            "FELIX_DURABLE_FSYNC_MODE".to_string(),
            "on_commit".to_string(),
        ),
        // Small preallocated segments: the 1 GiB default per core is not needed here.
        (
            "FELIX_DURABLE_SEGMENT_BYTES".to_string(),
            "64MiB".to_string(),
        ),
    ];
    let config = felix_tuning::Config::load(None, env, &[])
        .map_err(|e| fail(format!("broker config: {e}")))?;
    let broker = felix_broker::Broker::start(&config)
        .map_err(|e| fail(format!("broker start: {}", felix_storage::ErrorChain(&e))))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(format!("tokio runtime: {e}")))?;
    let addr = broker.quic_addr();
    let ca = config.dev_cert_path();
    let result = runtime.block_on(async {
        let mut c = ClientConfig::new(addr);
        c.ca = Some(ca);
        c.client_name = "felix-bench/instructions".to_string();
        let client = Client::connect(c)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let kind = if shape.durable {
            StreamKind::Durable
        } else {
            StreamKind::InMemory
        };
        client
            .create_stream("instr", WORKLOAD_SHARDS, kind)
            .await
            .map_err(|e| format!("create stream: {e}"))?;
        let expected =
            publishes * u64::from(shape.batch) + u64::from(!shape.acked) * u64::from(shape.batch);
        let reader = if shape.subscribed {
            let mut subscription = client
                .subscribe("instr", ShardSelection::All, StartPosition::Latest)
                .await
                .map_err(|e| format!("subscribe: {e}"))?;
            Some(tokio::spawn(async move {
                let mut received = 0u64;
                while received < expected {
                    match subscription.next().await {
                        Some(Ok(_)) => received += 1,
                        Some(Err(e)) => return Err(format!("subscription: {e}")),
                        None => return Err(format!("subscription ended after {received}")),
                    }
                }
                Ok(received)
            }))
        } else {
            None
        };
        let payload = Bytes::from(vec![0x5Au8; shape.payload_bytes as usize]);
        let records: Vec<Record> = (0..shape.batch)
            .map(|_| Record {
                key: Bytes::from_static(b"k"),
                payload: payload.clone(),
            })
            .collect();
        let mut published = 0u64;
        for _ in 0..publishes {
            if shape.acked {
                client
                    .publish("instr", &records)
                    .await
                    .map_err(|e| format!("publish: {e}"))?;
            } else {
                client
                    .publish_no_ack("instr", &records)
                    .await
                    .map_err(|e| format!("publish: {e}"))?;
            }
            published += u64::from(shape.batch);
        }
        if !shape.acked {
            // The barrier: acked after every fire-and-forget publish before it on this stream.
            client
                .publish("instr", &records)
                .await
                .map_err(|e| format!("barrier publish: {e}"))?;
            published += u64::from(shape.batch);
        }
        if let Some(reader) = reader {
            reader
                .await
                .map_err(|e| format!("subscriber task: {e}"))??;
        }
        client.close().await;
        Ok::<u64, String>(published)
    });
    broker.shutdown_trigger().trigger();
    let stopped = broker.wait();
    let records = result.map_err(fail)?;
    stopped.map_err(|e| fail(format!("broker stop: {e}")))?;
    Ok(records)
}

/// What one callgrind run counted: the client's thread (callgrind's thread 1, the main
/// thread) and the broker's (every other thread), in total, and the broker's per function
/// (exclusive).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunCounts {
    pub client: u64,
    pub broker: u64,
    pub broker_functions: HashMap<String, u64>,
    /// The client thread's exclusive cost per function.
    pub client_functions: HashMap<String, u64>,
}

/// Exclusive (self) instructions per function of one callgrind output file.
///
/// The format (valgrind's docs, "Callgrind Format Specification"): `fn=(id) name` starts a
/// function (later `fn=(id)` alone; an id may first be defined by a `cfn=` line); a cost line is a position and its events (`12 340`,
/// `+2 5`, `* 7`); the cost line right after `calls=` is the callee's inclusive cost, not the
/// caller's own, and is skipped. Only the first event (Ir) is read.
pub fn self_costs(text: &str) -> HashMap<String, u64> {
    let mut names: HashMap<String, String> = HashMap::new();
    let mut costs: HashMap<String, u64> = HashMap::new();
    let mut current: Option<String> = None;
    let mut skip_next_cost = false;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("fn=") {
            current = Some(resolve_name(&mut names, rest));
            continue;
        }
        // A callee's name: the same id space as fn=, and may be where an id is defined.
        if let Some(rest) = line.strip_prefix("cfn=") {
            resolve_name(&mut names, rest);
            continue;
        }
        if line.starts_with("calls=") {
            skip_next_cost = true;
            continue;
        }
        let first = line.as_bytes().first().copied();
        let is_cost = matches!(first, Some(b'0'..=b'9' | b'+' | b'-' | b'*'));
        if !is_cost {
            continue;
        }
        if skip_next_cost {
            skip_next_cost = false;
            continue;
        }
        let Some(function) = &current else { continue };
        let mut fields = line.split_whitespace();
        let _position = fields.next();
        if let Some(ir) = fields.next().and_then(|v| v.parse::<u64>().ok()) {
            *costs.entry(function.clone()).or_default() += ir;
        }
    }
    costs
}

/// `(12) name` defines id 12; `(12)` refers to it; a plain name is itself.
fn resolve_name(names: &mut HashMap<String, String>, rest: &str) -> String {
    let rest = rest.trim();
    if let Some(after) = rest.strip_prefix('(')
        && let Some((id, name)) = after.split_once(')')
    {
        let name = name.trim();
        if name.is_empty() {
            return names.get(id).cloned().unwrap_or_else(|| format!("({id})"));
        }
        names.insert(id.to_string(), name.to_string());
        return name.to_string();
    }
    rest.to_string()
}

/// The thread number of a `--separate-threads=yes` output file (`<base>-01` is thread 1).
fn thread_of(path: &Path, base: &str) -> Option<u32> {
    path.file_name()?
        .to_str()?
        .strip_prefix(base)?
        .strip_prefix('-')?
        .parse()
        .ok()
}

/// Runs `bench_bin instructions-workload` for `shape` with `publishes` under callgrind, one
/// output file per thread, and returns the counts split into client and broker.
fn callgrind_run(
    valgrind: &Path,
    bench_bin: &Path,
    out_dir: &Path,
    shape: Shape,
    publishes: u64,
) -> Result<RunCounts, BenchError> {
    let fail = |detail: String| BenchError::Driver {
        cell: format!("instructions {}", shape.label()),
        detail,
    };
    let base = format!("callgrind.{}-n{publishes}.out", shape.slug());
    // Files of an earlier run would be counted with this one's.
    let stale = std::fs::read_dir(out_dir).map_err(|e| BenchError::io(out_dir, e))?;
    for entry in stale.flatten() {
        if thread_of(&entry.path(), &base).is_some() {
            std::fs::remove_file(entry.path()).map_err(|e| BenchError::io(entry.path(), e))?;
        }
    }
    let out_file = out_dir.join(&base);
    let status = Command::new(valgrind)
        .arg("--tool=callgrind")
        .arg("--separate-threads=yes")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg("--quiet")
        .arg(bench_bin)
        .arg("instructions-workload")
        .arg("--payload")
        .arg(shape.payload_bytes.to_string())
        .arg("--batch")
        .arg(shape.batch.to_string())
        .arg("--mode")
        .arg(if shape.acked {
            "acked"
        } else {
            "fire-and-forget"
        })
        .arg("--kind")
        .arg(if shape.durable {
            "durable"
        } else {
            "in-memory"
        })
        .args(shape.subscribed.then_some("--subscribed"))
        .arg("--publishes")
        .arg(publishes.to_string())
        .status()
        .map_err(|e| BenchError::io(valgrind, e))?;
    if !status.success() {
        return Err(fail(format!(
            "callgrind run with {publishes} publishes failed: {status}"
        )));
    }
    let mut counts = RunCounts::default();
    let mut threads = 0;
    let entries = std::fs::read_dir(out_dir).map_err(|e| BenchError::io(out_dir, e))?;
    let mut files: Vec<(u32, PathBuf)> = entries
        .flatten()
        .filter_map(|e| thread_of(&e.path(), &base).map(|t| (t, e.path())))
        .collect();
    files.sort();
    for (thread, path) in files {
        let text = std::fs::read_to_string(&path).map_err(|e| BenchError::io(&path, e))?;
        let total = parse_callgrind_total(&text)
            .ok_or_else(|| fail(format!("no summary line in {}", path.display())))?;
        if thread == 1 {
            counts.client += total;
            for (name, cost) in self_costs(&text) {
                *counts.client_functions.entry(name).or_default() += cost;
            }
        } else {
            counts.broker += total;
            for (name, cost) in self_costs(&text) {
                *counts.broker_functions.entry(name).or_default() += cost;
            }
        }
        threads += 1;
    }
    if threads < 2 {
        return Err(fail(format!(
            "callgrind wrote {threads} per-thread files named {base}-NN in {}; expected the \
             client's and the broker's",
            out_dir.display()
        )));
    }
    Ok(counts)
}

/// A function's instructions per record (the 2N run less the N run, over the records added).
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionCost {
    pub name: String,
    pub per_record: f64,
}

/// One shape's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub shape: Shape,
    pub publishes: u64,
    pub instr_n: u64,
    pub instr_2n: u64,
    /// Client and broker together.
    pub per_record: f64,
    pub broker_per_record: f64,
    pub client_per_record: f64,
    /// The broker's functions with the largest exclusive cost per record, largest first.
    pub broker_top: Vec<FunctionCost>,
    /// The client's, likewise (the load generator's cost, for the client work).
    pub client_top: Vec<FunctionCost>,
}

/// Broker functions listed per shape in [`Measured`].
pub const TOP_FUNCTIONS: usize = 15;

impl Measured {
    /// The line `make bench-instructions` prints.
    pub fn line(&self) -> String {
        format!(
            "{}: broker {:.0} instructions per record, client {:.0}, together {:.0} ({:.0} per \
             publish; callgrind, N={} publishes: {} -> 2N: {})",
            self.shape.label(),
            self.broker_per_record,
            self.client_per_record,
            self.per_record,
            self.per_record * f64::from(self.shape.batch),
            self.publishes,
            self.instr_n,
            self.instr_2n
        )
    }

    /// The top functions as Markdown tables (broker side, then client side), for
    /// docs/performance.md.
    pub fn top_markdown(&self) -> String {
        let mut s = format!(
            "{}: broker {:.0} instructions per record (client {:.0})\n\n",
            self.shape.label(),
            self.broker_per_record,
            self.client_per_record
        );
        s.push_str(&cost_table(
            "broker",
            &self.broker_top,
            self.broker_per_record,
        ));
        s.push('\n');
        s.push_str(&cost_table(
            "client",
            &self.client_top,
            self.client_per_record,
        ));
        s
    }
}

/// One side's top functions as a Markdown table with each one's share of `total`.
fn cost_table(side: &str, top: &[FunctionCost], total: f64) -> String {
    let mut s = format!(
        "| {side} function (exclusive) | instructions per record | share |\n|---|---:|---:|\n"
    );
    for f in top {
        let share = if total > 0.0 {
            100.0 * f.per_record / total
        } else {
            0.0
        };
        s.push_str(&format!(
            "| `{}` | {:.0} | {share:.1}% |\n",
            f.name.replace('|', "\\|"),
            f.per_record
        ));
    }
    s
}

/// Per-record cost of each function from the N and 2N runs, the `top` largest.
fn top_functions(
    n: &HashMap<String, u64>,
    n2: &HashMap<String, u64>,
    records: u64,
    top: usize,
) -> Vec<FunctionCost> {
    let mut costs: Vec<FunctionCost> = n2
        .iter()
        .map(|(name, &cost_2n)| {
            let cost_n = n.get(name).copied().unwrap_or(0);
            FunctionCost {
                name: name.clone(),
                per_record: (cost_2n as f64 - cost_n as f64) / records as f64,
            }
        })
        .filter(|f| f.per_record > 0.0)
        .collect();
    costs.sort_by(|a, b| b.per_record.total_cmp(&a.per_record));
    costs.truncate(top);
    costs
}

/// Measures `shape` with N = `publishes` and 2N under callgrind.
pub fn measure(
    valgrind: &Path,
    bench_bin: &Path,
    out_dir: &Path,
    shape: Shape,
    publishes: u64,
) -> Result<Measured, BenchError> {
    std::fs::create_dir_all(out_dir).map_err(|e| BenchError::io(out_dir, e))?;
    let n = callgrind_run(valgrind, bench_bin, out_dir, shape, publishes)?;
    let n2 = callgrind_run(valgrind, bench_bin, out_dir, shape, publishes * 2)?;
    let records = publishes * u64::from(shape.batch);
    let instr_n = n.client + n.broker;
    let instr_2n = n2.client + n2.broker;
    Ok(Measured {
        shape,
        publishes,
        instr_n,
        instr_2n,
        per_record: per_record(instr_n, instr_2n, records)?,
        broker_per_record: per_record(n.broker, n2.broker, records)?,
        client_per_record: per_record(n.client, n2.client, records)?,
        broker_top: top_functions(
            &n.broker_functions,
            &n2.broker_functions,
            records,
            TOP_FUNCTIONS,
        ),
        client_top: top_functions(
            &n.client_functions,
            &n2.client_functions,
            records,
            TOP_FUNCTIONS,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_record_cancels_start_up() {
        // Proves (I(2N) - I(N)) / records gives the per-record cost whatever the fixed start-up cost.
        let startup = 500_000_000u64;
        let per = 12_345u64;
        let n_records = 20_000u64;
        let i_n = startup + per * n_records;
        let i_2n = startup + per * 2 * n_records;
        assert_eq!(per_record(i_n, i_2n, n_records).unwrap(), per as f64);
        // Batch 64: 2,000 publishes add 128,000 records.
        assert_eq!(per_record(1_000, 129_000, 128_000).unwrap(), 1.0);
        assert!(per_record(10, 5, 1).is_err());
        assert!(per_record(1, 2, 0).is_err());
    }

    #[test]
    fn callgrind_summary_line_is_read() {
        // Proves the total comes from the summary line, else the totals line, and garbage gives None.
        let text = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nfl=(1) x\n0 5\nsummary: 123456789\n";
        assert_eq!(parse_callgrind_total(text), Some(123_456_789));
        assert_eq!(
            parse_callgrind_total("events: Ir\ntotals: 42 7\n"),
            Some(42)
        );
        assert_eq!(parse_callgrind_total("events: Ir\n"), None);
    }

    #[test]
    fn shape_labels_read_like_the_report() {
        // Proves the printed labels of the two default shapes.
        assert_eq!(DEFAULT_SHAPES[0].0.label(), "256 B batch 1");
        assert_eq!(DEFAULT_SHAPES[1].0.label(), "256 B batch 64");
        assert_eq!(DEFAULT_SHAPES[2].0.label(), "4 KiB batch 64");
        assert_eq!(DEFAULT_SHAPES[3].0.label(), "256 B batch 1 fire-and-forget");
        assert_eq!(
            DEFAULT_SHAPES[4].0.label(),
            "4 KiB batch 64 durable on_commit"
        );
        assert_eq!(DEFAULT_SHAPES[4].0.slug(), "4096B-b64-ack-dur");
    }

    #[test]
    fn workload_publishes_every_record() {
        // Proves the in-process workload runs a real broker and client and publishes N x batch records.
        let records = run_workload(
            Shape {
                payload_bytes: 256,
                batch: 4,
                acked: true,
                durable: false,
                subscribed: false,
            },
            10,
        )
        .unwrap();
        assert_eq!(records, 40);
        // With a subscriber, which must receive every record for the run to end.
        let records = run_workload(
            Shape {
                payload_bytes: 2048,
                batch: 4,
                acked: true,
                durable: false,
                subscribed: true,
            },
            10,
        )
        .unwrap();
        assert_eq!(records, 40);
        // Fire-and-forget, durable: the barrier publish adds one batch.
        let records = run_workload(
            Shape {
                payload_bytes: 64,
                batch: 2,
                acked: false,
                durable: true,
                subscribed: false,
            },
            5,
        )
        .unwrap();
        assert_eq!(records, 12);
    }

    #[test]
    fn self_costs_follow_the_callgrind_format() {
        // Proves exclusive costs per function: names compressed by id, the cost line after
        // calls= (a callee's inclusive cost) skipped, relative positions read.
        let text = "version: 1\nevents: Ir\nfl=(1) a.rs\nfn=(1) main\n10 5\n+1 3\ncfn=(2) work\ncalls=1 20\n* 100\n\
                    fn=(2)\n20 60\n-3 40\nfn=(1)\n12 2\nsummary: 210\n";
        let costs = self_costs(text);
        assert_eq!(costs.get("main"), Some(&10));
        assert_eq!(costs.get("work"), Some(&100));
        assert_eq!(costs.len(), 2);
    }

    #[test]
    fn top_functions_difference_the_runs() {
        // Proves each function's cost per record is (2N - N) / records, largest first, and a
        // function that did not grow is left out.
        let n = HashMap::from([("a".to_string(), 100u64), ("b".to_string(), 50)]);
        let n2 = HashMap::from([
            ("a".to_string(), 300u64),
            ("b".to_string(), 50),
            ("c".to_string(), 400),
        ]);
        let top = top_functions(&n, &n2, 100, 5);
        let names: Vec<(&str, f64)> = top
            .iter()
            .map(|f| (f.name.as_str(), f.per_record))
            .collect();
        assert_eq!(names, vec![("c", 4.0), ("a", 2.0)]);
        assert_eq!(
            thread_of(Path::new("/x/callgrind.s.out-02"), "callgrind.s.out"),
            Some(2)
        );
        assert_eq!(
            thread_of(Path::new("/x/callgrind.s.out"), "callgrind.s.out"),
            None
        );
    }
}
