//! Reads that do not block on the disk (`Log::try_read`, `storage/src/reader.rs`): what the
//! page cache does not hold is fetched off the calling thread and the read answered later,
//! byte-identical to the blocking `Log::read`; a read waiting across retention gets
//! `OffsetTooOld`.

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use felix_storage::{
    Backend, FaultBackend, FsyncMode, Log, PwriteBackend, ReadOutcome, Record, StorageError,
    segment, wait_readable,
};

/// A log of three interleaved shards over several small segments, flushed (synced).
fn filled<B: Backend>(backend: B, dir: &std::path::Path) -> (Log<B>, Model) {
    let mut config = small_config(dir, FsyncMode::OnCommit);
    config.retention_bytes = Some(1 << 30);
    let (mut log, _) = Log::open(config, backend).expect("open");
    let mut model = Model::default();
    let mut rng = Rng(11);
    for i in 0..600 {
        model.append(&mut log, &mut rng, i % 3, 8, 300);
        if i % 32 == 0 {
            log.flush(DEADLINE).expect("flush");
        }
    }
    log.flush(DEADLINE).expect("flush");
    assert!(log.segment_seqs().len() >= 3, "{:?}", log.segment_seqs());
    (log, model)
}

/// Reads `shard` from `from` to its end with `try_read`, `page` records at a time; on
/// `Pending`, `wait` makes the fetch complete (a thread's wake-up, or the fault handle).
/// Returns the records and how many answers were `Pending`.
fn read_through<B: Backend>(
    log: &Log<B>,
    shard: u32,
    from: u64,
    page: usize,
    wait: &dyn Fn(&Log<B>),
) -> (Vec<Record>, usize) {
    let deadline = Instant::now() + DEADLINE;
    let mut out: Vec<Record> = Vec::new();
    let mut next = from;
    let mut resume = None;
    let mut pending = 0;
    loop {
        assert!(Instant::now() < deadline, "the read never completed");
        match log
            .try_read(shard, next, page, usize::MAX, resume.take())
            .expect("read")
        {
            ReadOutcome::Records(records) if records.is_empty() => return (out, pending),
            ReadOutcome::Records(records) => {
                next = records.last().map(|r| r.offset + 1).expect("non-empty");
                out.extend(records);
            }
            ReadOutcome::Pending(at) => {
                pending += 1;
                resume = Some(at);
                wait(log);
                log.poll_reads();
            }
        }
    }
}

fn assert_identical(got: &[Record], want: &[Expected]) {
    assert_eq!(got.len(), want.len());
    for (g, e) in got.iter().zip(want) {
        assert!(same(g, e), "offset {}: {g:?} vs {e:?}", e.offset);
    }
}

#[test]
fn a_log_on_a_system_backend_stays_send() {
    // The read side keeps no `Rc` (the fault backend's held reads are asked for per call).
    fn send<T: Send>() {}
    send::<Log<felix_storage::SystemBackend>>();
}

#[test]
fn a_read_that_misses_the_page_cache_waits_for_the_reader_thread() {
    // Every look at the page cache misses (the test hook): the first answer is Pending, the
    // reader thread's chunk wakes the log's eventfd, and the records that come back are
    // byte-identical to the blocking read's, across segments; the pread ran off this thread.
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, model) = filled(PwriteBackend::new().expect("pwrite"), dir.path());
    log.force_read_misses(true);
    let first = log.try_read(1, 0, 50, usize::MAX, None).expect("read");
    assert!(
        matches!(first, ReadOutcome::Pending(_)),
        "a miss is answered later: {first:?}"
    );
    assert_eq!(log.reads_outstanding(), 1);
    let wait = |log: &Log<PwriteBackend>| {
        let deadline = Instant::now() + DEADLINE;
        while log.reads_outstanding() > 0 && log.poll_reads() == 0 {
            assert!(Instant::now() < deadline, "the fetch never came back");
            wait_readable(log.wake_fd(), Duration::from_secs(1)).expect("wait");
        }
    };
    wait(&log);
    let (got, pending) = read_through(&log, 1, 0, 50, &wait);
    assert_identical(&got, &model.shards[&1]);
    assert!(pending >= 1);
    assert!(
        log.counters().read_fetches.get() >= 3,
        "one fetch per segment at least"
    );
    assert_eq!(
        got,
        log.read(1, 0, 1000, usize::MAX).expect("blocking read")
    );
    // Mid-shard starts too (the index entry is before the offset).
    for from in [7u64, 99, 150] {
        let (got, _) = read_through(&log, 2, from, 13, &wait);
        assert_identical(&got, &model.shards[&2][from as usize..]);
    }
}

#[test]
fn a_read_of_evicted_pages_is_answered_identically() {
    // The real page cache: the segments' pages dropped (POSIX_FADV_DONTNEED after the
    // fdatasyncs), then read without the hook. Whether the kernel kept the pages or not, the
    // records are byte-identical and every chunk was either found in memory or fetched.
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, model) = filled(PwriteBackend::new().expect("pwrite"), dir.path());
    for seq in log.segment_seqs() {
        let file = std::fs::File::open(dir.path().join(segment::file_name(seq))).expect("open");
        // SAFETY: a valid fd, whole-file range; advice only.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0, "fadvise");
    }
    let wait = |log: &Log<PwriteBackend>| {
        let deadline = Instant::now() + DEADLINE;
        while log.reads_outstanding() > 0 && log.poll_reads() == 0 {
            assert!(Instant::now() < deadline, "the fetch never came back");
            wait_readable(log.wake_fd(), Duration::from_secs(1)).expect("wait");
        }
    };
    let (got, pending) = read_through(&log, 0, 0, 64, &wait);
    assert_identical(&got, &model.shards[&0]);
    let counters = log.counters();
    assert!(counters.read_cache_hits.get() + counters.read_fetches.get() > 0);
    eprintln!(
        "evicted read: {pending} pending answers, {} chunks in memory, {} fetched",
        counters.read_cache_hits.get(),
        counters.read_fetches.get()
    );
}

#[test]
fn held_fetches_complete_when_the_test_says_and_resume_where_they_stopped() {
    // The fault backend: misses drawn from a seed, fetches held until completed. Nothing
    // arrives before the fetch is completed; afterwards the read goes on from where it
    // stopped, and all of it matches the blocking read.
    let dir = tempfile::tempdir().expect("tempdir");
    let (backend, fault) = FaultBackend::new(true).expect("fault");
    let (log, model) = filled(backend, dir.path());
    fault.set_read_misses(1000, 7);
    let ReadOutcome::Pending(resume) = log.try_read(0, 3, 40, usize::MAX, None).expect("read")
    else {
        panic!("every look misses");
    };
    assert_eq!(fault.held_fetches(), 1);
    assert_eq!(log.poll_reads(), 0, "held until completed");
    // Asked again before the chunk came: still waiting, no second fetch of the same bytes.
    assert!(matches!(
        log.try_read(0, 3, 40, usize::MAX, Some(resume.clone()))
            .expect("read"),
        ReadOutcome::Pending(_)
    ));
    assert_eq!(fault.held_fetches(), 1);
    assert!(fault.complete_next_fetch());
    assert_eq!(log.poll_reads(), 1);
    let ReadOutcome::Records(records) = log
        .try_read(0, 3, 40, usize::MAX, Some(resume))
        .expect("read")
    else {
        panic!("the fetched chunk answers the retry");
    };
    assert!(!records.is_empty());
    assert_identical(&records, &model.shards[&0][3..3 + records.len()]);
    let wait = |_: &Log<FaultBackend>| assert!(fault.complete_next_fetch(), "a fetch is held");
    let (got, pending) = read_through(&log, 0, 0, 40, &wait);
    assert_identical(&got, &model.shards[&0]);
    assert!(pending > 0);
    assert_eq!(fault.held_fetches(), 0);
    // Half the looks miss: both paths, same records.
    fault.set_read_misses(500, 9);
    let (got, _) = read_through(&log, 2, 0, 17, &wait);
    assert_identical(&got, &model.shards[&2]);
}

#[test]
fn a_read_waiting_while_retention_deletes_its_segment_gets_offset_too_old() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (backend, fault) = FaultBackend::new(true).expect("fault");
    let mut config = small_config(dir.path(), FsyncMode::OnCommit);
    config.retention_bytes = Some(2 * config.segment_bytes);
    let (mut log, _) = Log::open(config, backend).expect("open");
    let mut model = Model::default();
    let mut rng = Rng(3);
    for i in 0..600 {
        model.append(&mut log, &mut rng, i % 2, 8, 300);
        if i % 32 == 0 {
            log.flush(DEADLINE).expect("flush");
        }
    }
    log.flush(DEADLINE).expect("flush");
    fault.set_read_misses(1000, 1);
    let ReadOutcome::Pending(resume) = log.try_read(1, 0, 10, usize::MAX, None).expect("read")
    else {
        panic!("every look misses");
    };
    let report = log.apply_retention(0).expect("retention");
    assert!(!report.segments_deleted.is_empty());
    assert!(fault.complete_next_fetch());
    log.poll_reads();
    match log.try_read(1, 0, 10, usize::MAX, Some(resume)) {
        Err(StorageError::OffsetTooOld { requested: 0, .. }) => {}
        other => panic!("expected OffsetTooOld, got {other:?}"),
    }
}
