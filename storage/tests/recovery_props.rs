//! Damage inside committed data, on real files: one flipped byte anywhere (a record's
//! boundary, inside a record, a commit mark, a header) of a flushed log never makes recovery
//! silently drop a record or reuse an offset. Recovery either refuses with `CorruptLog`
//! (naming the directory, the segment file, the byte, the attributable offsets and the repair
//! command) or, for a damaged final commit mark, loses nothing; `felix log repair`
//! (`offline::repair`) then quarantines exactly what was lost, every other record is served
//! byte-identical at its offset, reads skip the quarantined offsets (counted), and new appends
//! get offsets past every offset handed out. A torn tail is still cut silently.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::*;
use felix_storage::frame::{self, HEADER_BYTES};
use felix_storage::{DirLock, FaultBackend, Log, Record, StorageError, offline, segment};
use proptest::prelude::*;

/// What the log must still hold after damage to `damaged` (a record frame, or a mark/header
/// when `None`): every other record of the model, byte-identical at its offset.
fn check_survivors(log: &Log<FaultBackend>, model: &Model, damaged: Option<(u32, u64)>) {
    for (&shard, want) in &model.shards {
        let got = read_all(log, shard, 0, 64);
        let expected: Vec<&Expected> = want
            .iter()
            .filter(|e| Some((e.shard, e.offset)) != damaged)
            .collect();
        assert_eq!(
            got.iter().map(|r| r.offset).collect::<Vec<_>>(),
            expected.iter().map(|e| e.offset).collect::<Vec<_>>(),
            "shard {shard}: every undamaged record is served at its offset"
        );
        assert!(
            got.iter().zip(&expected).all(|(g, e)| same(g, e)),
            "shard {shard}: byte-identical"
        );
        let next = log.shard_offsets(shard).map_or(0, |o| o.next);
        assert!(
            next >= model.next_offset(shard),
            "shard {shard}: next offset {next} is past every offset handed out ({})",
            model.next_offset(shard)
        );
    }
}

/// Repairs `dir` and checks the outcome against the model; returns the reopened log.
fn repair_and_verify(dir: &Path, model: &Model, damaged: Option<(u32, u64)>) -> Log<FaultBackend> {
    let lock = DirLock::acquire(dir).expect("lock");
    let before = offline::check(&lock).expect("check");
    assert!(!before.is_clean(), "check sees the damage: {before:?}");
    let (report, lock) = offline::repair(lock).expect("repair");
    drop(lock);
    if let Some((shard, offset)) = damaged {
        assert!(
            report
                .quarantined
                .iter()
                .any(|q| q.shard == shard && q.first <= offset && offset < q.end),
            "the damaged record's offset {offset} of shard {shard} is quarantined: {:?}; check: {before:?}",
            report.quarantined
        );
    }
    let after = offline::check(&DirLock::acquire(dir).expect("lock")).expect("check");
    assert!(after.is_clean(), "repaired: {after:?}");
    let (mut log, reopened) = open_fault(dir).expect("the repaired log opens");
    assert_eq!(reopened.truncated_bytes, 0);
    check_survivors(&log, model, damaged);
    if damaged.is_some() {
        assert!(log.counters().quarantined_records >= 1);
        assert!(
            log.counters().quarantine_skipped_records.get() >= 1,
            "reads skipped the quarantined offset"
        );
    }
    // New appends continue past every offset handed out, and survive a restart.
    let shards: Vec<u32> = model.shards.keys().copied().collect();
    let mut appended = Vec::new();
    for &shard in &shards {
        let next = log.shard_offsets(shard).map_or(0, |o| o.next);
        log.append(shard, next, 9, b"after", b"repair")
            .expect("append after repair");
        appended.push((shard, next));
    }
    log.flush(DEADLINE).expect("flush");
    drop(log);
    let (log, again) = open_fault(dir).expect("reopen after appends");
    assert_eq!(again.truncated_bytes, 0);
    for (shard, offset) in appended {
        let got: Vec<Record> = log.read(shard, offset, 1, usize::MAX).expect("read");
        assert_eq!(
            got.first().map(|r| (r.offset, &r.payload[..])),
            Some((offset, &b"repair"[..]))
        );
    }
    log
}

/// Checks the refusal's message names everything the operator needs.
fn check_refusal(error: &StorageError, dir: &Path, seq: u64, position: u64) {
    let StorageError::CorruptLog(c) = error else {
        panic!("expected CorruptLog, got {error}");
    };
    assert_eq!((c.segment, c.position), (seq, position), "{error}");
    let message = error.to_string();
    for needle in [
        dir.display().to_string(),
        segment::file_name(seq),
        format!("at byte {position}"),
        "felix log repair --data-dir".to_string(),
    ] {
        assert!(message.contains(&needle), "{needle:?} not in: {message}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn one_flipped_byte_is_refused_and_repaired_or_harmless(
        batches in prop::collection::vec(prop::collection::vec((0u32..3, 0usize..8, 0usize..700), 1..12), 1..25),
        segment_pick in any::<prop::sample::Index>(),
        position_pick in any::<prop::sample::Index>(),
        x in 1u8..=255,
    ) {
        // A flipped byte anywhere in a flushed log's headers or frames: recovery refuses naming it (or, for the final commit mark, loses nothing), and repair keeps every other record at its offset.
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = small_config(dir.path(), felix_storage::FsyncMode::OnCommit);
        let (backend, _) = FaultBackend::new(true).expect("backend");
        let (mut log, _) = Log::open(cfg, backend).expect("open");
        let mut model = Model::default();
        let mut rng = Rng(batches.len() as u64);
        for batch in &batches {
            for &(shard, key, payload) in batch {
                model.append(&mut log, &mut rng, shard, key, payload);
            }
            // Each batch ends like a clean stop: synced, with a commit mark proving it.
            log.sync_now();
            log.flush(DEADLINE).expect("flush");
        }
        drop(log);
        let (segs, placed) = parse_files(dir.path());
        prop_assert_eq!(placed.iter().filter(|p| p.record.is_some()).count() as u64, model.records());
        let seqs: Vec<u64> = segs.keys().copied().collect();
        let seq = seqs[segment_pick.index(seqs.len())];
        let (_, data_end) = segs[&seq];
        let pos = position_pick.index(data_end as usize) as u64;
        // Every segment is scanned (no sidecar), so recovery itself meets the damage.
        remove_sidecars(dir.path());
        flip(&dir.path().join(segment::file_name(seq)), pos, x);
        let hit = placed.iter().find(|p| p.seq == seq && p.start <= pos && pos < p.end);
        let damaged = hit.and_then(|p| p.record);
        match open_fault(dir.path()) {
            Ok((log, report)) => {
                // Only the newest segment's last frame, a commit mark, may be lost silently.
                let last = placed.last().expect("frames");
                prop_assert!(hit == Some(last) && last.record.is_none(), "damage at {seq}:{pos} ({hit:?}) went unnoticed");
                prop_assert_eq!(report.records, model.records());
                check_survivors(&log, &model, None);
            }
            Err(error) => {
                let StorageError::CorruptLog(c) = &error else {
                    panic!("expected CorruptLog, got {error}");
                };
                prop_assert_eq!(c.segment, seq);
                prop_assert!(c.position <= pos || hit.is_none(), "{}", error);
                check_refusal(&error, dir.path(), seq, c.position);
                repair_and_verify(dir.path(), &model, damaged);
            }
        }
    }
}

/// The record frames of segment `seq`.
fn records_of(placed: &[Placed], seq: u64) -> Vec<Placed> {
    placed
        .iter()
        .filter(|p| p.seq == seq && p.record.is_some())
        .cloned()
        .collect()
}

/// Runs one damage case on a copy of `pristine`: flips `pos` of segment `seq`, expects the
/// damage to be found (by a read when the segment is closed and has a sidecar, then by
/// recovery), repairs and verifies.
fn damage_case(
    pristine: &Path,
    model: &Model,
    seq: u64,
    pos: u64,
    damaged: (u32, u64),
    newest: bool,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_dir(pristine, dir.path());
    std::fs::remove_file(dir.path().join(felix_storage::LOCK_FILE)).expect("lock file");
    flip(&dir.path().join(segment::file_name(seq)), pos, 0x5A);
    if !newest {
        // A closed segment with its sidecar: recovery does not read it, so the log opens;
        // the first read through the damage fails (fatal) and removes the sidecar.
        let (log, report) = open_fault(dir.path()).expect("opens from the sidecars");
        assert!(report.sidecar_segments > 0);
        let error = log
            .read(damaged.0, 0, usize::MAX, usize::MAX)
            .expect_err("the read meets the damage");
        assert!(
            matches!(error, StorageError::Corrupt { segment, .. } if segment == seq),
            "{error}"
        );
        assert!(error.is_fatal());
        assert!(
            !dir.path()
                .join(felix_storage::sidecar::file_name(seq))
                .exists()
        );
    }
    let error = open_fault(dir.path()).expect_err("recovery refuses");
    check_refusal(&error, dir.path(), seq, placed_start(pos, dir.path(), seq));
    let message = error.to_string();
    assert!(
        message.contains(&format!(
            "shard {} offsets {}..{}",
            damaged.0,
            damaged.1,
            damaged.1 + 1
        )),
        "the damaged record is attributed: {message}"
    );
    repair_and_verify(dir.path(), model, Some(damaged));
}

/// Where the frame holding `pos` starts (the bad frame recovery reports).
fn placed_start(pos: u64, dir: &Path, seq: u64) -> u64 {
    // The pristine layout is the damaged copy's, but for the flipped frame, which the
    // parser stops at: take the end of the last frame before it.
    let path = dir.join(segment::file_name(seq));
    let bytes = std::fs::read(&path).expect("read");
    let file = std::fs::File::open(&path).expect("open");
    let header = segment::read_header(&file, bytes.len() as u64).expect("header");
    let mut at = header.header_bytes as usize;
    while (at as u64) <= pos {
        let len = match frame::decode(&bytes[at..]) {
            frame::Decoded::Record { frame_bytes, .. } => frame_bytes,
            frame::Decoded::Mark { .. } => frame::MARK_BYTES,
            _ => break,
        };
        if at as u64 + len as u64 > pos {
            break;
        }
        at += len;
    }
    at as u64
}

#[test]
fn every_record_boundary_and_inside_of_a_closed_segment() {
    // A flipped byte at each record's first byte and in its middle, in a closed segment: the read that meets it fails and drops the sidecar, recovery then refuses naming the record, repair quarantines exactly it.
    let pristine = tempfile::tempdir().expect("tempdir");
    let model = build_log(pristine.path(), 400, 3, 41);
    let (_, placed) = parse_files(pristine.path());
    let seqs = segment_seqs(pristine.path());
    assert!(seqs.len() >= 3, "several segments: {seqs:?}");
    let seq = seqs[1];
    let records = records_of(&placed, seq);
    assert!(records.len() >= 5, "a closed segment with records");
    let mut cases = 0;
    for p in &records {
        let Some(damaged) = p.record else { continue };
        for pos in [p.start, p.start + (p.end - p.start) / 2] {
            damage_case(pristine.path(), &model, seq, pos, damaged, false);
            cases += 1;
        }
    }
    assert_eq!(cases, 2 * records.len());
}

#[test]
fn newest_segment_damage_before_its_last_record_is_refused() {
    // In the active segment, a flipped byte in any record (all proven by the final commit mark) stops recovery; repair keeps every other record.
    let pristine = tempfile::tempdir().expect("tempdir");
    let model = build_log(pristine.path(), 120, 3, 43);
    let (_, placed) = parse_files(pristine.path());
    let newest = *segment_seqs(pristine.path()).last().expect("segments");
    let records = records_of(&placed, newest);
    assert!(!records.is_empty());
    assert!(
        placed
            .last()
            .is_some_and(|p| p.record.is_none() && p.seq == newest),
        "a flushed log ends with a commit mark"
    );
    for p in &records {
        let Some(damaged) = p.record else { continue };
        damage_case(pristine.path(), &model, newest, p.start + 3, damaged, true);
    }
}

#[test]
fn torn_tail_after_the_last_mark_is_cut_silently() {
    // Bytes after the last commit mark's claim (garbage, a lost sector then an intact record, a stale mark) are a torn write: cut without an error, every record kept.
    let pristine = tempfile::tempdir().expect("tempdir");
    let model = build_log(pristine.path(), 60, 2, 47);
    let (segs, _) = parse_files(pristine.path());
    let (&newest, &(_, end)) = segs.iter().next_back().expect("segments");
    let mut valid = Vec::new();
    frame::encode(
        &mut valid,
        0,
        999,
        1,
        b"k",
        b"orphan record past a lost sector",
    );
    let mut stale_mark = Vec::new();
    frame::encode_mark(&mut stale_mark, end, 1);
    let cases: Vec<Vec<u8>> = vec![
        (0..300u32).map(|i| (i * 7 + 3) as u8).collect(),
        [vec![0u8; 512], valid.clone()].concat(),
        [vec![0xEEu8; HEADER_BYTES], stale_mark, valid].concat(),
    ];
    for garbage in cases {
        let dir = tempfile::tempdir().expect("tempdir");
        copy_dir(pristine.path(), dir.path());
        std::fs::remove_file(dir.path().join(felix_storage::LOCK_FILE)).expect("lock file");
        let path = dir.path().join(segment::file_name(newest));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open");
        std::os::unix::fs::FileExt::write_all_at(&f, &garbage, end).expect("garbage");
        let (log, report) = open_fault(dir.path()).expect("a torn tail never stops recovery");
        assert_eq!(report.truncations.len(), 1, "{report:?}");
        assert_eq!(report.truncations[0].position, end);
        assert!(report.truncated_bytes > 0);
        assert_eq!(report.records, model.records());
        check_survivors(&log, &model, None);
        drop(log);
        let (_, again) = open_fault(dir.path()).expect("reopen");
        assert!(again.truncations.is_empty(), "the cut is durable");
    }
}

#[test]
fn damaged_header_and_missing_segment_are_repaired() {
    // A damaged segment header and a deleted middle segment both stop recovery; repair rebuilds the header (keeping its records) and replaces the missing segment with a placeholder, quarantining the offsets it held.
    let pristine = tempfile::tempdir().expect("tempdir");
    let model = build_log(pristine.path(), 400, 3, 53);
    let seqs = segment_seqs(pristine.path());
    assert!(seqs.len() >= 4);
    // A header byte (inside the checkpoint or the padding).
    let dir = tempfile::tempdir().expect("tempdir");
    copy_dir(pristine.path(), dir.path());
    std::fs::remove_file(dir.path().join(felix_storage::LOCK_FILE)).expect("lock file");
    remove_sidecars(dir.path());
    flip(&dir.path().join(segment::file_name(seqs[1])), 100, 0x01);
    let error = open_fault(dir.path()).expect_err("refused");
    check_refusal(&error, dir.path(), seqs[1], 0);
    assert!(
        error.to_string().contains("invalid segment header"),
        "{error}"
    );
    repair_and_verify(dir.path(), &model, None);
    // A missing segment.
    let dir = tempfile::tempdir().expect("tempdir");
    copy_dir(pristine.path(), dir.path());
    std::fs::remove_file(dir.path().join(felix_storage::LOCK_FILE)).expect("lock file");
    let (_, placed) = parse_files(dir.path());
    let lost: BTreeSet<(u32, u64)> = placed
        .iter()
        .filter(|p| p.seq == seqs[2])
        .filter_map(|p| p.record)
        .collect();
    std::fs::remove_file(dir.path().join(segment::file_name(seqs[2]))).expect("remove");
    let error = open_fault(dir.path()).expect_err("refused");
    check_refusal(&error, dir.path(), seqs[2], 0);
    assert!(
        error.to_string().contains("segment file missing"),
        "{error}"
    );
    let lock = DirLock::acquire(dir.path()).expect("lock");
    let (report, lock) = offline::repair(lock).expect("repair");
    drop(lock);
    assert_eq!(report.placeholders, vec![seqs[2]]);
    let quarantined: u64 = report.quarantined.iter().map(|q| q.end - q.first).sum();
    assert_eq!(
        quarantined,
        lost.len() as u64,
        "exactly the missing segment's records"
    );
    let (log, _) = open_fault(dir.path()).expect("opens");
    for (&shard, want) in &model.shards {
        let got = read_all(&log, shard, 0, 64);
        let kept: Vec<&Expected> = want
            .iter()
            .filter(|e| !lost.contains(&(shard, e.offset)))
            .collect();
        assert_eq!(got.len(), kept.len());
        assert!(got.iter().zip(&kept).all(|(g, e)| same(g, e)));
    }
    assert_eq!(log.counters().quarantined_records, lost.len() as u64);
}

#[test]
fn check_changes_nothing_and_repair_of_a_clean_log_is_a_no_op() {
    // check only reads (the files stay byte-identical); repair of a clean log rewrites and quarantines nothing.
    let dir = tempfile::tempdir().expect("tempdir");
    build_log(dir.path(), 80, 2, 59);
    let seqs = segment_seqs(dir.path());
    let snapshot = |d: &Path| -> Vec<Vec<u8>> {
        seqs.iter()
            .map(|s| std::fs::read(d.join(segment::file_name(*s))).expect("read"))
            .collect()
    };
    flip(&dir.path().join(segment::file_name(seqs[0])), 5000, 0x10);
    let before = snapshot(dir.path());
    let lock = DirLock::acquire(dir.path()).expect("lock");
    let report = offline::check(&lock).expect("check");
    assert!(!report.is_clean());
    assert_eq!(report.segments[0].damage.len(), 1, "{report:?}");
    assert_eq!(snapshot(dir.path()), before, "check changes nothing");
    let (repaired, lock) = offline::repair(lock).expect("repair");
    assert_eq!(repaired.rewritten, vec![seqs[0]]);
    let (again, _) = offline::repair(lock).expect("second repair");
    assert!(again.check.is_clean());
    assert!(again.rewritten.is_empty() && again.quarantined.is_empty());
}
