//! The disk baseline: a built-in fsync write probe, taken in the same session as the cells
//! (docs/semantics.md, 7 Measuring performance) so durable throughput can be judged against
//! what the disk does.
//!
//! It does what fio does for "sequential writes of B bytes with fdatasync after each, one job":
//! lay out (fallocate) a file of N bytes in the given directory, like fio's default
//! `fallocate=native`, then write it front to back in B-byte buffered writes, calling fdatasync
//! after each; report MB/s over the whole loop and the fdatasync latency p50/p99. The file is
//! removed afterwards, also on error. Runs on the calling thread, which blocks in fdatasync.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::stats::{BYTES_PER_MB, LatencySummary, LatencyUnit};

/// The reference's device baseline: 256 KiB sequential writes with an fdatasync after each.
pub const LARGE_BLOCK_BYTES: usize = 256 * 1024;

/// The small-write variant: one 4 KiB record per fdatasync, the worst case of a durable log.
pub const SMALL_BLOCK_BYTES: usize = 4096;

/// Default size of the 256 KiB probe: 256 MiB is 1024 fdatasyncs, ~0.4 s at this machine's
/// 630-730 MB/s and still a few seconds on a slow disk.
pub const DEFAULT_LARGE_MIB: u64 = 256;

/// Default size of the 4 KiB probe: 16 MiB is 4096 fdatasyncs, ~0.5-1 s at 125-245 us each
/// (docs/design/machine.md, Disk), enough for a stable p99.
pub const DEFAULT_SMALL_MIB: u64 = 16;

/// Largest probe: 64 GiB. Larger than any page cache we run on, and a guard against filling a
/// disk by a typo.
pub const PROBE_MIB_MAX: u64 = 64 * 1024;

/// Longest fdatasync the latency histogram records exactly: 60 s, in nanoseconds. Longer ones
/// are clamped to it (a disk that slow has failed the baseline anyway).
const RECORDED_NS_MAX: u64 = 60_000_000_000;

/// Significant figures of the latency histogram: 3 gives 0.1% resolution.
const HISTOGRAM_SIGFIG: u8 = 3;

const MIB: u64 = 1024 * 1024;

/// What one probe measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProbeResult {
    pub block_bytes: usize,
    pub total_bytes: u64,
    pub writes: u64,
    /// Whether the file was preallocated (fallocate unsupported on the filesystem: false).
    pub preallocated: bool,
    pub elapsed_s: f64,
    /// total_bytes / elapsed, in 10^6 bytes per second.
    pub mb_per_s: f64,
    pub fdatasync: LatencySummary,
}

/// Both probes of one directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskBaseline {
    pub dir: PathBuf,
    pub large: ProbeResult,
    pub small: ProbeResult,
}

/// Removes the probe file when dropped, so an error mid-probe leaves nothing behind.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        // Nothing useful to do if removal fails (already gone, or the directory vanished).
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `mib` MiB into a new file in `dir` in `block_bytes` writes, fdatasync after each.
pub fn probe(dir: &Path, mib: u64, block_bytes: usize) -> Result<ProbeResult, BenchError> {
    if mib == 0 || mib > PROBE_MIB_MAX {
        return Err(BenchError::DiskProbe(format!(
            "size must be 1..={PROBE_MIB_MAX} MiB, got {mib}"
        )));
    }
    if block_bytes == 0 || !(MIB as usize).is_multiple_of(block_bytes) {
        return Err(BenchError::DiskProbe(format!(
            "block size must divide 1 MiB, got {block_bytes}"
        )));
    }
    if !dir.is_dir() {
        return Err(BenchError::DiskProbe(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    let total_bytes = mib * MIB;
    let writes = total_bytes / block_bytes as u64;
    let path = dir.join(format!(
        ".felix-bench-disk-probe-{}-{block_bytes}",
        std::process::id()
    ));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| BenchError::io(&path, e))?;
    let _remove = RemoveOnDrop(path.clone());
    let preallocated = preallocate(&file, total_bytes);
    // A non-zero, non-repeating-per-block pattern, so no layer below can shortcut zero pages.
    let block: Vec<u8> = (0..block_bytes).map(|i| (i % 251) as u8 + 1).collect();
    let mut hist = Histogram::<u64>::new_with_bounds(1, RECORDED_NS_MAX, HISTOGRAM_SIGFIG)
        .map_err(|e| BenchError::DiskProbe(format!("histogram: {e}")))?;
    let started = Instant::now();
    for _ in 0..writes {
        file.write_all(&block)
            .map_err(|e| BenchError::io(&path, e))?;
        let sync_started = Instant::now();
        sync(&file, &path)?;
        let ns = u64::try_from(sync_started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        hist.saturating_record(ns.clamp(1, RECORDED_NS_MAX));
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    assert_eq!(hist.len(), writes, "one fdatasync timed per write");
    let fdatasync = LatencySummary::from_histogram(&hist, LatencyUnit::Nanos)
        .ok_or_else(|| BenchError::DiskProbe("no fdatasync was timed".to_string()))?;
    Ok(ProbeResult {
        block_bytes,
        total_bytes,
        writes,
        preallocated,
        elapsed_s,
        mb_per_s: total_bytes as f64 / BYTES_PER_MB / elapsed_s.max(f64::MIN_POSITIVE),
        fdatasync,
    })
}

/// Allocates the file's blocks up front (fio's default); false when the filesystem refuses.
fn preallocate(file: &File, total_bytes: u64) -> bool {
    let Ok(len) = i64::try_from(total_bytes) else {
        return false;
    };
    nix::fcntl::fallocate(file.as_fd(), nix::fcntl::FallocateFlags::empty(), 0, len).is_ok()
}

/// fdatasync; a failure ends the probe (its numbers would be meaningless).
fn sync(file: &File, path: &Path) -> Result<(), BenchError> {
    // std's sync_data is fdatasync(2) on Linux.
    file.sync_data().map_err(|e| BenchError::io(path, e))
}

/// The 256 KiB probe of `large_mib` then the 4 KiB probe of `small_mib`.
pub fn baseline(dir: &Path, large_mib: u64, small_mib: u64) -> Result<DiskBaseline, BenchError> {
    Ok(DiskBaseline {
        dir: dir.to_path_buf(),
        large: probe(dir, large_mib, LARGE_BLOCK_BYTES)?,
        small: probe(dir, small_mib, SMALL_BLOCK_BYTES)?,
    })
}

impl DiskBaseline {
    /// One human line, e.g. `disk /data: 256 KiB+fdatasync 256 MiB 671.2 MB/s (fdatasync p50
    /// 310 us p99 520 us); 4 KiB+fdatasync 16 MiB 28.1 MB/s (fdatasync p50 130 us p99 260 us)`.
    pub fn line(&self) -> String {
        let one = |r: &ProbeResult| {
            format!(
                "{} KiB+fdatasync {} MiB {:.1} MB/s (fdatasync p50 {:.0} us p99 {:.0} us{})",
                r.block_bytes / 1024,
                r.total_bytes / MIB,
                r.mb_per_s,
                r.fdatasync.p50_us,
                r.fdatasync.p99_us,
                if r.preallocated {
                    ""
                } else {
                    ", not preallocated"
                }
            )
        };
        format!(
            "disk {}: {}; {}",
            self.dir.display(),
            one(&self.large),
            one(&self.small)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_writes_syncs_and_removes_its_file() {
        // Proves a 4 MiB probe of each block size reports every write, a positive rate and
        // latencies, and leaves the directory empty.
        let dir = tempfile::tempdir().unwrap();
        let b = baseline(dir.path(), 4, 1).unwrap();
        assert_eq!(b.large.writes, 16);
        assert_eq!(b.large.total_bytes, 4 * MIB);
        assert_eq!(b.small.writes, 256);
        for r in [&b.large, &b.small] {
            assert!(r.mb_per_s > 0.0);
            assert!(r.elapsed_s > 0.0);
            assert_eq!(r.fdatasync.count, r.writes);
            assert!(r.fdatasync.p50_us > 0.0);
            assert!(r.fdatasync.p99_us >= r.fdatasync.p50_us);
        }
        assert!(b.line().starts_with("disk "));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let json = serde_json::to_string(&b).unwrap();
        assert_eq!(serde_json::from_str::<DiskBaseline>(&json).unwrap(), b);
    }

    #[test]
    fn probe_refuses_bad_arguments() {
        // Proves zero or oversized sizes, a bad block size and a missing directory are refused by name.
        let dir = tempfile::tempdir().unwrap();
        let msg = |r: Result<ProbeResult, BenchError>| {
            felix_storage::ErrorChain(&r.unwrap_err()).to_string()
        };
        assert!(msg(probe(dir.path(), 0, LARGE_BLOCK_BYTES)).contains("size must be"));
        assert!(
            msg(probe(dir.path(), PROBE_MIB_MAX + 1, LARGE_BLOCK_BYTES)).contains("size must be")
        );
        assert!(msg(probe(dir.path(), 1, 3000)).contains("block size"));
        let missing = dir.path().join("missing");
        assert!(msg(probe(&missing, 1, SMALL_BLOCK_BYTES)).contains("not a directory"));
    }
}
