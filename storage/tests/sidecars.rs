//! Sidecar indexes and the directory lock, on real files: recovery loads closed segments
//! from their sidecars (scanning only the active segment) and rebuilds exactly the state a
//! full scan rebuilds; a damaged, stale or mismatched sidecar falls back to a scan and is
//! rewritten; a log directory is opened by one owner at a time.

mod common;

use std::path::Path;

use common::*;
use felix_storage::{
    DirLock, FaultBackend, FsyncMode, IndexEntry, Log, ShardOffsets, StorageError, offline,
    segment, sidecar,
};

/// Everything a reader can observe of a log: offsets, index and records of every shard.
fn observe(log: &Log<FaultBackend>) -> Vec<(u32, Option<ShardOffsets>, Vec<IndexEntry>, usize)> {
    log.shard_ids()
        .into_iter()
        .map(|s| {
            (
                s,
                log.shard_offsets(s),
                log.index_entries(s),
                read_all(log, s, 0, 100).len(),
            )
        })
        .collect()
}

fn sidecar_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .expect("list")
        .filter(|e| {
            e.as_ref()
                .expect("entry")
                .path()
                .extension()
                .is_some_and(|x| x == "idx")
        })
        .count()
}

#[test]
fn recovery_reads_sidecars_and_matches_a_full_scan() {
    // Every closed segment gets a sidecar when it closes; recovery loads them without scanning and rebuilds the same offsets, index and records as a full scan.
    let dir = tempfile::tempdir().expect("tempdir");
    let model = build_log(dir.path(), 400, 4, 61);
    let seqs = segment_seqs(dir.path());
    assert!(seqs.len() >= 4, "{seqs:?}");
    assert_eq!(
        sidecar_files(dir.path()),
        seqs.len() - 1,
        "one per closed segment"
    );
    let (log, report) = open_fault(dir.path()).expect("open");
    assert_eq!(report.sidecar_segments, seqs.len() - 1);
    assert_eq!(report.sidecars_written, 0);
    assert_eq!(report.records, model.records());
    let active_bytes = (32 << 10) as u64;
    assert!(
        report.scanned_bytes <= active_bytes,
        "only the active segment is scanned: {} bytes",
        report.scanned_bytes
    );
    let with_sidecars = observe(&log);
    for (&shard, want) in &model.shards {
        let got = read_all(&log, shard, 0, 100);
        assert!(got.len() == want.len() && got.iter().zip(want).all(|(g, e)| same(g, e)));
    }
    drop(log);
    remove_sidecars(dir.path());
    let (log, report) = open_fault(dir.path()).expect("open by scanning");
    assert_eq!(report.sidecar_segments, 0);
    assert_eq!(
        report.sidecars_written,
        seqs.len() - 1,
        "rewritten by the scan"
    );
    assert_eq!(observe(&log), with_sidecars, "the same state either way");
    drop(log);
    let (_, report) = open_fault(dir.path()).expect("reopen");
    assert_eq!(report.sidecar_segments, seqs.len() - 1);
}

#[test]
fn bad_stale_or_mismatched_sidecars_fall_back_to_a_scan() {
    // A flipped byte, a sidecar of another segment, or another index interval: recovery scans that segment instead, rewrites its sidecar, and ends in the same state.
    let dir = tempfile::tempdir().expect("tempdir");
    build_log(dir.path(), 400, 3, 67);
    let seqs = segment_seqs(dir.path());
    let (log, _) = open_fault(dir.path()).expect("open");
    let reference = observe(&log);
    drop(log);
    // A flipped byte.
    flip(&sidecar::path(dir.path(), seqs[1]), 40, 0x04);
    let (log, report) = open_fault(dir.path()).expect("open");
    assert_eq!(report.sidecar_segments, seqs.len() - 2);
    assert_eq!(report.sidecars_written, 1);
    assert_eq!(observe(&log), reference);
    drop(log);
    // Another segment's sidecar in its place.
    std::fs::copy(
        sidecar::path(dir.path(), seqs[0]),
        sidecar::path(dir.path(), seqs[2]),
    )
    .expect("copy");
    let (log, report) = open_fault(dir.path()).expect("open");
    assert_eq!(report.sidecars_written, 1);
    assert_eq!(observe(&log), reference);
    drop(log);
    // Another index interval: every sidecar is rebuilt, the index follows the new interval.
    let mut cfg = small_config(dir.path(), FsyncMode::OnCommit);
    cfg.index_interval_bytes = 8192;
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (log, report) = Log::open(cfg.clone(), backend).expect("open");
    assert_eq!(report.sidecar_segments, 0);
    assert_eq!(report.sidecars_written, seqs.len() - 1);
    let rebuilt = observe(&log);
    drop(log);
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (log, report) = Log::open(cfg, backend).expect("open");
    assert_eq!(report.sidecar_segments, seqs.len() - 1);
    assert_eq!(observe(&log), rebuilt);
    // An orphan sidecar (its segment gone) is removed.
    drop(log);
    std::fs::copy(
        sidecar::path(dir.path(), seqs[0]),
        sidecar::path(dir.path(), 999),
    )
    .expect("copy");
    let (_, _) = open_fault(dir.path()).expect("open");
    assert!(!sidecar::path(dir.path(), 999).exists());
}

#[test]
fn a_log_directory_has_one_owner() {
    // While a log is open, a second open and every offline command are refused with Locked; after it closes they run.
    let dir = tempfile::tempdir().expect("tempdir");
    build_log(dir.path(), 50, 2, 71);
    let (log, _) = open_fault(dir.path()).expect("open");
    let second = open_fault(dir.path()).expect_err("second owner");
    assert!(matches!(second, StorageError::Locked { .. }), "{second}");
    assert!(second.to_string().contains("in use"), "{second}");
    let offline = DirLock::acquire(dir.path()).expect_err("offline command");
    assert!(matches!(offline, StorageError::Locked { .. }));
    drop(log);
    let lock = DirLock::acquire(dir.path()).expect("free");
    let report = offline::check(&lock).expect("check");
    assert!(report.is_clean(), "{report:?}");
    assert!(
        report
            .segments
            .iter()
            .all(|s| s.damage.is_empty() && s.torn_tail.is_none())
    );
    assert!(
        report.segments[..report.segments.len() - 1]
            .iter()
            .all(|s| s.sidecar == offline::SidecarStatus::Matches),
        "{report:?}"
    );
    let error = open_fault(dir.path()).expect_err("the command holds it");
    assert!(matches!(error, StorageError::Locked { .. }));
    drop(lock);
    assert!(dir.path().join(segment::file_name(0)).exists());
}
