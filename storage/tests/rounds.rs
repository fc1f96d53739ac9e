//! Two rounds in flight (`LogConfig::rounds_in_flight`), stepped by hand with the fault
//! backend: the second round is submitted once the first one's write finished, completions
//! apply in round order, a failed round rejects the round in flight after it, and a power
//! cut loses exactly what no completed fdatasync covered.

mod common;

use std::time::Instant;

use common::*;
use felix_storage::{
    FaultBackend, FaultHandle, FsyncMode, Log, LogEvent, PowerCut, ShardRange, StorageError,
};

fn open_manual(dir: &std::path::Path, direct_io: bool) -> (Log<FaultBackend>, FaultHandle) {
    let mut config = small_config(dir, FsyncMode::OnCommit);
    config.direct_io = direct_io;
    config.rounds_in_flight = 2;
    let (backend, handle) = FaultBackend::new(false).expect("backend");
    let (log, _) = Log::open(config, backend).expect("open");
    (log, handle)
}

fn reopen(dir: &std::path::Path) -> Log<FaultBackend> {
    let (backend, _) = FaultBackend::new(true).expect("backend");
    Log::open(small_config(dir, FsyncMode::OnCommit), backend)
        .expect("recover")
        .0
}

fn append(log: &mut Log<FaultBackend>, shard: u32, offset: u64, payload: &[u8]) {
    log.append(shard, offset, 1, b"k", payload).expect("append");
}

/// Drives until nothing is held or in flight, completing held rounds in order.
fn settle(log: &mut Log<FaultBackend>, fault: &FaultHandle) -> Vec<LogEvent> {
    let mut events = Vec::new();
    // Bounded: each pass completes a held round or finds the log idle.
    for _ in 0..1000 {
        log.drive(Instant::now()).expect("drive");
        events.extend(drain(log));
        if !fault.complete_next() && log.is_idle() {
            return events;
        }
    }
    panic!("the log does not settle");
}

fn range(shard: u32, first: u64, end: u64) -> ShardRange {
    ShardRange { shard, first, end }
}

#[test]
fn the_second_round_is_written_during_the_first_ones_fdatasync() {
    for direct_io in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut log, fault) = open_manual(dir.path(), direct_io);
        // Round 0, synced: later rounds may claim it with a commit mark.
        append(&mut log, 0, 0, b"zero");
        settle(&mut log, &fault);
        // Round A: submitted, its write not done yet: B must wait.
        append(&mut log, 0, 1, b"a");
        log.drive(Instant::now()).expect("drive");
        assert_eq!(fault.held_rounds(), 1);
        append(&mut log, 1, 0, b"b");
        log.drive(Instant::now()).expect("drive");
        assert_eq!(
            fault.held_rounds(),
            1,
            "no second round before the write finished"
        );
        // A's write finishes (its fdatasync still runs): B goes out at A's end.
        assert!(fault.write_next());
        log.drive(Instant::now()).expect("drive");
        assert_eq!(fault.held_rounds(), 2, "B is in flight with A");
        assert_eq!(log.counters().overlapped_rounds, 1);
        assert!(
            drain(&mut log).is_empty(),
            "nothing is acked before A's fdatasync"
        );
        // A third round waits for a slot.
        append(&mut log, 2, 0, b"c");
        assert!(fault.write_next(), "B's write");
        log.drive(Instant::now()).expect("drive");
        assert_eq!(fault.held_rounds(), 2);
        // A's fdatasync completes. It started before B's write, so it does not cover B.
        assert!(fault.complete_next());
        log.drive(Instant::now()).expect("drive");
        let events = drain(&mut log);
        assert!(
            matches!(&events[..], [LogEvent::Written(w), LogEvent::Synced(s)]
                if w == &[range(0, 1, 2)] && s == &[range(0, 1, 2)]),
            "{events:?}"
        );
        // A carried the mark claiming round 0; B (staged while A's fdatasync ran) claims
        // nothing new, so it carries none.
        assert_eq!(log.counters().mark_bytes, 28);
        // The power goes: B's bytes, written after A's fdatasync started, are not durable.
        fault.power_cut(PowerCut::DropUnsynced).expect("cut");
        drop(log);
        let log = reopen(dir.path());
        assert_eq!(log.shard_offsets(0).map(|o| o.next), Some(2));
        assert_eq!(log.shard_offsets(1).map(|o| o.next), None, "B was lost");
        let got = read_all(&log, 0, 0, 10);
        assert_eq!(got.len(), 2);
        assert_eq!(&got[1].payload[..], b"a");
    }
}

#[test]
fn a_later_fdatasync_covers_the_earlier_round() {
    // B's fdatasync started after A's write: a power cut after it keeps both, even though
    // A's own fdatasync never completed.
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, fault) = open_manual(dir.path(), true);
    append(&mut log, 0, 0, b"a");
    log.drive(Instant::now()).expect("drive");
    assert!(fault.write_next());
    append(&mut log, 0, 1, b"b");
    log.drive(Instant::now()).expect("drive");
    assert_eq!(fault.held_rounds(), 2);
    assert!(fault.complete_newest(), "B completes first");
    log.drive(Instant::now()).expect("drive");
    assert!(drain(&mut log).is_empty(), "B's completion waits for A's");
    assert_eq!(log.counters().held_completions, 1);
    fault
        .power_cut(PowerCut::TearUnsynced { seed: 3 })
        .expect("cut");
    drop(log);
    let log = reopen(dir.path());
    let got = read_all(&log, 0, 0, 10);
    assert_eq!(got.len(), 2);
    assert_eq!(
        (&got[0].payload[..], &got[1].payload[..]),
        (&b"a"[..], &b"b"[..])
    );
}

#[test]
fn completions_apply_in_round_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, fault) = open_manual(dir.path(), true);
    append(&mut log, 0, 0, b"a0");
    append(&mut log, 1, 0, b"a1");
    log.drive(Instant::now()).expect("drive");
    assert!(fault.write_next());
    append(&mut log, 0, 1, b"b0");
    log.drive(Instant::now()).expect("drive");
    assert_eq!(fault.held_rounds(), 2);
    assert!(fault.complete_newest());
    log.drive(Instant::now()).expect("drive");
    assert!(drain(&mut log).is_empty());
    assert_eq!(log.shard_offsets(0).map(|o| o.written), Some(0));
    assert!(fault.complete_next());
    log.drive(Instant::now()).expect("drive");
    let events = drain(&mut log);
    let acked: Vec<Vec<ShardRange>> = events
        .iter()
        .filter_map(|e| match e {
            LogEvent::Synced(r) => Some(r.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        acked,
        vec![vec![range(0, 0, 1), range(1, 0, 1)], vec![range(0, 1, 2)]],
        "{events:?}"
    );
    assert_eq!(log.counters().held_completions, 1);
    assert!(log.is_idle());
}

#[test]
fn enospc_on_the_second_round_keeps_the_first() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, fault) = open_manual(dir.path(), true);
    append(&mut log, 0, 0, b"a");
    log.drive(Instant::now()).expect("drive");
    assert!(fault.write_next());
    append(&mut log, 0, 1, b"b");
    log.drive(Instant::now()).expect("drive");
    fault.fail_next_write(libc::ENOSPC, 10);
    assert!(fault.write_next(), "B's write fails");
    log.drive(Instant::now()).expect("drive");
    assert!(drain(&mut log).is_empty(), "B's failure waits for A");
    assert!(fault.complete_next());
    log.drive(Instant::now()).expect("drive");
    let events = drain(&mut log);
    assert!(
        matches!(&events[..], [LogEvent::Written(_), LogEvent::Synced(s), LogEvent::Rejected { ranges, error: StorageError::DiskFull }]
            if s == &[range(0, 0, 1)] && ranges == &[range(0, 1, 2)]),
        "{events:?}"
    );
    assert_eq!(log.shard_offsets(0).map(|o| o.next), Some(1));
    // The log goes on: the same offset again, over B's partial bytes.
    append(&mut log, 0, 1, b"b again");
    settle(&mut log, &fault);
    drop(log);
    let log = reopen(dir.path());
    let got = read_all(&log, 0, 0, 10);
    assert_eq!(got.len(), 2);
    assert_eq!(&got[1].payload[..], b"b again");
}

#[test]
fn enospc_on_the_first_of_two_rounds_rejects_both() {
    // No real backend reports a write finished before it did; the fault backend can, so the
    // first of two rounds in flight can fail its write. The round after it wrote its bytes
    // past the failed write: both are rejected, whatever the second's own result, and the
    // log goes on from the first rejected offsets.
    for direct_io in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut log, fault) = open_manual(dir.path(), direct_io);
        append(&mut log, 0, 0, b"synced");
        settle(&mut log, &fault);
        fault.report_writes_early(true);
        append(&mut log, 0, 1, b"a0");
        append(&mut log, 1, 0, b"a1");
        log.drive(Instant::now()).expect("drive");
        append(&mut log, 0, 2, b"b0");
        log.drive(Instant::now()).expect("drive");
        assert_eq!(fault.held_rounds(), 2);
        append(&mut log, 1, 1, b"pending");
        fault.fail_next_write(libc::ENOSPC, 40);
        assert!(fault.write_next(), "A's write fails after 40 bytes");
        assert!(fault.complete_next(), "B is written and synced");
        log.drive(Instant::now()).expect("drive");
        let events = drain(&mut log);
        assert!(
            matches!(&events[..], [LogEvent::Rejected { ranges, error: StorageError::DiskFull }]
                if ranges == &[range(0, 1, 2), range(1, 0, 1), range(0, 2, 3), range(1, 1, 2)]),
            "{events:?}"
        );
        assert_eq!(log.counters().doomed_rounds, 1);
        assert_eq!(log.shard_offsets(0).map(|o| o.next), Some(1));
        assert_eq!(log.shard_offsets(1), None, "shard 1 never reached the disk");
        fault.report_writes_early(false);
        // Retried at the same offsets; the new round covers both failed rounds' bytes.
        append(&mut log, 0, 1, b"a0 again");
        append(&mut log, 1, 0, b"a1 again");
        let events = settle(&mut log, &fault);
        assert!(
            events
                .iter()
                .all(|e| !matches!(e, LogEvent::Rejected { .. })),
            "{events:?}"
        );
        log.sync_now();
        settle(&mut log, &fault);
        drop(log);
        let log = reopen(dir.path());
        let zero = read_all(&log, 0, 0, 10);
        let one = read_all(&log, 1, 0, 10);
        let payloads =
            |v: &[felix_storage::Record]| v.iter().map(|r| r.payload.to_vec()).collect::<Vec<_>>();
        assert_eq!(
            payloads(&zero),
            vec![b"synced".to_vec(), b"a0 again".to_vec()]
        );
        assert_eq!(payloads(&one), vec![b"a1 again".to_vec()]);
    }
}

#[test]
fn one_round_in_flight_when_configured() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = small_config(dir.path(), FsyncMode::OnCommit);
    config.rounds_in_flight = 1;
    let (backend, fault) = FaultBackend::new(false).expect("backend");
    let (mut log, _) = Log::open(config, backend).expect("open");
    append(&mut log, 0, 0, b"a");
    log.drive(Instant::now()).expect("drive");
    assert!(fault.write_next());
    append(&mut log, 0, 1, b"b");
    log.drive(Instant::now()).expect("drive");
    assert_eq!(fault.held_rounds(), 1);
    settle(&mut log, &fault);
    assert_eq!(log.counters().overlapped_rounds, 0);
    assert_eq!(log.shard_offsets(0).map(|o| o.synced), Some(2));
}

#[test]
fn rounds_in_flight_is_one_or_two() {
    for bad in [0, 3] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = small_config(dir.path(), FsyncMode::OnCommit);
        config.rounds_in_flight = bad;
        let (backend, _) = FaultBackend::new(true).expect("backend");
        match Log::open(config, backend) {
            Err(StorageError::Config(why)) => assert!(why.contains("rounds_in_flight"), "{why}"),
            other => panic!("rounds_in_flight {bad} accepted: {other:?}"),
        }
    }
}

/// `sync_now` while a synced round is in flight: the records appended after that round was
/// submitted get an fdatasync of their own (the request used to be cleared by the earlier
/// round's fdatasync, leaving them written but unsynced for a whole interval).
#[test]
fn a_sync_asked_during_a_synced_round_covers_the_records_appended_after_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = small_config(
        dir.path(),
        FsyncMode::Periodic {
            interval: std::time::Duration::from_secs(3600),
        },
    );
    config.rounds_in_flight = 2;
    let (backend, fault) = FaultBackend::new(false).expect("backend");
    let (mut log, _) = Log::open(config, backend).expect("open");
    append(&mut log, 0, 0, b"zero");
    log.sync_now();
    log.drive(Instant::now()).expect("drive");
    assert_eq!(
        fault.held_rounds(),
        1,
        "round 0, with its fdatasync, is in flight"
    );
    append(&mut log, 0, 1, b"one");
    log.sync_now();
    log.drive(Instant::now()).expect("drive");
    assert!(fault.complete_next(), "round 0 completes");
    settle(&mut log, &fault);
    let offsets = log.shard_offsets(0).expect("shard 0");
    assert_eq!(offsets.written, 2);
    assert_eq!(offsets.synced, 2, "the second sync_now is not lost");
}
