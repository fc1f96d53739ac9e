//! Power loss and disk faults, simulated by the fault-injecting backend on real files:
//! random workloads stepped round by round, then a power cut that drops (or tears) every
//! byte no completed fdatasync covered; recovery must keep everything reported durable.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::Rng;
use common::*;
use felix_storage::{FaultBackend, FaultHandle, FsyncMode, Log, LogEvent, PowerCut, StorageError};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Append {
        shard: u32,
        key: usize,
        payload: usize,
    },
    /// `drive` at the current simulated time.
    Drive,
    /// The disk finishes the held round; then `drive`.
    Complete,
    /// Simulated time passes (periodic fsync timer).
    Tick,
    /// The next write fails with ENOSPC after writing this fraction (in 1/4) of its bytes.
    DiskFull { quarters: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..4, 0usize..6, 0usize..900).prop_map(|(shard, key, payload)| Op::Append { shard, key, payload }),
        2 => Just(Op::Drive),
        4 => Just(Op::Complete),
        1 => Just(Op::Tick),
        1 => (0usize..=4).prop_map(|quarters| Op::DiskFull { quarters }),
    ]
}

/// What the test knows about each (shard, offset): every content appended there (a rejected
/// append may be followed by a different one at the same offset) and whether it was synced.
#[derive(Default)]
struct Truth {
    contents: BTreeMap<(u32, u64), Vec<Expected>>,
    next: BTreeMap<u32, u64>,
    written: BTreeMap<u32, u64>,
    synced: BTreeMap<u32, u64>,
}

impl Truth {
    fn record_events(&mut self, events: Vec<LogEvent>) {
        for e in events {
            match e {
                LogEvent::Written(ranges) => {
                    for r in ranges {
                        let w = self.written.entry(r.shard).or_insert(0);
                        assert_eq!(*w, r.first, "written ranges are contiguous");
                        *w = r.end;
                    }
                }
                LogEvent::Synced(ranges) => {
                    for r in ranges {
                        let s = self.synced.entry(r.shard).or_insert(0);
                        assert_eq!(*s, r.first, "synced ranges are contiguous");
                        *s = r.end;
                    }
                }
                LogEvent::Rejected { ranges, error } => {
                    assert!(matches!(error, StorageError::DiskFull));
                    for r in ranges {
                        let n = self.next.entry(r.shard).or_insert(0);
                        *n = (*n).min(r.first);
                    }
                }
            }
        }
    }
}

struct Run {
    log: Log<FaultBackend>,
    handle: FaultHandle,
    truth: Truth,
    rng: Rng,
    now: Instant,
}

impl Run {
    fn drive(&mut self) {
        self.log.drive(self.now).expect("drive");
        let events = drain(&mut self.log);
        self.truth.record_events(events);
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Append {
                shard,
                key,
                payload,
            } => {
                let offset = *self.truth.next.get(&shard).unwrap_or(&0);
                assert_eq!(
                    self.log.shard_offsets(shard).map_or(0, |o| o.next),
                    offset,
                    "log and model agree on next offsets"
                );
                let e = Expected {
                    shard,
                    offset,
                    timestamp_us: self.rng.next() >> 20,
                    key: self.rng.bytes(key),
                    payload: self.rng.bytes(payload),
                };
                match self
                    .log
                    .append(shard, offset, e.timestamp_us, &e.key, &e.payload)
                {
                    Ok(()) => {
                        self.truth
                            .contents
                            .entry((shard, offset))
                            .or_default()
                            .push(e);
                        self.truth.next.insert(shard, offset + 1);
                    }
                    Err(StorageError::PendingFull { .. }) => {}
                    Err(other) => panic!("append: {other}"),
                }
            }
            Op::Drive => self.drive(),
            Op::Complete => {
                self.handle.complete_next();
                self.drive();
            }
            Op::Tick => {
                self.now += Duration::from_millis(30);
                self.drive();
            }
            Op::DiskFull { quarters } => {
                // A whole-round-sized prefix: enough to leave complete stale records behind.
                self.handle.fail_next_write(libc::ENOSPC, quarters * 2048);
            }
        }
    }
}

/// Recovers `dir` and checks it against `truth`: every synced record (every written one
/// after a mere process crash) present and identical, offsets dense from 0 and in order, and
/// nothing present that was never appended there.
fn check_recovery(
    dir: &std::path::Path,
    fsync: FsyncMode,
    truth: &Truth,
    power_lost: bool,
) -> Log<FaultBackend> {
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (log, report) = Log::open(small_config(dir, fsync), backend).expect("recover");
    let durable = if power_lost {
        &truth.synced
    } else {
        &truth.written
    };
    for (&shard, &end) in durable {
        let next = log.shard_offsets(shard).map_or(0, |o| o.next);
        assert!(
            next >= end,
            "shard {shard}: recovered up to {next}, {end} were reported durable ({report:?})"
        );
    }
    for shard in log.shard_ids() {
        let got = read_all(&log, shard, 0, 64);
        assert_eq!(
            got.len() as u64,
            log.shard_offsets(shard).map_or(0, |o| o.next),
            "shard {shard} reads everything"
        );
        for (i, r) in got.iter().enumerate() {
            assert_eq!(r.offset, i as u64, "dense from 0, in order");
            let candidates = truth
                .contents
                .get(&(shard, r.offset))
                .expect("only appended offsets exist");
            let synced = truth.synced.get(&shard).is_some_and(|s| r.offset < *s);
            if synced {
                // Nothing is appended at an offset after it was synced: the last append is it.
                assert!(
                    candidates.last().is_some_and(|e| same(r, e)),
                    "synced shard {shard} offset {} intact",
                    r.offset
                );
            }
            // Unsynced survivors may be a rejected (never acked) append, but never anything else.
            assert!(
                candidates.iter().any(|e| same(r, e)),
                "shard {shard} offset {} is byte-identical to an append",
                r.offset
            );
        }
    }
    log
}

/// `cut`: `None` is a process crash (every completed write stays in the files).
fn run_workload(ops: &[Op], fsync: FsyncMode, cut: Option<PowerCut>, seed: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = small_config(dir.path(), fsync);
    cfg.segment_bytes = 16 << 10;
    cfg.max_round_bytes = 4096;
    let (backend, handle) = FaultBackend::new(false).expect("backend");
    let (log, _) = Log::open(cfg, backend).expect("open");
    let mut run = Run {
        log,
        handle,
        truth: Truth::default(),
        rng: Rng(seed),
        now: Instant::now(),
    };
    for op in ops {
        run.apply(op);
    }
    if let Some(cut) = cut {
        run.handle.power_cut(cut).expect("power cut");
    }
    let Run { log, truth, .. } = run;
    drop(log);
    let mut log = check_recovery(dir.path(), fsync, &truth, cut.is_some());
    // The recovered log takes appends where it left off and survives another restart.
    let shard = 0;
    let next = log.shard_offsets(shard).map_or(0, |o| o.next);
    log.append(shard, next, 1, b"after", b"recovery")
        .expect("append after recovery");
    log.sync_now();
    log.flush(DEADLINE).expect("flush");
    drop(log);
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (log, _) = Log::open(small_config(dir.path(), fsync), backend).expect("recover again");
    let last = log.read(shard, next, 1, usize::MAX).expect("read");
    assert_eq!(last.first().map(|r| &r.payload[..]), Some(&b"recovery"[..]));
}

fn cut_strategy() -> impl Strategy<Value = Option<PowerCut>> {
    prop_oneof![
        2 => Just(Some(PowerCut::DropUnsynced)),
        2 => any::<u64>().prop_map(|seed| Some(PowerCut::TearUnsynced { seed })),
        1 => Just(None),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn on_commit_power_cut_keeps_everything_synced(ops in prop::collection::vec(op(), 1..250), cut in cut_strategy(), seed in any::<u64>()) {
        // on_commit: after a power cut (or a process crash) every record reported durable is present, byte-identical, dense and in order.
        run_workload(&ops, FsyncMode::OnCommit, cut, seed);
    }

    #[test]
    fn periodic_power_cut_keeps_everything_synced(ops in prop::collection::vec(op(), 1..250), cut in cut_strategy(), seed in any::<u64>()) {
        // periodic: a power cut may lose written-only records but never a Synced one; a process crash loses nothing Written.
        run_workload(&ops, FsyncMode::Periodic { interval: Duration::from_millis(50) }, cut, seed);
    }
}

fn stepped_log(fsync: FsyncMode) -> (tempfile::TempDir, Log<FaultBackend>, FaultHandle) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (backend, handle) = FaultBackend::new(false).expect("backend");
    let (log, _) = Log::open(small_config(dir.path(), fsync), backend).expect("open");
    (dir, log, handle)
}

#[test]
fn fdatasync_eio_fails_the_log_and_reports_nothing_durable() {
    // An fdatasync error is fatal: the round is never reported written or synced, the log refuses all work, and a power cut loses only that round.
    let (dir, mut log, handle) = stepped_log(FsyncMode::OnCommit);
    for i in 0..5 {
        log.append(0, i, 1, b"k", b"durable").expect("append");
    }
    log.drive(Instant::now()).expect("drive");
    handle.complete_next();
    log.drive(Instant::now()).expect("drive");
    assert_eq!(drain(&mut log).len(), 2, "Written + Synced");
    for i in 5..9 {
        log.append(0, i, 1, b"k", b"lost").expect("append");
    }
    log.drive(Instant::now()).expect("drive");
    handle.fail_next_sync(libc::EIO);
    handle.complete_next();
    let err = log
        .drive(Instant::now())
        .expect_err("sync failure is fatal");
    assert!(matches!(err, StorageError::SyncFailed { errno, .. } if errno == libc::EIO));
    assert!(
        drain(&mut log).is_empty(),
        "nothing reported for the failed round"
    );
    assert_eq!(log.shard_offsets(0).map(|o| o.synced), Some(5));
    assert!(matches!(
        log.append(0, 9, 1, b"", b""),
        Err(StorageError::SyncFailed { .. })
    ));
    assert!(matches!(
        log.drive(Instant::now()),
        Err(StorageError::SyncFailed { .. })
    ));
    assert!(log.failure().is_some_and(StorageError::is_fatal));
    handle.power_cut(PowerCut::DropUnsynced).expect("cut");
    drop(log);
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (log, _) =
        Log::open(small_config(dir.path(), FsyncMode::OnCommit), backend).expect("recover");
    let got = read_all(&log, 0, 0, 100);
    assert_eq!(got.len(), 5);
    assert!(got.iter().all(|r| &r.payload[..] == b"durable"));
}

#[test]
fn enospc_rejects_the_round_and_the_retry_leaves_no_stale_records() {
    // ENOSPC: the round and everything queued after it are Rejected with DiskFull, offsets roll back, and a retry at the same position leaves no stale record behind even across a restart.
    let (dir, mut log, handle) = stepped_log(FsyncMode::OnCommit);
    for i in 0..3 {
        log.append(0, i, 1, b"k", b"kept-000").expect("append");
    }
    log.drive(Instant::now()).expect("drive");
    handle.complete_next();
    log.drive(Instant::now()).expect("drive");
    drain(&mut log);
    // Round A: offsets 3 and 4 of shard 0; then more appends queue behind it.
    log.append(0, 3, 1, b"k", b"stale-03").expect("append");
    log.append(0, 4, 1, b"k", b"stale-04").expect("append");
    log.drive(Instant::now()).expect("drive");
    log.append(1, 0, 1, b"k", b"queued").expect("append");
    handle.fail_next_write(libc::ENOSPC, usize::MAX);
    handle.complete_next();
    log.drive(Instant::now()).expect("DiskFull is not fatal");
    let events = drain(&mut log);
    let [LogEvent::Rejected { ranges, error }] = &events[..] else {
        panic!("{events:?}")
    };
    assert!(matches!(error, StorageError::DiskFull));
    assert_eq!(
        covered(ranges.iter().copied()),
        BTreeMap::from([(0, 5), (1, 1)])
    );
    assert_eq!(log.counters().rejected_records, 3);
    assert_eq!(log.shard_offsets(0).map(|o| o.next), Some(3), "rolled back");
    assert_eq!(
        log.shard_offsets(1),
        None,
        "a shard that only had rejected appends is forgotten"
    );
    // Retry offset 3 with a same-sized record: without the zero fill, stale offset 4 would
    // follow it exactly and look valid to recovery.
    log.append(0, 3, 1, b"k", b"retry-03").expect("append");
    log.drive(Instant::now()).expect("drive");
    handle.complete_next();
    log.drive(Instant::now()).expect("drive");
    let events = drain(&mut log);
    assert!(
        matches!(&events[..], [LogEvent::Written(_), LogEvent::Synced(_)]),
        "{events:?}"
    );
    // Frames here are 28 + 1 + 8 = 37 bytes: the failed write (2 frames) and the zero
    // fill over the stale second frame were written without being records.
    assert_eq!(
        log.counters().write_bytes - log.counters().append_bytes,
        3 * 37,
        "zero fill over the stale tail"
    );
    drop(log); // a process crash: everything written stays in the files
    let (backend, _) = FaultBackend::new(true).expect("backend");
    let (log, report) =
        Log::open(small_config(dir.path(), FsyncMode::OnCommit), backend).expect("recover");
    let payloads: Vec<_> = read_all(&log, 0, 0, 100)
        .into_iter()
        .map(|r| r.payload)
        .collect();
    assert_eq!(
        payloads,
        vec!["kept-000", "kept-000", "kept-000", "retry-03"]
    );
    assert_eq!(report.truncated_bytes, 0);
}
