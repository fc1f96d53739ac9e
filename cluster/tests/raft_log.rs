//! `RaftLog` (cluster/src/raft_log.rs): durability across reopen, the Raft overwrite rule,
//! compaction and snapshots with their generation switch, torn tails and failed fsyncs, and
//! a seeded comparison against raft-rs's `MemStorage`, periodic acknowledgements and the
//! commit index written in the background; and the shard groups' shared log (`SharedLog`).
//! Each test works in its own temporary directory;
//! nothing sleeps or depends on timing (the periodic fdatasync is driven with a clock value).

use std::path::Path;
use std::time::{Duration, Instant};

use felix_cluster::raft_log::{RaftLog, RaftLogError, SharedLog, raft_log_config};
use felix_storage::{
    BackendChoice, FaultBackend, FaultHandle, FsyncMode, LogConfig, PowerCut, Released,
    SystemBackend, frame, segment,
};
use raft::prelude::{ConfState, Entry, HardState, Snapshot};
use raft::storage::MemStorage;
use raft::{GetEntriesContext, Storage};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
    Entry {
        index,
        term,
        data: data.to_vec().into(),
        ..Default::default()
    }
}

fn entries(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<Entry> {
    range
        .map(|i| entry(i, term, format!("entry {i} term {term}").as_bytes()))
        .collect()
}

fn hard_state(term: u64, vote: u64, commit: u64) -> HardState {
    HardState {
        term,
        vote,
        commit,
        ..Default::default()
    }
}

fn conf_state(voters: &[u64]) -> ConfState {
    ConfState {
        voters: voters.to_vec(),
        ..Default::default()
    }
}

fn ctx() -> GetEntriesContext {
    GetEntriesContext::empty(false)
}

fn all_entries<S: Storage>(s: &S) -> Vec<Entry> {
    let first = s.first_index().expect("first");
    let last = s.last_index().expect("last");
    if last < first {
        return Vec::new();
    }
    s.entries(first, last + 1, None, ctx()).expect("entries")
}

fn is_store(e: raft::Error, want: raft::StorageError) -> bool {
    matches!(e, raft::Error::Store(got) if got == want)
}

/// Small segments so a few hundred entries cross several of them (a generation switch then
/// frees whole segments).
fn small_config(dir: &Path) -> LogConfig {
    let mut c = raft_log_config(dir);
    c.segment_bytes = 32 << 10;
    c.max_round_bytes = 8 << 10;
    c.max_pending_bytes = 4 << 20;
    c.index_interval_bytes = 4096;
    c
}

fn open_small(dir: &Path) -> RaftLog {
    let backend = SystemBackend::open(BackendChoice::IoUring).expect("backend");
    RaftLog::open_with(small_config(dir), backend).expect("open")
}

fn open_fault(dir: &Path) -> (RaftLog<FaultBackend>, FaultHandle) {
    let (backend, handle) = FaultBackend::new(true).expect("fault backend");
    let log = RaftLog::open_with(small_config(dir), backend).expect("open");
    (log, handle)
}

/// A periodic log whose interval never passes by itself within a test (an hour): only
/// [`RaftLog::tick`] with a later clock value, or a write that must sync, fdatasyncs.
fn open_fault_periodic(dir: &Path) -> (RaftLog<FaultBackend>, FaultHandle) {
    let (backend, handle) = FaultBackend::new(true).expect("fault backend");
    let mut config = small_config(dir);
    config.fsync = FsyncMode::Periodic {
        interval: Duration::from_secs(3600),
    };
    let log = RaftLog::open_with(config, backend).expect("open");
    (log, handle)
}

/// A periodic log holding voters 1-3 and entries 1..=5 of term 1 fdatasynced with a vote for
/// 2 (a conf state, a new term and vote: synced), then entries 6..=8 with commit 5 written
/// but not synced.
fn periodic_log_with_an_unsynced_tail(dir: &Path) -> (RaftLog<FaultBackend>, FaultHandle) {
    let (mut log, handle) = open_fault_periodic(dir);
    log.set_conf_state(conf_state(&[1, 2, 3]))
        .expect("conf state");
    log.persist(&entries(1..=5, 1), Some(&hard_state(1, 2, 0)))
        .expect("persist");
    assert!(!log.has_unsynced(), "a new term and vote are fdatasynced");
    log.persist(&entries(6..=8, 1), Some(&hard_state(1, 2, 5)))
        .expect("persist");
    assert!(log.has_unsynced(), "entries and a commit are only written");
    (log, handle)
}

/// Cuts the power (what no fdatasync covered is lost) and reopens the log.
fn power_cut_and_reopen(
    log: RaftLog<FaultBackend>,
    handle: &FaultHandle,
    dir: &Path,
) -> RaftLog<FaultBackend> {
    handle.power_cut(PowerCut::DropUnsynced).expect("power cut");
    drop(log);
    open_fault_periodic(dir).0
}

#[test]
fn periodic_entries_are_stored_once_written_and_a_vote_once_synced() {
    for power_cut in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, handle) = periodic_log_with_an_unsynced_tail(dir.path());
        assert!(log.is_periodic());
        assert_eq!(log.last_index().expect("last"), 8);
        let log = if power_cut {
            power_cut_and_reopen(log, &handle, dir.path())
        } else {
            drop(log);
            open_fault_periodic(dir.path()).0
        };
        let state = log.initial_state().expect("state");
        assert_eq!(state.conf_state, conf_state(&[1, 2, 3]));
        if power_cut {
            // A power cut loses what no fdatasync covered, never the vote.
            assert_eq!(state.hard_state, hard_state(1, 2, 0));
            assert_eq!(all_entries(&log), entries(1..=5, 1));
        } else {
            // A process crash keeps everything written.
            assert_eq!(state.hard_state, hard_state(1, 2, 5));
            assert_eq!(all_entries(&log), entries(1..=8, 1));
        }
    }
}

#[test]
fn a_periodic_log_fdatasyncs_once_its_interval_passed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, handle) = periodic_log_with_an_unsynced_tail(dir.path());
    log.tick(Instant::now()).expect("tick");
    assert!(log.has_unsynced(), "the interval has not passed");
    let later = Instant::now() + Duration::from_secs(2 * 3600);
    // Bounded: a tick starts the fdatasync, the next reaps it.
    for _ in 0..4 {
        log.tick(later).expect("tick");
    }
    assert!(!log.has_unsynced(), "a tick past the interval fdatasyncs");
    let log = power_cut_and_reopen(log, &handle, dir.path());
    assert_eq!(all_entries(&log), entries(1..=8, 1));
    assert_eq!(
        log.initial_state().expect("state").hard_state,
        hard_state(1, 2, 5)
    );
}

#[test]
fn a_new_term_in_periodic_mode_fdatasyncs_everything_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, handle) = periodic_log_with_an_unsynced_tail(dir.path());
    log.persist(&[], Some(&hard_state(2, 3, 5)))
        .expect("a vote in a new term");
    assert!(!log.has_unsynced());
    let log = power_cut_and_reopen(log, &handle, dir.path());
    assert_eq!(all_entries(&log), entries(1..=8, 1));
    assert_eq!(
        log.initial_state().expect("state").hard_state,
        hard_state(2, 3, 5)
    );
}

#[test]
fn the_commit_index_is_written_in_the_background() {
    use felix_cluster::node::LogStore as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _handle) = open_fault(dir.path());
    log.persist(&entries(1..=5, 1), Some(&hard_state(1, 2, 0)))
        .expect("persist");
    log.persist_commit(4).expect("commit");
    // The view moves at once; an older index changes nothing.
    assert_eq!(log.hard_state().commit, 4);
    log.persist_commit(2).expect("an older commit");
    assert_eq!(log.hard_state().commit, 4);
    // Its write started without waiting; a crash after it finished keeps it.
    log.drive(Instant::now()).expect("drive");
    drop(log);
    let (log, _) = open_fault(dir.path());
    assert_eq!(
        log.initial_state().expect("state").hard_state,
        hard_state(1, 2, 4)
    );
    assert_eq!(all_entries(&log), entries(1..=5, 1));
}

#[test]
fn a_begun_write_is_readable_at_once_and_waited_for_by_persist_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, handle) = open_fault(dir.path());
    log.persist(&entries(1..=5, 1), Some(&hard_state(1, 2, 5)))
        .expect("persist");
    let syncs = handle.syncs_completed();
    let first = log
        .persist_begin(&entries(6..=8, 1), Some(&hard_state(1, 2, 5)))
        .expect("begin");
    // In the view at once (raft-rs reads it before it is stored); a second write may begin.
    assert_eq!(log.last_index().expect("last"), 8);
    let second = log
        .persist_begin(&entries(9..=9, 1), None)
        .expect("a second begin");
    assert!(second > first, "writes are numbered in order");
    // Another group's log writes at the same time.
    let other_dir = tempfile::tempdir().expect("tempdir");
    let (mut other, _) = open_fault(other_dir.path());
    other
        .persist_begin(&entries(1..=2, 1), None)
        .expect("another log's begin");
    log.persist_end().expect("end");
    assert_eq!(log.persisted().expect("persisted"), second);
    other.persist_end().expect("end");
    assert_eq!(all_entries(&other), entries(1..=2, 1));
    assert_eq!(all_entries(&log), entries(1..=9, 1));
    assert!(
        handle.syncs_completed() > syncs,
        "on_commit: fdatasynced before it returned"
    );
}

/// A shared log's writes go on without waiting: each is readable at once, a round starts for
/// what the groups began, and `persisted` names the newest write stored only once its round
/// completed, in order, whatever writes began since. A commit index noted alone counts as
/// stored with the write before it.
#[test]
fn writes_in_flight_are_persisted_in_order_once_their_rounds_complete() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (shared, handle) = open_shared_fault(dir.path());
    // Opening a group writes its seal and waits for it; from then on, rounds are held.
    let mut log = RaftLog::open_shared(&shared, 1).expect("group 1");
    handle.set_auto_complete(false);
    assert_eq!(log.persisted().expect("persisted"), 0);
    let now = Instant::now();
    let first = log
        .persist_begin(&entries(1..=3, 1), Some(&hard_state(1, 1, 0)))
        .expect("begin");
    shared.poll(now).expect("poll starts a round");
    let second = log
        .persist_begin(&entries(4..=5, 1), None)
        .expect("a second write while the first is in flight");
    shared.poll(now).expect("poll");
    assert_eq!(log.last_index().expect("last"), 5, "readable at once");
    assert_eq!(
        log.persisted().expect("persisted"),
        first - 1,
        "nothing stored yet"
    );
    assert!(handle.complete_next(), "the first round was submitted");
    shared
        .poll(now)
        .expect("poll reaps the first round, starts the second");
    assert_eq!(log.persisted().expect("persisted"), first);
    let noted = log
        .persist_begin(&[], Some(&hard_state(1, 1, 3)))
        .expect("a commit index alone");
    assert_eq!(
        noted, second,
        "a commit alone waits for no write of its own"
    );
    assert!(handle.complete_next(), "the second round was submitted");
    shared.poll(now).expect("poll");
    assert_eq!(log.persisted().expect("persisted"), second);
    assert_eq!(
        handle.held_rounds(),
        0,
        "no round for the commit index alone"
    );
    drop(log);
    drop(shared);
    let (shared, _handle) = open_shared_fault(dir.path());
    let log = RaftLog::open_shared(&shared, 1).expect("reopen");
    assert_eq!(all_entries(&log), entries(1..=5, 1));
}

#[test]
fn live_bytes_count_the_entries_held_in_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = open_small(dir.path());
    // `entry(i, term, data)` holds `data`: the live bytes are the data lengths.
    let a: Vec<Entry> = (1..=4).map(|i| entry(i, 1, &[7; 100])).collect();
    log.persist(&a, Some(&hard_state(1, 1, 0)))
        .expect("persist");
    assert_eq!(log.live_bytes(), 400);
    // A conflicting suffix replaces entries 3 and 4 with one of 10 bytes.
    log.persist(&[entry(3, 2, &[1; 10])], Some(&hard_state(2, 1, 2)))
        .expect("overwrite");
    assert_eq!(log.live_bytes(), 210);
    log.compact(2, b"snap".to_vec()).expect("compact");
    assert_eq!(log.live_bytes(), 10);
    drop(log);
    assert_eq!(open_small(dir.path()).live_bytes(), 10);
}

#[test]
fn a_group_compacts_once_its_entries_hold_too_many_bytes() {
    use felix_cluster::node::{Node, NodeConfig};
    use felix_cluster::shard::{Batch, ShardRecord, ShardState};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = NodeConfig::new(1, vec![1]);
    config.compact_after_bytes = 64 << 10;
    let mut node =
        Node::with_machine(&config, open_small(dir.path()), ShardState::default()).expect("node");
    // Bounded: a lone voter elects itself within two election timeouts.
    for _ in 0..100 {
        if node.is_leader() {
            break;
        }
        node.tick();
        node.advance().expect("advance");
    }
    assert!(node.is_leader());
    // 100 batches of 4 KiB: far under the entry count bound, 6x the byte bound.
    for sequence in 1..=100u64 {
        let batch = Batch {
            producer: 9,
            sequence,
            client: None,
            records: vec![ShardRecord {
                timestamp_us: sequence,
                key: bytes::Bytes::new(),
                payload: bytes::Bytes::from(vec![sequence as u8; 4096]),
            }],
        };
        node.propose_data(batch.encode()).expect("propose");
        node.advance().expect("advance");
        assert!(
            node.store().live_bytes() <= (64 << 10) + 4200,
            "live bytes {} past the bound",
            node.store().live_bytes()
        );
    }
    assert!(node.store().first_index().expect("first") > 1, "compacted");
    assert_eq!(node.state().next_offset(), 100);
}

/// A commit index noted alone (a hard state that moves only the commit) costs no write of its
/// own: the next write carries it (here the tick's); a crash before that loses only it.
#[test]
fn a_commit_noted_alone_goes_with_the_next_write() {
    for tick in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = RaftLog::open(dir.path()).expect("open");
        log.set_conf_state(conf_state(&[1, 2, 3]))
            .expect("conf state");
        log.persist(&entries(1..=8, 1), Some(&hard_state(1, 2, 5)))
            .expect("persist");
        log.persist(&[], Some(&hard_state(1, 2, 8)))
            .expect("hard state only");
        assert_eq!(log.initial_state().expect("state").hard_state.commit, 8);
        if tick {
            log.tick(Instant::now()).expect("tick");
            log.flush().expect("wait for the tick's write");
        }
        drop(log); // a crash when `tick` is false: the noted commit was never written
        let log = RaftLog::open(dir.path()).expect("reopen");
        let state = log.initial_state().expect("state");
        assert_eq!(state.hard_state.commit, if tick { 8 } else { 5 });
        assert_eq!(all_entries(&log), entries(1..=8, 1));
    }
}

#[test]
fn round_trip_survives_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = RaftLog::open(dir.path()).expect("open");
    assert!(log.initial_state_is_new());
    assert_eq!(log.first_index().expect("first"), 1);
    assert_eq!(log.last_index().expect("last"), 0);
    log.set_conf_state(conf_state(&[1, 2, 3]))
        .expect("conf state");
    log.persist(&entries(1..=5, 1), Some(&hard_state(1, 2, 0)))
        .expect("persist");
    log.persist(&entries(6..=8, 2), Some(&hard_state(2, 3, 5)))
        .expect("persist");
    log.persist(&[], Some(&hard_state(2, 3, 7)))
        .expect("hard state only");
    assert!(!log.initial_state_is_new());
    let want_entries = all_entries(&log);
    assert_eq!(want_entries.len(), 8);
    // A clean close writes the commit index the hard-state-only persist noted.
    log.flush().expect("clean close");
    drop(log);

    let log = RaftLog::open(dir.path()).expect("reopen");
    assert!(!log.initial_state_is_new());
    let state = log.initial_state().expect("state");
    assert_eq!(state.hard_state, hard_state(2, 3, 7));
    assert_eq!(state.conf_state, conf_state(&[1, 2, 3]));
    assert_eq!(all_entries(&log), want_entries);
    assert_eq!(log.term(5).expect("term"), 1);
    assert_eq!(log.term(8).expect("term"), 2);
    assert_eq!(log.term(0).expect("term of the empty snapshot"), 0);
    assert!(is_store(
        log.term(9).expect_err("past the last"),
        raft::StorageError::Unavailable
    ));
    assert!(is_store(
        log.snapshot(0, 2).expect_err("no snapshot yet"),
        raft::StorageError::SnapshotTemporarilyUnavailable
    ));
    log.close().expect("close");
    let log = RaftLog::open(dir.path()).expect("reopen after a clean close");
    assert_eq!(all_entries(&log), want_entries);
}

#[test]
fn conflicting_suffix_is_overwritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = RaftLog::open(dir.path()).expect("open");
    log.persist(&entries(1..=10, 1), Some(&hard_state(1, 1, 3)))
        .expect("persist");
    log.persist(&entries(6..=7, 2), Some(&hard_state(2, 2, 3)))
        .expect("overwrite");
    let check = |log: &RaftLog| {
        assert_eq!(log.first_index().expect("first"), 1);
        assert_eq!(log.last_index().expect("last"), 7);
        let got = all_entries(log);
        let mut want = entries(1..=5, 1);
        want.extend(entries(6..=7, 2));
        assert_eq!(got, want);
        assert!(is_store(
            log.term(8).expect_err("dropped"),
            raft::StorageError::Unavailable
        ));
        assert_eq!(
            log.initial_state().expect("state").hard_state,
            hard_state(2, 2, 3)
        );
    };
    check(&log);
    // A gap, a compacted index and non-consecutive entries are refused without writing.
    assert!(matches!(
        log.persist(&entries(9..=9, 2), None),
        Err(RaftLogError::AppendGap { .. })
    ));
    assert!(matches!(
        log.persist(&[entry(8, 2, b"a"), entry(10, 2, b"b")], None),
        Err(RaftLogError::NotConsecutive { .. })
    ));
    assert!(log.failure().is_none(), "a refused call fails nothing");
    check(&log);
    drop(log);
    let log = RaftLog::open(dir.path()).expect("reopen");
    check(&log);
}

#[test]
fn compaction_keeps_a_snapshot_and_frees_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = open_small(dir.path());
    log.set_conf_state(conf_state(&[1, 2, 3]))
        .expect("conf state");
    let payload = vec![7u8; 1000];
    let mut all = Vec::new();
    for i in 1..=100u64 {
        all.push(entry(i, 1 + i / 40, &payload));
    }
    for chunk in all.chunks(10) {
        let last = chunk[chunk.len() - 1].index;
        log.persist(chunk, Some(&hard_state(3, 1, last)))
            .expect("persist");
    }
    let term_50 = log.term(50).expect("term 50");
    let before = log.disk_bytes();
    let generation = log.generation();
    assert!(matches!(
        log.compact(101, Vec::new()),
        Err(RaftLogError::CompactBeyondLast { .. })
    ));
    log.compact(50, b"state machine at 50".to_vec())
        .expect("compact");
    assert!(log.generation() > generation);
    assert!(
        log.disk_bytes() < before,
        "the old generation's segments were given back: {} -> {}",
        before,
        log.disk_bytes()
    );
    // Compacting below the snapshot does nothing.
    log.compact(30, Vec::new()).expect("no-op");
    drop(log);

    let mut log = open_small(dir.path());
    let check = |log: &RaftLog| {
        assert_eq!(log.first_index().expect("first"), 51);
        assert_eq!(log.last_index().expect("last"), 100);
        assert_eq!(log.term(50).expect("term from the snapshot"), term_50);
        assert!(is_store(
            log.term(49).expect_err("compacted"),
            raft::StorageError::Compacted
        ));
        assert_eq!(all_entries(log), all[50..].to_vec());
        assert!(is_store(
            log.entries(10, 20, None, ctx()).expect_err("compacted"),
            raft::StorageError::Compacted
        ));
        let snap = log.snapshot(0, 2).expect("snapshot");
        assert_eq!(snap.get_metadata().index, 50);
        assert_eq!(snap.get_metadata().term, term_50);
        assert_eq!(
            snap.get_metadata().get_conf_state(),
            &conf_state(&[1, 2, 3])
        );
        assert_eq!(snap.get_data(), b"state machine at 50");
        assert!(is_store(
            log.snapshot(60, 2).expect_err("older than asked"),
            raft::StorageError::SnapshotTemporarilyUnavailable
        ));
        assert_eq!(
            log.initial_state().expect("state").conf_state,
            conf_state(&[1, 2, 3])
        );
    };
    check(&log);
    // max_size as MemStorage: at least one entry, then whole entries within the limit.
    assert_eq!(log.entries(51, 101, 0, ctx()).expect("one").len(), 1);
    let two = u64::from(protobuf::Message::compute_size(&all[50])) * 2;
    assert_eq!(log.entries(51, 101, two, ctx()).expect("two").len(), 2);

    // Appends go on in the new generation; compacting everything leaves an empty log whose
    // term at the snapshot is still known.
    log.persist(&[entry(101, 3, b"after")], Some(&hard_state(3, 1, 101)))
        .expect("persist after compaction");
    let before = log.disk_bytes();
    log.compact(101, b"all".to_vec()).expect("compact all");
    assert!(log.disk_bytes() < before);
    drop(log);
    let log = open_small(dir.path());
    assert_eq!(log.first_index().expect("first"), 102);
    assert_eq!(log.last_index().expect("last"), 101);
    assert_eq!(log.term(101).expect("term"), 3);
    assert!(all_entries(&log).is_empty());
}

#[test]
fn apply_snapshot_replaces_the_log_like_mem_storage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = RaftLog::open(dir.path()).expect("open");
    let mem = MemStorage::new();
    let hs = hard_state(2, 1, 4);
    log.persist(&entries(1..=10, 2), Some(&hs))
        .expect("persist");
    mem.wl().append(&entries(1..=10, 2)).expect("mem append");
    mem.wl().set_hardstate(hs);

    let snapshot = |index: u64, term: u64, voters: &[u64]| {
        let mut s = Snapshot::default();
        s.mut_metadata().index = index;
        s.mut_metadata().term = term;
        s.mut_metadata().set_conf_state(conf_state(voters));
        s.set_data(format!("data at {index}").into_bytes().into());
        s
    };
    let same = |log: &RaftLog, mem: &MemStorage| {
        assert_eq!(log.first_index().ok(), mem.first_index().ok());
        assert_eq!(log.last_index().ok(), mem.last_index().ok());
        let (a, b) = (
            log.initial_state().expect("state"),
            mem.initial_state().expect("state"),
        );
        assert_eq!(a.hard_state, b.hard_state);
        assert_eq!(a.conf_state, b.conf_state);
        let last = log.last_index().expect("last");
        assert_eq!(log.term(last).ok(), mem.term(last).ok());
    };

    // Inside the log: everything is dropped, before and after the snapshot's index.
    log.apply_snapshot(snapshot(5, 2, &[1, 2])).expect("apply");
    mem.wl()
        .apply_snapshot(snapshot(5, 2, &[1, 2]))
        .expect("mem apply");
    same(&log, &mem);
    assert_eq!(log.first_index().expect("first"), 6);
    assert_eq!(log.last_index().expect("last"), 5);

    // Newer than the log, with a newer term.
    log.persist(&entries(6..=8, 2), None).expect("persist");
    mem.wl().append(&entries(6..=8, 2)).expect("mem append");
    log.apply_snapshot(snapshot(20, 4, &[1, 2, 3]))
        .expect("apply newer");
    mem.wl()
        .apply_snapshot(snapshot(20, 4, &[1, 2, 3]))
        .expect("mem apply newer");
    same(&log, &mem);
    assert_eq!(log.term(20).expect("term"), 4);
    assert_eq!(log.initial_state().expect("state").hard_state.commit, 20);

    // Out of date, as MemStorage.
    assert!(matches!(
        log.apply_snapshot(snapshot(3, 1, &[1])),
        Err(RaftLogError::SnapshotOutOfDate { .. })
    ));
    assert!(mem.wl().apply_snapshot(snapshot(3, 1, &[1])).is_err());

    log.persist(&entries(21..=22, 4), None).expect("persist");
    mem.wl().append(&entries(21..=22, 4)).expect("mem append");
    drop(log);
    let log = RaftLog::open(dir.path()).expect("reopen");
    same(&log, &mem);
    assert_eq!(all_entries(&log), all_entries(&mem));
    let snap = log.snapshot(0, 1).expect("snapshot");
    assert_eq!(snap, snapshot(20, 4, &[1, 2, 3]));
}

/// Segment files of `dir` (seq, path), oldest first.
fn segments(dir: &Path) -> Vec<(u64, std::path::PathBuf)> {
    let mut segs: Vec<(u64, std::path::PathBuf)> = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| {
            let e = e.ok()?;
            let seq = segment::parse_file_name(e.file_name().to_str()?)?;
            Some((seq, e.path()))
        })
        .collect();
    segs.sort_unstable();
    segs
}

/// Where the data of a segment file starts (after its header) and where its frames end (the
/// first byte no frame covers).
fn data_range(path: &Path) -> (u64, u64) {
    let bytes = std::fs::read(path).expect("read segment");
    let file = std::fs::File::open(path).expect("open segment");
    let header = segment::read_header(&file, bytes.len() as u64).expect("header");
    let mut at = header.header_bytes as usize;
    loop {
        match frame::decode(&bytes[at..]) {
            frame::Decoded::Record { frame_bytes, .. } => at += frame_bytes,
            frame::Decoded::Mark { .. } => at += frame::MARK_BYTES,
            _ => return (header.header_bytes, at as u64),
        }
    }
}

#[test]
fn torn_tail_keeps_every_persisted_entry() {
    // Two shapes of a write a crash interrupted before `persist` returned: half a frame in
    // the zeroed tail of the segment, and a segment file cut in the middle of a frame.
    for cut_file in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = open_small(dir.path());
        log.persist(&entries(1..=10, 1), Some(&hard_state(1, 1, 10)))
            .expect("persist");
        drop(log); // a crash: no clean close

        // The newest segment holding data (a segment made ahead holds none yet).
        let (path, end) = segments(dir.path())
            .into_iter()
            .rev()
            .find_map(|(_, path)| {
                let (start, end) = data_range(&path);
                (end > start).then_some((path, end))
            })
            .expect("a segment with data");
        let mut torn = Vec::new();
        let next = protobuf::Message::write_to_bytes(&entry(11, 1, &[9u8; 300])).expect("encode");
        frame::encode(&mut torn, 0, 10, 1, b"", &next);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open segment");
        if cut_file {
            std::os::unix::fs::FileExt::write_all_at(&f, &torn, end).expect("write");
            f.set_len(end + torn.len() as u64 / 2).expect("cut");
        } else {
            std::os::unix::fs::FileExt::write_all_at(&f, &torn[..torn.len() / 2], end)
                .expect("write");
        }
        f.sync_all().expect("fsync");
        drop(f);

        let mut log = open_small(dir.path());
        assert_eq!(
            log.recovery_report().truncations.len(),
            1,
            "the torn frame was cut: {:?}",
            log.recovery_report()
        );
        assert_eq!(all_entries(&log), entries(1..=10, 1), "cut_file {cut_file}");
        assert_eq!(
            log.initial_state().expect("state").hard_state,
            hard_state(1, 1, 10)
        );
        log.persist(&[entry(11, 1, b"after the cut")], None)
            .expect("persist after recovery");
        drop(log);
        let log = open_small(dir.path());
        assert_eq!(log.last_index().expect("last"), 11);
        assert_eq!(log.term(11).expect("term"), 1);
    }
}

#[test]
fn failed_fsync_refuses_further_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, handle) = open_fault(dir.path());
    log.persist(&entries(1..=5, 1), Some(&hard_state(1, 1, 5)))
        .expect("persist");
    handle.fail_next_sync(5); // EIO
    assert!(
        log.persist(&entries(6..=8, 1), Some(&hard_state(1, 1, 8)))
            .is_err()
    );
    // The view holds the write's entries (readable from its start, as raft-rs asks), but
    // nothing counts them stored, and every later write is refused.
    assert_eq!(log.last_index().expect("last"), 8);
    assert!(log.failure().is_some());
    assert!(matches!(log.persisted(), Err(RaftLogError::Failed(_))));
    assert!(matches!(
        log.persist(&entries(6..=6, 1), None),
        Err(RaftLogError::Failed(_))
    ));
    assert!(matches!(
        log.set_conf_state(conf_state(&[1])),
        Err(RaftLogError::Failed(_))
    ));
    assert!(matches!(
        log.compact(3, Vec::new()),
        Err(RaftLogError::Failed(_))
    ));
    // The power goes: what no fdatasync covered is lost; what persist returned for is not.
    handle.power_cut(PowerCut::DropUnsynced).expect("power cut");
    drop(log);
    let (log, _) = open_fault(dir.path());
    assert_eq!(all_entries(&log), entries(1..=5, 1));
    assert_eq!(
        log.initial_state().expect("state").hard_state,
        hard_state(1, 1, 5)
    );
}

#[test]
fn torn_power_cut_after_persist_loses_nothing() {
    for seed in 0..4u64 {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut log, handle) = open_fault(dir.path());
        for i in 0..20u64 {
            let from = i * 5 + 1;
            log.persist(
                &entries(from..=from + 4, 1),
                Some(&hard_state(1, 1, from + 4)),
            )
            .expect("persist");
            if i == 10 {
                log.compact(30, b"snap".to_vec()).expect("compact");
            }
        }
        handle
            .power_cut(PowerCut::TearUnsynced { seed })
            .expect("power cut");
        drop(log);
        let (log, _) = open_fault(dir.path());
        assert_eq!(log.first_index().expect("first"), 31);
        assert_eq!(all_entries(&log), entries(31..=100, 1));
        assert_eq!(log.initial_state().expect("state").hard_state.commit, 100);
    }
}

/// raft-rs `MemStorage` plus what it does not keep: the term at the last compaction (its
/// `compact` forgets it; `RaftLog` answers `term(first_index - 1)` from the snapshot).
struct Model {
    mem: MemStorage,
    snapshot_index: u64,
    snapshot_term: u64,
    snapshot_data: Vec<u8>,
}

fn compare(log: &RaftLog, model: &Model, rng: &mut StdRng, step: usize) {
    let mem = &model.mem;
    let first = mem.first_index().expect("first");
    let last = mem.last_index().expect("last");
    assert_eq!(log.first_index().expect("first"), first, "step {step}");
    assert_eq!(log.last_index().expect("last"), last, "step {step}");
    let (a, b) = (
        log.initial_state().expect("state"),
        mem.initial_state().expect("state"),
    );
    assert_eq!(a.hard_state, b.hard_state, "step {step}");
    assert_eq!(a.conf_state, b.conf_state, "step {step}");
    if last >= first {
        assert_eq!(
            log.entries(first, last + 1, None, ctx()).expect("entries"),
            mem.entries(first, last + 1, None, ctx()).expect("entries"),
            "step {step}"
        );
        let low = rng.random_range(first..=last);
        let high = rng.random_range(low + 1..=last + 1);
        let max = rng.random_range(0..400u64);
        assert_eq!(
            log.entries(low, high, max, ctx()).expect("entries"),
            mem.entries(low, high, max, ctx()).expect("entries"),
            "step {step}"
        );
    }
    for i in first..=last + 1 {
        assert_eq!(log.term(i).ok(), mem.term(i).ok(), "step {step} term {i}");
    }
    assert_eq!(first - 1, model.snapshot_index, "step {step}");
    assert_eq!(
        log.term(first - 1).expect("term at the snapshot"),
        model.snapshot_term,
        "step {step}"
    );
    if first >= 2 {
        assert!(is_store(
            log.term(first - 2).expect_err("compacted"),
            raft::StorageError::Compacted
        ));
        assert!(is_store(
            log.entries(first - 1, first, None, ctx())
                .expect_err("compacted"),
            raft::StorageError::Compacted
        ));
    }
    match log.snapshot(0, 1) {
        Ok(snap) => {
            assert_eq!(snap.get_metadata().index, model.snapshot_index);
            assert_eq!(snap.get_metadata().term, model.snapshot_term);
            assert_eq!(snap.get_data(), &model.snapshot_data[..]);
        }
        Err(e) => {
            assert_eq!(model.snapshot_index, 0, "step {step}");
            assert!(is_store(
                e,
                raft::StorageError::SnapshotTemporarilyUnavailable
            ));
        }
    }
}

#[test]
fn matches_mem_storage_under_random_operations() {
    const STEPS: usize = 300;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rng = StdRng::seed_from_u64(0x5EED_F311C5);
    let mut log = open_small(dir.path());
    let mut model = Model {
        mem: MemStorage::new(),
        snapshot_index: 0,
        snapshot_term: 0,
        snapshot_data: Vec::new(),
    };
    let mut term = 1u64;
    let mut reopens = 0;
    let mut compactions = 0;
    let mut snapshots = 0;
    for step in 0..STEPS {
        let first = model.mem.first_index().expect("first");
        let last = model.mem.last_index().expect("last");
        let commit = model.mem.initial_state().expect("state").hard_state.commit;
        match rng.random_range(0..100u32) {
            // Append (possibly overwriting a suffix), with or without a hard state.
            0..=49 => {
                if rng.random_bool(0.2) {
                    term += 1;
                }
                let start = rng.random_range(first..=last + 1);
                let count = rng.random_range(1..=4u64);
                let ents: Vec<Entry> = (start..start + count)
                    .map(|i| {
                        let len = rng.random_range(0..120usize);
                        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                        entry(i, term, &data)
                    })
                    .collect();
                let new_last = start + count - 1;
                let hs = rng.random_bool(0.6).then(|| {
                    let commit = rng.random_range(commit.min(new_last)..=new_last);
                    hard_state(term, rng.random_range(0..4), commit)
                });
                log.persist(&ents, hs.as_ref()).expect("persist");
                model.mem.wl().append(&ents).expect("mem append");
                if let Some(hs) = hs {
                    model.mem.wl().set_hardstate(hs);
                }
            }
            50..=59 => {
                let voters: Vec<u64> = (1..=rng.random_range(1..=5u64)).collect();
                log.set_conf_state(conf_state(&voters)).expect("conf state");
                model.mem.wl().set_conf_state(conf_state(&voters));
            }
            // Compact, keeping at least one entry: MemStorage cannot compact them all (its
            // first and last index would fall back to its last applied snapshot).
            60..=74 => {
                let top = commit.min(last.saturating_sub(1));
                if top < first {
                    continue;
                }
                let upto = rng.random_range(first..=top);
                let snap_term = model.mem.term(upto).expect("term");
                let data = format!("state at {upto}").into_bytes();
                log.compact(upto, data.clone()).expect("compact");
                model.mem.wl().compact(upto + 1).expect("mem compact");
                model.snapshot_index = upto;
                model.snapshot_term = snap_term;
                model.snapshot_data = data;
                compactions += 1;
            }
            // A snapshot from the leader, inside or past the log (or out of date).
            75..=79 => {
                term += rng.random_range(0..=1);
                let index = rng.random_range(first.saturating_sub(2)..=last + 3);
                let mut snap = Snapshot::default();
                snap.mut_metadata().index = index;
                snap.mut_metadata().term = term;
                snap.mut_metadata()
                    .set_conf_state(conf_state(&[1, rng.random_range(2..=4)]));
                let data = format!("leader state at {index}").into_bytes();
                snap.set_data(data.clone().into());
                let ours = log.apply_snapshot(snap.clone());
                let theirs = model.mem.wl().apply_snapshot(snap);
                assert_eq!(ours.is_ok(), theirs.is_ok(), "step {step}");
                if ours.is_ok() {
                    model.snapshot_index = index;
                    model.snapshot_term = term;
                    model.snapshot_data = data;
                    snapshots += 1;
                } else {
                    assert!(matches!(ours, Err(RaftLogError::SnapshotOutOfDate { .. })));
                }
            }
            80..=89 => {
                let hs = hard_state(
                    term,
                    rng.random_range(0..4),
                    rng.random_range(commit.min(last)..=last),
                );
                log.persist(&[], Some(&hs)).expect("hard state");
                model.mem.wl().set_hardstate(hs);
            }
            _ => {
                // A clean close (a crash may lose a commit index noted alone: the power-cut
                // tests cover that).
                log.flush().expect("clean close");
                drop(log);
                log = open_small(dir.path());
                reopens += 1;
            }
        }
        compare(&log, &model, &mut rng, step);
    }
    drop(log);
    let log = open_small(dir.path());
    compare(&log, &model, &mut rng, STEPS);
    assert!(
        reopens > 10 && compactions > 10 && snapshots > 3,
        "the seed exercises every operation: {reopens} reopens, {compactions} compactions, {snapshots} snapshots"
    );
}

/// Appends `(shard, key, payload)` records to the Felix log in `dir` directly and syncs them:
/// what a generation switch had written when the process stopped.
fn append_raw(dir: &Path, records: &[(u32, &[u8], Vec<u8>)]) {
    let backend = SystemBackend::open(BackendChoice::IoUring).expect("backend");
    let (mut log, _) = felix_storage::Log::open(small_config(dir), backend).expect("open");
    for (shard, key, payload) in records {
        let next = log.shard_offsets(*shard).map_or(0, |o| o.next);
        log.append(*shard, next, 1, key, payload).expect("append");
    }
    log.flush(std::time::Duration::from_secs(60))
        .expect("flush");
}

fn encode(m: &impl protobuf::Message) -> Vec<u8> {
    m.write_to_bytes().expect("encode")
}

#[test]
fn interrupted_generation_switch_recovers() {
    let mut snap = Snapshot::default();
    snap.mut_metadata().index = 5;
    snap.mut_metadata().term = 1;
    snap.mut_metadata().set_conf_state(conf_state(&[1, 2]));
    snap.set_data(b"at 5".to_vec().into());
    // Generation 1 (shards 3, 4, 5) as a switch writes it; `sealed` adds its last record.
    let generation_1 = |sealed: bool| {
        let mut records: Vec<(u32, &[u8], Vec<u8>)> = vec![
            (5, b"", encode(&snap)),
            (4, b"c", encode(&conf_state(&[1, 2]))),
            (4, b"h", encode(&hard_state(1, 1, 10))),
        ];
        for e in entries(6..=10, 1) {
            records.push((3, b"", encode(&e)));
        }
        if sealed {
            records.push((4, b"g", 1u32.to_le_bytes().to_vec()));
        }
        records
    };

    // Unsealed: the old generation is still the log; the partial one is released and never
    // reused.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = open_small(dir.path());
    log.persist(&entries(1..=10, 1), Some(&hard_state(1, 1, 10)))
        .expect("persist");
    drop(log);
    append_raw(dir.path(), &generation_1(false));
    let mut log = open_small(dir.path());
    assert_eq!(log.generation(), 0);
    assert_eq!(log.first_index().expect("first"), 1);
    assert_eq!(all_entries(&log), entries(1..=10, 1));
    assert!(is_store(
        log.snapshot(0, 1).expect_err("no snapshot"),
        raft::StorageError::SnapshotTemporarilyUnavailable
    ));
    let released = Released::load(dir.path()).expect("released");
    assert!((3..=5).all(|s| released.contains(s)) && !released.contains(0));
    log.compact(5, b"mine".to_vec()).expect("compact");
    assert_eq!(log.generation(), 2);
    drop(log);
    let log = open_small(dir.path());
    assert_eq!(log.generation(), 2);
    assert_eq!(log.first_index().expect("first"), 6);
    assert_eq!(log.snapshot(0, 1).expect("snapshot").get_data(), b"mine");

    // Sealed: the new generation is the log; the old one is released at open.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = open_small(dir.path());
    log.persist(&entries(1..=10, 1), Some(&hard_state(1, 1, 10)))
        .expect("persist");
    drop(log);
    append_raw(dir.path(), &generation_1(true));
    let log = open_small(dir.path());
    assert_eq!(log.generation(), 1);
    assert_eq!(log.first_index().expect("first"), 6);
    assert_eq!(all_entries(&log), entries(6..=10, 1));
    assert_eq!(log.snapshot(0, 1).expect("snapshot"), snap);
    let released = Released::load(dir.path()).expect("released");
    // Generation 0 had no snapshot record (shard 2): only its shards with records go.
    assert!((0..=1).all(|s| released.contains(s)) && !released.contains(3));
}

// The shard groups' shared Raft log (`SharedLog`): many groups in one Felix log, one write and
// one fdatasync for all of them per pass, each group recovered and released on its own, and a
// group's log of its own (an earlier release's layout) moved into it.

/// Entries whose data names `tag` (tells groups apart).
fn tagged(range: std::ops::RangeInclusive<u64>, term: u64, tag: &str) -> Vec<Entry> {
    range
        .map(|index| {
            entry(
                index,
                term,
                format!("{tag} entry {index} term {term}").as_bytes(),
            )
        })
        .collect()
}

fn open_shared(dir: &Path) -> SharedLog {
    let backend = SystemBackend::open(BackendChoice::IoUring).expect("backend");
    SharedLog::open(small_config(dir), backend).expect("open")
}

fn open_shared_fault(dir: &Path) -> (SharedLog<FaultBackend>, FaultHandle) {
    let (backend, handle) = FaultBackend::new(true).expect("fault backend");
    (
        SharedLog::open(small_config(dir), backend).expect("open"),
        handle,
    )
}

#[test]
fn a_pass_over_many_groups_writes_and_fdatasyncs_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (shared, handle) = open_shared_fault(dir.path());
    let mut logs: Vec<RaftLog<FaultBackend>> = (1..=3)
        .map(|group| RaftLog::open_shared(&shared, group).expect("open group"))
        .collect();
    for log in &mut logs {
        assert!(log.initial_state_is_new());
        log.set_conf_state(conf_state(&[1, 2, 3]))
            .expect("conf state");
    }
    for round in 0..5u64 {
        let before = handle.syncs_completed();
        for (at, log) in logs.iter_mut().enumerate() {
            let first = round * 10 + 1;
            log.persist_begin(
                &tagged(first..=first + 9, 1, &format!("group {at}")),
                Some(&hard_state(1, 1, first.saturating_sub(1))),
            )
            .expect("begin");
        }
        shared.poll(std::time::Instant::now()).expect("poll");
        for log in &mut logs {
            log.persist_end().expect("end");
        }
        assert_eq!(
            handle.syncs_completed() - before,
            1,
            "round {round}: three groups' entries and hard states in one fdatasync"
        );
    }
    for (at, log) in logs.iter().enumerate() {
        assert_eq!(all_entries(log), tagged(1..=50, 1, &format!("group {at}")));
    }
    // A commit index noted alone is not a round of its own: it waits for the next write.
    let before = handle.syncs_completed();
    logs[0].note_commit(50).expect("noted");
    shared.poll(std::time::Instant::now()).expect("poll");
    assert_eq!(
        handle.syncs_completed(),
        before,
        "no fdatasync for a commit alone"
    );
    logs[1]
        .persist_begin(&tagged(51..=51, 1, "group 1"), None)
        .expect("begin");
    shared.poll(std::time::Instant::now()).expect("poll");
    logs[1].persist_end().expect("end");
    assert_eq!(
        handle.syncs_completed(),
        before + 1,
        "the next write takes it along"
    );
}

#[test]
fn each_group_recovers_its_own_log_and_compacts_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = open_shared(dir.path());
    let mut a = RaftLog::open_shared(&shared, 7).expect("group 7");
    let mut b = RaftLog::open_shared(&shared, 9).expect("group 9");
    a.set_conf_state(conf_state(&[1, 2, 3])).expect("conf");
    b.set_conf_state(conf_state(&[2, 3, 4])).expect("conf");
    for round in 0..20u64 {
        let first = round * 20 + 1;
        a.persist(
            &tagged(first..=first + 19, 2, "a"),
            Some(&hard_state(2, 1, first + 19)),
        )
        .expect("a");
        let first_b = round * 10 + 1;
        b.persist(&tagged(first_b..=first_b + 9, 3, "b"), None)
            .expect("b");
    }
    // b overwrites a conflicting suffix; a compacts twice (two generation switches).
    b.persist(&tagged(150..=160, 4, "b2"), Some(&hard_state(4, 3, 100)))
        .expect("b suffix");
    let a_first_generation = a.generation();
    a.compact(200, b"a at 200".to_vec()).expect("compact a");
    let a_generation = a.generation();
    a.compact(390, b"a at 390".to_vec())
        .expect("compact a again");
    assert!(a.generation() > a_generation);
    let a_before = (
        all_entries(&a),
        a.hard_state().clone(),
        a.conf_state().clone(),
    );
    let b_before = (
        all_entries(&b),
        b.hard_state().clone(),
        b.conf_state().clone(),
    );
    assert_eq!(a_before.0.first().map(|e| e.index), Some(391));
    assert_eq!(b_before.0.len(), 160);
    // Group a's older generations are released (shard ids 3g, 3g + 1, 3g + 2: the first one
    // never held a snapshot), group b's only one is not.
    let released = Released::load(dir.path()).expect("released");
    let shards = |generation: u32| [generation * 3, generation * 3 + 1, generation * 3 + 2];
    assert!(
        shards(a_first_generation)[..2]
            .iter()
            .all(|s| released.contains(*s))
    );
    assert!(shards(a_generation).iter().all(|s| released.contains(*s)));
    assert!(!shards(b.generation()).iter().any(|s| released.contains(*s)));
    assert!(!shards(a.generation()).iter().any(|s| released.contains(*s)));
    drop((a, b, shared));

    let shared = open_shared(dir.path());
    assert_eq!(shared.groups(), vec![7, 9]);
    let a = RaftLog::open_shared(&shared, 7).expect("group 7");
    let b = RaftLog::open_shared(&shared, 9).expect("group 9");
    assert!(!a.initial_state_is_new() && !b.initial_state_is_new());
    assert_eq!(
        (
            all_entries(&a),
            a.hard_state().clone(),
            a.conf_state().clone()
        ),
        a_before
    );
    assert_eq!(
        (
            all_entries(&b),
            b.hard_state().clone(),
            b.conf_state().clone()
        ),
        b_before
    );
    assert_eq!(a.snapshot(0, 1).expect("snapshot").get_data(), b"a at 390");
}

#[test]
fn a_released_group_leaves_the_others_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = open_shared(dir.path());
    let mut a = RaftLog::open_shared(&shared, 1).expect("group 1");
    let mut b = RaftLog::open_shared(&shared, 2).expect("group 2");
    for round in 0..30u64 {
        let first = round * 10 + 1;
        a.persist(&tagged(first..=first + 9, 1, "a"), None)
            .expect("a");
        b.persist(&tagged(first..=first + 9, 1, "b"), None)
            .expect("b");
    }
    a.note_commit(300).expect("a commit noted, not written");
    let bytes = shared.disk_bytes();
    a.release().expect("release");
    assert!(!shared.holds(1) && shared.holds(2));
    // A new group never reuses a released generation's shards.
    let c = RaftLog::open_shared(&shared, 3).expect("group 3");
    assert!(c.initial_state_is_new());
    drop((b, c, shared));
    let shared = open_shared(dir.path());
    assert_eq!(shared.groups(), vec![2, 3]);
    let b = RaftLog::open_shared(&shared, 2).expect("group 2");
    assert_eq!(all_entries(&b), tagged(1..=300, 1, "b"));
    assert!(shared.disk_bytes() <= bytes);
}

#[test]
fn a_power_cut_keeps_every_groups_fdatasynced_records_and_drops_a_half_made_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (shared, handle) = open_shared_fault(dir.path());
    let mut a = RaftLog::open_shared(&shared, 1).expect("group 1");
    let mut b = RaftLog::open_shared(&shared, 2).expect("group 2");
    a.persist(&tagged(1..=40, 1, "a"), Some(&hard_state(1, 1, 20)))
        .expect("a");
    b.persist(&tagged(1..=30, 1, "b"), Some(&hard_state(1, 2, 10)))
        .expect("b");
    // Begun but never written: lost at the cut, and never acknowledged.
    a.persist_begin(&tagged(41..=50, 1, "a"), None)
        .expect("begin");
    handle.power_cut(PowerCut::DropUnsynced).expect("power cut");
    drop((a, b, shared));

    let (shared, _handle) = open_shared_fault(dir.path());
    let a = RaftLog::open_shared(&shared, 1).expect("group 1");
    let b = RaftLog::open_shared(&shared, 2).expect("group 2");
    assert_eq!(all_entries(&a), tagged(1..=40, 1, "a"));
    assert_eq!(a.hard_state(), &hard_state(1, 1, 20));
    assert_eq!(all_entries(&b), tagged(1..=30, 1, "b"));
    assert_eq!(b.hard_state(), &hard_state(1, 2, 10));
    drop((a, b, shared));

    // An unsealed generation (a crash in a group's start or a switch, written raw here)
    // belongs to no group: it is released at open and its shards are never used again.
    {
        let backend = SystemBackend::open(BackendChoice::IoUring).expect("backend");
        let (mut log, _) =
            felix_storage::Log::open(small_config(dir.path()), backend).expect("open raw");
        let highest = log.shard_ids().into_iter().max().expect("shards");
        let unsealed_state = (highest / 3 + 5) * 3 + 1;
        let hs = protobuf::Message::write_to_bytes(&hard_state(9, 9, 0)).expect("encode");
        log.append(unsealed_state, 0, 1, b"h", &hs).expect("append");
        log.flush(std::time::Duration::from_secs(60))
            .expect("flush");
        drop(log);
        let shared = open_shared(dir.path());
        assert_eq!(shared.groups(), vec![1, 2]);
        let released = Released::load(dir.path()).expect("released");
        assert!(released.contains(unsealed_state));
        let c = RaftLog::open_shared(&shared, 3).expect("group 3");
        assert!(c.generation() * 3 > unsealed_state);
    }
}

#[test]
fn a_group_log_of_its_own_moves_into_the_shared_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let legacy_dir = dir.path().join("legacy");
    let backend = SystemBackend::open(BackendChoice::IoUring).expect("backend");
    let mut legacy = RaftLog::open_with(small_config(&legacy_dir), backend).expect("legacy");
    legacy.set_conf_state(conf_state(&[1, 2, 3])).expect("conf");
    legacy
        .persist(&tagged(1..=100, 2, "old"), Some(&hard_state(2, 3, 90)))
        .expect("persist");
    legacy
        .compact(60, b"state at 60".to_vec())
        .expect("compact");
    let before = (
        all_entries(&legacy),
        legacy.hard_state().clone(),
        legacy.conf_state().clone(),
    );

    let shared = open_shared(&dir.path().join("shared"));
    let moved = RaftLog::import(&shared, 42, legacy).expect("import");
    assert!(RaftLog::import(&shared, 42, moved_again(&legacy_dir)).is_err());
    drop((moved, shared));
    let shared = open_shared(&dir.path().join("shared"));
    let log = RaftLog::open_shared(&shared, 42).expect("group 42");
    assert_eq!(
        (
            all_entries(&log),
            log.hard_state().clone(),
            log.conf_state().clone()
        ),
        before
    );
    assert_eq!(log.first_index().expect("first"), 61);
    assert_eq!(
        log.snapshot(0, 1).expect("snapshot").get_data(),
        b"state at 60"
    );
}

/// The legacy directory opened again (a second move of the same group is refused).
fn moved_again(dir: &Path) -> RaftLog {
    let backend = SystemBackend::open(BackendChoice::IoUring).expect("backend");
    RaftLog::open_with(small_config(dir), backend).expect("legacy again")
}

#[test]
fn a_quiet_group_asks_to_compact_once_the_log_moved_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = open_shared(dir.path());
    shared.set_relocate_after(4 << 10);
    let mut quiet = RaftLog::open_shared(&shared, 1).expect("quiet");
    let mut busy = RaftLog::open_shared(&shared, 2).expect("busy");
    quiet
        .persist(&tagged(1..=3, 1, "quiet"), Some(&hard_state(1, 1, 3)))
        .expect("quiet");
    assert!(!quiet.relocation_due());
    for round in 0..20u64 {
        let first = round * 10 + 1;
        busy.persist(&tagged(first..=first + 9, 1, "busy"), None)
            .expect("busy");
    }
    assert!(quiet.relocation_due(), "the busy group moved the log on");
    quiet.compact(3, b"quiet at 3".to_vec()).expect("compact");
    assert!(!quiet.relocation_due(), "a compaction starts at the head");
}
