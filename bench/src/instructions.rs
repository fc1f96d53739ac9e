//! Instructions per published record, counted by callgrind on a fixed in-process workload.
//!
//! [`run_workload`] starts a broker in this process (`felix_broker::Broker::start`, one
//! data-plane core, loopback, kernel-chosen ports, a temporary data directory) and one client,
//! creates an in-memory stream and publishes `publishes` acked requests of `batch` records of
//! `payload_bytes`, one at a time (one in flight, so the order of work is the same every run).
//! [`measure`] runs that workload under `valgrind --tool=callgrind` twice, with N and 2N
//! publishes, and divides the difference in instructions by the N records the second run added,
//! so start-up and shut-down cost cancel out ([`per_record`]).
//!
//! What is counted: every instruction of the process, so the client's work (encoding, QUIC
//! and TLS on its side) is in the figure with the broker's, and so is the broker core's short
//! spin before it parks (`SPIN_BEFORE_PARK`, a wall-clock bound), which callgrind's slowdown
//! makes cost more instructions than natively. Compare builds with each other, not with other
//! systems.
//!
//! Threads: the broker's own threads, plus a current-thread tokio runtime on the calling thread
//! for the client; under callgrind every thread is serialised, which is why the counts are
//! deterministic enough to difference.

use std::path::Path;
use std::process::Command;

use bytes::Bytes;
use felix_client::{Client, ClientConfig, Record, StreamKind};

use crate::BenchError;

/// One workload shape: payload size and records per publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub payload_bytes: u32,
    pub batch: u32,
}

impl Shape {
    /// "256 B batch 1", "4 KiB batch 64".
    pub fn label(&self) -> String {
        let p = self.payload_bytes;
        let size = if p >= 1024 && p.is_multiple_of(1024) {
            format!("{} KiB", p / 1024)
        } else {
            format!("{p} B")
        };
        format!("{size} batch {}", self.batch)
    }
}

/// The two shapes `make bench-instructions` reports, with their default N (publishes): 10,000
/// x 256 B batch 1 and 1,000 x 64 x 4 KiB. Measured here: 20,000 + 40,000 and 2,000 + 4,000
/// took 6.5 minutes under callgrind together; half of that keeps the target near 3 minutes,
/// and the per-record figure did not move between N = 200, 2,000 and 20,000 (77.9 k).
pub const DEFAULT_SHAPES: [(Shape, u64); 2] = [
    (
        Shape {
            payload_bytes: 256,
            batch: 1,
        },
        10_000,
    ),
    (
        Shape {
            payload_bytes: 4096,
            batch: 64,
        },
        1_000,
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

/// Runs the workload: an in-process broker and one client, `publishes` acked publishes of
/// `shape`, one in flight. Returns the records published.
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
        // Small preallocated segments: the 1 GiB default per core is not needed here.
        (
            "FELIX_DURABLE_SEGMENT_BYTES".to_string(),
            "4MiB".to_string(),
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
        client
            .create_stream("instr", WORKLOAD_SHARDS, StreamKind::InMemory)
            .await
            .map_err(|e| format!("create stream: {e}"))?;
        let payload = Bytes::from(vec![0x5Au8; shape.payload_bytes as usize]);
        let records: Vec<Record> = (0..shape.batch)
            .map(|_| Record {
                key: Bytes::from_static(b"k"),
                payload: payload.clone(),
            })
            .collect();
        for _ in 0..publishes {
            client
                .publish("instr", &records)
                .await
                .map_err(|e| format!("publish: {e}"))?;
        }
        client.close().await;
        Ok::<u64, String>(publishes * u64::from(shape.batch))
    });
    broker.shutdown_trigger().trigger();
    let stopped = broker.wait();
    let records = result.map_err(fail)?;
    stopped.map_err(|e| fail(format!("broker stop: {e}")))?;
    Ok(records)
}

/// Runs `bench_bin instructions-workload` for `shape` with `publishes` under callgrind and
/// returns the total instructions.
fn callgrind_total(
    valgrind: &Path,
    bench_bin: &Path,
    out_dir: &Path,
    shape: Shape,
    publishes: u64,
) -> Result<u64, BenchError> {
    let out_file = out_dir.join(format!(
        "callgrind.{}B-b{}-n{publishes}.out",
        shape.payload_bytes, shape.batch
    ));
    let status = Command::new(valgrind)
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg("--quiet")
        .arg(bench_bin)
        .arg("instructions-workload")
        .arg("--payload")
        .arg(shape.payload_bytes.to_string())
        .arg("--batch")
        .arg(shape.batch.to_string())
        .arg("--publishes")
        .arg(publishes.to_string())
        .status()
        .map_err(|e| BenchError::io(valgrind, e))?;
    if !status.success() {
        return Err(BenchError::Driver {
            cell: format!("instructions {}", shape.label()),
            detail: format!("callgrind run with {publishes} publishes failed: {status}"),
        });
    }
    let text = std::fs::read_to_string(&out_file).map_err(|e| BenchError::io(&out_file, e))?;
    parse_callgrind_total(&text).ok_or_else(|| BenchError::Driver {
        cell: format!("instructions {}", shape.label()),
        detail: format!("no summary line in {}", out_file.display()),
    })
}

/// One shape's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub shape: Shape,
    pub publishes: u64,
    pub instr_n: u64,
    pub instr_2n: u64,
    pub per_record: f64,
}

impl Measured {
    /// The line `make bench-instructions` prints.
    pub fn line(&self) -> String {
        format!(
            "{}: {:.0} instructions per published record ({:.0} per publish; callgrind, N={} \
             publishes: {} -> 2N: {})",
            self.shape.label(),
            self.per_record,
            self.per_record * f64::from(self.shape.batch),
            self.publishes,
            self.instr_n,
            self.instr_2n
        )
    }
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
    let instr_n = callgrind_total(valgrind, bench_bin, out_dir, shape, publishes)?;
    let instr_2n = callgrind_total(valgrind, bench_bin, out_dir, shape, publishes * 2)?;
    let per_record = per_record(instr_n, instr_2n, publishes * u64::from(shape.batch))?;
    Ok(Measured {
        shape,
        publishes,
        instr_n,
        instr_2n,
        per_record,
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
        assert_eq!(DEFAULT_SHAPES[1].0.label(), "4 KiB batch 64");
    }

    #[test]
    fn workload_publishes_every_record() {
        // Proves the in-process workload runs a real broker and client and publishes N x batch records.
        let records = run_workload(
            Shape {
                payload_bytes: 256,
                batch: 4,
            },
            10,
        )
        .unwrap();
        assert_eq!(records, 40);
    }
}
