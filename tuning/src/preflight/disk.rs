//! Disk checks: sequential write rate with an fdatasync after each write, and free space.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{Check, Outcome, human_bytes};

/// Block size of the write-rate check: the durable log's large-write case.
const RATE_BLOCK_BYTES: usize = 256 * 1024;
/// Block size of the fdatasync-latency check: one small record per fdatasync.
const LATENCY_BLOCK_BYTES: usize = 4096;

/// What [`write_probe`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WriteRate {
    /// Bytes written over the whole write+fdatasync loop, in 10^6 bytes per second.
    pub mb_per_s: f64,
    /// Median fdatasync latency.
    pub fdatasync_p50: Duration,
    /// 99th-percentile fdatasync latency.
    pub fdatasync_p99: Duration,
}

/// Removes the probe file when dropped, so an error mid-probe leaves nothing behind.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        // Nothing useful to do if removal fails (already gone, directory removed).
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `total_bytes` (rounded up to whole blocks) into a new file in `dir` front to back
/// in `block_bytes` buffered writes, with an fdatasync after each, like fio's sequential
/// write with `fdatasync=1`. The file is preallocated with fallocate (skipped where the
/// filesystem does not support it) and removed afterwards, also on error. Blocks the calling
/// thread for the whole probe.
///
/// `bench/src/disk.rs` (the benchmark's disk baseline) does the same with more reporting.
pub fn write_probe(dir: &Path, block_bytes: usize, total_bytes: u64) -> io::Result<WriteRate> {
    if block_bytes == 0 || total_bytes == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "block and total size must be positive",
        ));
    }
    let writes = total_bytes.div_ceil(block_bytes as u64);
    let path = dir.join(format!(
        ".felix-preflight-write-probe-{}-{block_bytes}",
        std::process::id()
    ));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    let _remove = RemoveOnDrop(path);
    let length = libc::off_t::try_from(writes * block_bytes as u64)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "probe too large"))?;
    // SAFETY: fallocate on a descriptor we own; failure (unsupported) is fine.
    let _ = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, length) };
    let block: Vec<u8> = (0..block_bytes).map(|i| (i % 251) as u8 + 1).collect();
    let mut latencies = Vec::with_capacity(writes as usize);
    let started = Instant::now();
    for _ in 0..writes {
        file.write_all(&block)?;
        let synced_at = Instant::now();
        file.sync_data()?;
        latencies.push(synced_at.elapsed());
    }
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    latencies.sort_unstable();
    let percentile = |p: f64| {
        let rank = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len());
        latencies[rank - 1]
    };
    Ok(WriteRate {
        mb_per_s: (writes * block_bytes as u64) as f64 / elapsed / 1e6,
        fdatasync_p50: percentile(0.50),
        fdatasync_p99: percentile(0.99),
    })
}

/// The `write rate` check: [`write_probe`] of `total_bytes` in 256 KiB blocks; Fail below
/// `min_mb_per_s` (10^6 bytes per second) or when the probe cannot run.
pub fn write_rate(dir: &Path, total_bytes: u64, min_mb_per_s: f64) -> Check {
    let name = format!("write rate {}", dir.display());
    match write_probe(dir, RATE_BLOCK_BYTES, total_bytes) {
        Ok(rate) if rate.mb_per_s >= min_mb_per_s => Check::new(
            name,
            Outcome::Pass,
            format!(
                "{:.0} MB/s in 256 KiB writes with fdatasync (required {min_mb_per_s:.0})",
                rate.mb_per_s
            ),
        ),
        Ok(rate) => Check::new(
            name,
            Outcome::Fail,
            format!(
                "{:.0} MB/s in 256 KiB writes with fdatasync, below the required \
                 {min_mb_per_s:.0}",
                rate.mb_per_s
            ),
        ),
        Err(error) => Check::new(name, Outcome::Fail, format!("write probe failed: {error}")),
    }
}

/// The `fdatasync latency` check: [`write_probe`] of `total_bytes` in 4 KiB blocks; Fail when
/// the p99 fdatasync latency exceeds `max_p99` or the probe cannot run.
pub fn fdatasync_latency(dir: &Path, total_bytes: u64, max_p99: Duration) -> Check {
    let name = format!("fdatasync latency {}", dir.display());
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    match write_probe(dir, LATENCY_BLOCK_BYTES, total_bytes) {
        Ok(rate) => {
            let found = format!(
                "4 KiB writes: fdatasync p50 {:.0} us, p99 {:.0} us",
                micros(rate.fdatasync_p50),
                micros(rate.fdatasync_p99)
            );
            if rate.fdatasync_p99 <= max_p99 {
                Check::new(
                    name,
                    Outcome::Pass,
                    format!("{found} (limit {:.0} us)", micros(max_p99)),
                )
            } else {
                Check::new(
                    name,
                    Outcome::Fail,
                    format!("{found}, above the limit {:.0} us", micros(max_p99)),
                )
            }
        }
        Err(error) => Check::new(name, Outcome::Fail, format!("write probe failed: {error}")),
    }
}

/// Bytes available to an unprivileged user on the filesystem holding `dir` (statvfs
/// `f_bavail * f_frsize`).
pub fn free_space_bytes(dir: &Path) -> io::Result<u64> {
    let path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs is plain data; all-zero is valid and the call overwrites it.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `stat` is live and writable.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// The `free space` check: Pass when the filesystem holding `dir` has at least `min_bytes`
/// available, Fail when less or when statvfs fails.
pub fn free_space(dir: &Path, min_bytes: u64) -> Check {
    let name = format!("free space {}", dir.display());
    match free_space_bytes(dir) {
        Ok(free) if free >= min_bytes => Check::new(
            name,
            Outcome::Pass,
            format!(
                "{} free (required {})",
                human_bytes(free),
                human_bytes(min_bytes)
            ),
        ),
        Ok(free) => Check::new(
            name,
            Outcome::Fail,
            format!(
                "{} free, below the required {}",
                human_bytes(free),
                human_bytes(min_bytes)
            ),
        ),
        Err(error) => Check::new(name, Outcome::Fail, format!("statvfs failed: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty(dir: &Path) -> bool {
        std::fs::read_dir(dir).unwrap().next().is_none()
    }

    #[test]
    fn write_probe_measures_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let rate = write_probe(dir.path(), 4096, 64 * 1024).unwrap();
        assert!(rate.mb_per_s > 0.0);
        assert!(rate.fdatasync_p50 <= rate.fdatasync_p99);
        assert!(empty(dir.path()));
        // A partial last block is written whole.
        write_probe(dir.path(), 4096, 5000).unwrap();
        assert!(empty(dir.path()));
        assert!(write_probe(dir.path(), 0, 10).is_err());
        assert!(write_probe(&dir.path().join("missing"), 4096, 4096).is_err());
    }

    #[test]
    fn write_checks() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            write_rate(dir.path(), 1024 * 1024, 0.0).outcome,
            Outcome::Pass
        );
        assert_eq!(
            write_rate(dir.path(), 256 * 1024, 1e12).outcome,
            Outcome::Fail
        );
        let slow = fdatasync_latency(dir.path(), 16 * 1024, Duration::ZERO);
        assert_eq!(slow.outcome, Outcome::Fail, "{slow:?}");
        let fine = fdatasync_latency(dir.path(), 16 * 1024, Duration::from_secs(60));
        assert_eq!(fine.outcome, Outcome::Pass, "{fine:?}");
        assert_eq!(
            write_rate(&dir.path().join("missing"), 4096, 0.0).outcome,
            Outcome::Fail
        );
        assert!(empty(dir.path()));
    }

    #[test]
    fn free_space_checks() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_space_bytes(dir.path()).unwrap() > 0);
        assert_eq!(free_space(dir.path(), 1).outcome, Outcome::Pass);
        assert_eq!(free_space(dir.path(), u64::MAX).outcome, Outcome::Fail);
        assert_eq!(
            free_space(&dir.path().join("missing"), 1).outcome,
            Outcome::Fail
        );
    }
}
