//! The shard groups' shared Raft log (`cluster/src/raft_log.rs`, `SharedLog`): many groups in
//! one Felix log, one write and one fdatasync for all of them per pass, each group recovered
//! on its own, released on its own, and a group's log of its own (an earlier release's
//! layout) moved into it.

use std::path::Path;

use felix_cluster::raft_log::{RaftLog, SharedLog, raft_log_config};
use felix_storage::{
    BackendChoice, FaultBackend, FaultHandle, LogConfig, PowerCut, Released, SystemBackend,
};
use raft::prelude::{ConfState, Entry, HardState};
use raft::{GetEntriesContext, Storage};

fn entries(range: std::ops::RangeInclusive<u64>, term: u64, tag: &str) -> Vec<Entry> {
    range
        .map(|index| Entry {
            index,
            term,
            data: format!("{tag} entry {index} term {term}")
                .into_bytes()
                .into(),
            ..Default::default()
        })
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

fn all_entries<S: Storage>(s: &S) -> Vec<Entry> {
    let first = s.first_index().expect("first");
    let last = s.last_index().expect("last");
    if last < first {
        return Vec::new();
    }
    s.entries(first, last + 1, None, GetEntriesContext::empty(false))
        .expect("entries")
}

/// Small segments so a few hundred entries cross several of them.
fn small_config(dir: &Path) -> LogConfig {
    let mut c = raft_log_config(dir);
    c.segment_bytes = 32 << 10;
    c.max_round_bytes = 8 << 10;
    c.max_pending_bytes = 4 << 20;
    c.index_interval_bytes = 4096;
    c
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
                &entries(first..=first + 9, 1, &format!("group {at}")),
                Some(&hard_state(1, 1, first.saturating_sub(1))),
            )
            .expect("begin");
        }
        shared.drive(std::time::Instant::now()).expect("drive");
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
        assert_eq!(all_entries(log), entries(1..=50, 1, &format!("group {at}")));
    }
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
            &entries(first..=first + 19, 2, "a"),
            Some(&hard_state(2, 1, first + 19)),
        )
        .expect("a");
        let first_b = round * 10 + 1;
        b.persist(&entries(first_b..=first_b + 9, 3, "b"), None)
            .expect("b");
    }
    // b overwrites a conflicting suffix; a compacts twice (two generation switches).
    b.persist(&entries(150..=160, 4, "b2"), Some(&hard_state(4, 3, 100)))
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
        a.persist(&entries(first..=first + 9, 1, "a"), None)
            .expect("a");
        b.persist(&entries(first..=first + 9, 1, "b"), None)
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
    assert_eq!(all_entries(&b), entries(1..=300, 1, "b"));
    assert!(shared.disk_bytes() <= bytes);
}

#[test]
fn a_power_cut_keeps_every_groups_fdatasynced_records_and_drops_a_half_made_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (shared, handle) = open_shared_fault(dir.path());
    let mut a = RaftLog::open_shared(&shared, 1).expect("group 1");
    let mut b = RaftLog::open_shared(&shared, 2).expect("group 2");
    a.persist(&entries(1..=40, 1, "a"), Some(&hard_state(1, 1, 20)))
        .expect("a");
    b.persist(&entries(1..=30, 1, "b"), Some(&hard_state(1, 2, 10)))
        .expect("b");
    // Begun but never written: lost at the cut, and never acknowledged.
    a.persist_begin(&entries(41..=50, 1, "a"), None)
        .expect("begin");
    handle.power_cut(PowerCut::DropUnsynced).expect("power cut");
    drop((a, b, shared));

    let (shared, _handle) = open_shared_fault(dir.path());
    let a = RaftLog::open_shared(&shared, 1).expect("group 1");
    let b = RaftLog::open_shared(&shared, 2).expect("group 2");
    assert_eq!(all_entries(&a), entries(1..=40, 1, "a"));
    assert_eq!(a.hard_state(), &hard_state(1, 1, 20));
    assert_eq!(all_entries(&b), entries(1..=30, 1, "b"));
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
        .persist(&entries(1..=100, 2, "old"), Some(&hard_state(2, 3, 90)))
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
        .persist(&entries(1..=3, 1, "quiet"), Some(&hard_state(1, 1, 3)))
        .expect("quiet");
    assert!(!quiet.relocation_due());
    for round in 0..20u64 {
        let first = round * 10 + 1;
        busy.persist(&entries(first..=first + 9, 1, "busy"), None)
            .expect("busy");
    }
    assert!(quiet.relocation_due(), "the busy group moved the log on");
    quiet.compact(3, b"quiet at 3".to_vec()).expect("compact");
    assert!(!quiet.relocation_due(), "a compaction starts at the head");
}
