//! Measures what commit marks cost on the real io_uring backend (pwrite where the ring cannot
//! be set up), on_commit: the time of a one-record round (4 KiB write + fdatasync, which
//! carries the 28-byte mark for the previous round) next to the time of the idle mark round
//! that follows it (a 28-byte write + fdatasync). Not a test: the figures go to
//! docs/design/durable.md.
//!
//! ```text
//! cargo run --release -p felix-storage --example mark_cost -- DIR [ROUNDS] [direct|buffered]
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use felix_storage::{BackendChoice, FsyncMode, Log, LogConfig, SystemBackend};

/// Rounds measured when none is given: enough for stable medians on a shared disk.
const DEFAULT_ROUNDS: usize = 400;
/// Payload of the record of each round: one page, the disk figure docs/design/machine.md
/// quotes for write + fdatasync.
const PAYLOAD_BYTES: usize = 4096;
/// Deadline of one flush (never reached on a working disk).
const FLUSH_DEADLINE: Duration = Duration::from_secs(30);
/// Segment size: 256 MiB holds every round without a roll.
const SEGMENT_BYTES: u64 = 256 << 20;

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: mark_cost DIR [ROUNDS]")?;
    let rounds: usize = match args.next() {
        Some(n) => n.parse()?,
        None => DEFAULT_ROUNDS,
    };
    let mut config = LogConfig::new(Path::new(&dir));
    config.fsync = FsyncMode::OnCommit;
    config.segment_bytes = SEGMENT_BYTES;
    config.direct_io = args.next().as_deref() != Some("buffered");
    let (mut log, _) = Log::open(config, SystemBackend::open(BackendChoice::IoUring)?)?;
    let payload = vec![0xA5u8; PAYLOAD_BYTES];
    let mut record_rounds = Vec::with_capacity(rounds);
    let mut mark_rounds = Vec::with_capacity(rounds);
    for offset in 0..rounds as u64 {
        log.append(0, offset, offset, b"key", &payload)?;
        let started = Instant::now();
        log.flush(FLUSH_DEADLINE)?;
        record_rounds.push(started.elapsed());
        // The idle log's own mark round, without waiting for MARK_DELAY.
        let started = Instant::now();
        log.sync_now();
        log.flush(FLUSH_DEADLINE)?;
        mark_rounds.push(started.elapsed());
        while log.poll_event().is_some() {}
    }
    record_rounds.sort_unstable();
    mark_rounds.sort_unstable();
    let c = log.counters();
    println!(
        "backend {} (direct {}): {rounds} record rounds (4 KiB + mark) p50 {:?} p90 {:?}; {} mark rounds p50 {:?} p90 {:?}; mark bytes {}",
        log.backend_name(),
        log.config().direct_io,
        percentile(&record_rounds, 0.5),
        percentile(&record_rounds, 0.9),
        c.mark_rounds,
        percentile(&mark_rounds, 0.5),
        percentile(&mark_rounds, 0.9),
        c.mark_bytes
    );
    Ok(())
}
