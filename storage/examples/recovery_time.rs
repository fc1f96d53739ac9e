//! Measures how long `Log::open` (recovery) takes on a large log, on the real io_uring backend
//! (pwrite where the ring cannot be set up). Not a test: timings go to docs/design/durable.md.
//!
//! ```text
//! cargo run --release -p felix-storage --example recovery_time -- write DIR GIB
//! cargo run --release -p felix-storage --example recovery_time -- open DIR [cold] [repeat]
//! ```
//!
//! `write` appends records (24 shards, 16-byte keys, 320-byte payloads: ~364 bytes framed, the
//! shape of the crash audit's 3.84 M-record log) in 4 MiB periodic-fsync rounds until the log
//! holds GIB gibibytes, then flushes. `open` recovers the log and prints the time; with `cold`
//! it first asks the kernel to drop the log's cached pages (posix_fadvise DONTNEED, no root
//! needed), so the recovery reads from the disk as after a reboot.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use felix_storage::{BackendChoice, FsyncMode, Log, LogConfig, SystemBackend};

/// Shards the records are spread over (one core's share of a 48-shard stream).
const SHARDS: u32 = 24;
/// Key and payload sizes: 28 + 16 + 320 = 364 framed bytes per record.
const KEY_BYTES: usize = 16;
const PAYLOAD_BYTES: usize = 320;
/// Records appended before each `drive`: ~1 MiB, so rounds fill up to the 4 MiB default.
const BATCH_RECORDS: u64 = 2880;
/// Deadline for the final flush (a loaded disk can take seconds to write 64 MiB).
const FLUSH_DEADLINE: Duration = Duration::from_secs(300);

fn config(dir: &Path) -> LogConfig {
    let mut config = LogConfig::new(dir);
    config.fsync = FsyncMode::Periodic {
        interval: Duration::from_millis(250),
    };
    config
}

fn write(dir: &Path, gib: f64) -> Result<(), Box<dyn std::error::Error>> {
    let backend = SystemBackend::open(BackendChoice::IoUring)?;
    let (mut log, _) = Log::open(config(dir), backend)?;
    let target = (gib * (1u64 << 30) as f64) as u64;
    let payload = vec![0x5Au8; PAYLOAD_BYTES];
    let mut next = vec![0u64; SHARDS as usize];
    let mut appended = 0u64;
    let started = Instant::now();
    while log.counters().append_bytes < target {
        for i in 0..BATCH_RECORDS {
            let shard = ((appended + i) % u64::from(SHARDS)) as u32;
            let offset = next[shard as usize];
            let key = [(offset & 0xFF) as u8; KEY_BYTES];
            match log.append(
                shard,
                offset,
                1_700_000_000_000_000 + offset,
                &key,
                &payload,
            ) {
                Ok(()) => next[shard as usize] += 1,
                Err(felix_storage::StorageError::PendingFull { .. }) => break,
                Err(e) => return Err(e.into()),
            }
        }
        appended = next.iter().sum();
        log.drive(Instant::now())?;
        while log.poll_event().is_some() {}
        if log.pending_bytes() > 32 << 20 {
            felix_storage::wait_readable(log.wake_fd(), Duration::from_millis(50))?;
        }
    }
    log.sync_now();
    log.flush(FLUSH_DEADLINE)?;
    let c = log.counters();
    println!(
        "wrote {} records, {} bytes in {:.1} s ({} segments)",
        c.records,
        c.append_bytes,
        started.elapsed().as_secs_f64(),
        log.segment_seqs().len()
    );
    Ok(())
}

fn drop_cache(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    for entry in std::fs::read_dir(dir)? {
        let file = std::fs::File::open(entry?.path())?;
        // SAFETY: fadvise on a valid fd borrowed for the call; no memory is passed.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(format!("posix_fadvise: errno {rc}").into());
        }
    }
    Ok(())
}

fn open(dir: &Path, cold: bool) -> Result<(), Box<dyn std::error::Error>> {
    if cold {
        drop_cache(dir)?;
    }
    let backend = SystemBackend::open(BackendChoice::IoUring)?;
    let started = Instant::now();
    let (log, report) = Log::open(config(dir), backend)?;
    let elapsed = started.elapsed();
    let bytes: u64 = log.total_bytes();
    println!(
        "open {}: {:.1} ms, {} records, {} segments, {} file bytes, backend {}, cache {}",
        dir.display(),
        elapsed.as_secs_f64() * 1e3,
        report.records,
        report.segments,
        bytes,
        log.backend_name(),
        if cold { "dropped" } else { "warm" }
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["write", dir, gib] => write(Path::new(dir), gib.parse()?),
        ["open", dir] => open(Path::new(dir), false),
        ["open", dir, "cold"] => open(Path::new(dir), true),
        _ => Err("usage: recovery_time write DIR GIB | open DIR [cold]".into()),
    }
}
