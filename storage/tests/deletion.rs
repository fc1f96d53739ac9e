//! Deleting streams frees disk, on real files: releasing a deleted stream's shards gives back
//! at once every closed segment that held only their records (the oldest deleted, the others
//! cut to their header), recovery then ignores those shards, and `felix log compact`
//! (`offline::compact`) rewrites the remaining segments without their records, every live
//! record kept byte-identical at its offset.

mod common;

use common::*;
use felix_storage::{DirLock, FaultBackend, Log, Released, offline};

/// Shard 1 is a "deleted stream"; shards 2 and 3 live. The log is laid out so that some
/// closed segments hold only shard 1, one mixes it with live shards, and the active one is
/// live only.
fn layout(dir: &std::path::Path) -> Model {
    let cfg = small_config(dir, felix_storage::FsyncMode::OnCommit);
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (mut log, _) = Log::open(cfg, backend).expect("open");
    let mut model = Model::default();
    let mut rng = Rng(73);
    let mut write = |log: &mut Log<FaultBackend>, model: &mut Model, shards: &[u32], n: usize| {
        for i in 0..n {
            model.append(log, &mut rng, shards[i % shards.len()], 8, 600);
            if i % 5 == 4 {
                log.flush(DEADLINE).expect("flush");
            }
        }
        log.flush(DEADLINE).expect("flush");
    };
    write(&mut log, &mut model, &[2], 30);
    write(&mut log, &mut model, &[1], 200);
    write(&mut log, &mut model, &[1, 2, 3], 60);
    write(&mut log, &mut model, &[1], 120);
    write(&mut log, &mut model, &[2, 3], 60);
    model
}

fn live(shard: u32) -> bool {
    shard != 1
}

fn check_live(log: &Log<FaultBackend>, model: &Model) {
    for shard in [2u32, 3] {
        let got = read_all(log, shard, 0, 100);
        let want = &model.shards[&shard];
        assert_eq!(got.len(), want.len(), "shard {shard}");
        assert!(
            got.iter().zip(want).all(|(g, e)| same(g, e)),
            "shard {shard}"
        );
        assert_eq!(
            log.shard_offsets(shard).map(|o| o.next),
            Some(model.next_offset(shard))
        );
    }
    assert_eq!(log.shard_offsets(1), None, "the released shard is gone");
    assert!(log.read(1, 0, 10, usize::MAX).expect("read").is_empty());
}

#[test]
fn releasing_a_deleted_stream_frees_its_segments_at_once() {
    // Closed segments with only the released shard's records are deleted (oldest) or cut to their header (middle); live records and offsets are untouched, and recovery ignores the released shard.
    let dir = tempfile::tempdir().expect("tempdir");
    let model = layout(dir.path());
    let (mut log, _) = open_fault(dir.path()).expect("open");
    let before = log.total_bytes();
    let segments_before = log.segment_seqs();
    let report = log.release_shards(live).expect("release");
    assert_eq!(report.shards, vec![1]);
    assert!(report.segments.len() >= 2, "{report:?}");
    assert!(report.bytes_freed > 0);
    assert_eq!(log.total_bytes(), before - report.bytes_freed);
    assert_eq!(log.counters().released_bytes, report.bytes_freed);
    assert_eq!(
        log.segment_seqs(),
        segments_before,
        "the oldest segment holds shard 2: nothing deleted at the front"
    );
    check_live(&log, &model);
    assert!(log.released().contains(1));
    let files: u64 = segments_before
        .iter()
        .map(|s| {
            std::fs::metadata(dir.path().join(felix_storage::segment::file_name(*s)))
                .expect("stat")
                .len()
        })
        .sum();
    assert_eq!(files, log.total_bytes(), "the files shrank");
    // Appends continue; a second release finds nothing.
    let next = log.shard_offsets(2).map(|o| o.next).expect("shard 2");
    log.append(2, next, 1, b"k", b"after release")
        .expect("append");
    log.flush(DEADLINE).expect("flush");
    assert!(log.release_shards(live).expect("release").shards.is_empty());
    drop(log);
    let (log, report) = open_fault(dir.path()).expect("reopen");
    assert_eq!(report.released_shards, 1);
    assert_eq!(Released::load(dir.path()).expect("released").len(), 1);
    assert_eq!(
        log.read(2, next, 1, usize::MAX).expect("read")[0].payload,
        &b"after release"[..]
    );
    let mut model = model;
    model.shards.get_mut(&2).expect("shard 2").push(Expected {
        shard: 2,
        offset: next,
        timestamp_us: 1,
        key: b"k".to_vec(),
        payload: b"after release".to_vec(),
    });
    check_live(&log, &model);
}

#[test]
fn the_oldest_segments_are_deleted_when_they_hold_only_released_records() {
    // When the log starts with segments of the released shard only, they are deleted outright and the log starts later.
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(dir.path(), felix_storage::FsyncMode::OnCommit);
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (mut log, _) = Log::open(cfg, backend).expect("open");
    let mut model = Model::default();
    let mut rng = Rng(79);
    for i in 0..300 {
        let shard = if i < 200 { 1 } else { 2 };
        model.append(&mut log, &mut rng, shard, 8, 600);
        if i % 5 == 4 {
            log.flush(DEADLINE).expect("flush");
        }
    }
    log.flush(DEADLINE).expect("flush");
    let before = log.segment_seqs();
    let report = log.release_shards(|s| s == 2).expect("release");
    let after = log.segment_seqs();
    assert!(after.len() < before.len(), "{before:?} -> {after:?}");
    assert_eq!(after.last(), before.last());
    for seq in &report.segments {
        if !after.contains(seq) {
            assert!(
                !dir.path()
                    .join(felix_storage::segment::file_name(*seq))
                    .exists()
            );
        }
    }
    let got = read_all(&log, 2, 0, 100);
    assert_eq!(got.len(), 100);
    drop(log);
    let (log, _) = open_fault(dir.path()).expect("reopen");
    assert_eq!(log.segment_seqs(), after);
    assert_eq!(read_all(&log, 2, 0, 100).len(), 100);
}

#[test]
fn compaction_drops_deleted_streams_records_and_keeps_offsets() {
    // Offline compaction rewrites every segment holding deleted shards' records without them: live records keep their offsets and bytes, the log shrinks, and appends continue.
    let dir = tempfile::tempdir().expect("tempdir");
    let model = layout(dir.path());
    let open_before = open_fault(dir.path()).expect("open").0;
    let bytes_before = open_before.total_bytes();
    // Compaction refuses while the log is open.
    assert!(DirLock::acquire(dir.path()).is_err());
    drop(open_before);
    let lock = DirLock::acquire(dir.path()).expect("lock");
    let (report, lock) = offline::compact(lock, &live).expect("compact");
    drop(lock);
    assert_eq!(report.released, vec![1]);
    assert!(!report.rewritten.is_empty(), "{report:?}");
    assert!(!report.emptied.is_empty(), "{report:?}");
    assert_eq!(report.records_dropped, model.shards[&1].len() as u64);
    assert_eq!(report.bytes_before, bytes_before);
    assert!(report.bytes_after < report.bytes_before, "{report:?}");
    let (mut log, recovered) = open_fault(dir.path()).expect("open");
    assert_eq!(
        recovered.records,
        model.records() - model.shards[&1].len() as u64
    );
    check_live(&log, &model);
    let lock_check = {
        let next = log.shard_offsets(3).map(|o| o.next).expect("shard 3");
        log.append(3, next, 1, b"k", b"after compaction")
            .expect("append");
        log.flush(DEADLINE).expect("flush");
        next
    };
    drop(log);
    let lock = DirLock::acquire(dir.path()).expect("lock");
    let check = offline::check(&lock).expect("check");
    assert!(check.is_clean(), "{check:?}");
    assert!(check.segments.iter().all(|s| s.released_records == 0));
    // Compacting again changes nothing.
    let (again, lock) = offline::compact(lock, &live).expect("compact");
    drop(lock);
    assert!(again.released.is_empty() && again.rewritten.is_empty() && again.emptied.is_empty());
    let (log, _) = open_fault(dir.path()).expect("open");
    assert_eq!(
        log.read(3, lock_check, 1, usize::MAX).expect("read")[0].payload,
        &b"after compaction"[..]
    );
}
