//! Idempotent producers on the per-core state machine (docs/semantics.md, "Idempotent
//! producers"): a batch already stored is answered with its original ack and stores nothing,
//! a sequence that skips ahead is refused, the window of remembered batches, the eviction of
//! the least recently used producer, and a durable batch retried before it is committed.

mod support;

use felix_core::{DurableLog, DurableSettings, Flow, PRODUCER_WINDOW, PRODUCERS_PER_SHARD_MAX};
use felix_storage::{BackendChoice, FaultBackend, FsyncMode};
use felix_wire::{
    AckMode, ErrorCode, FEATURE_PRODUCER, FEATURE_TOKEN, Frame, Hello, PROTOCOL_VERSION,
    ProducerPublish, Publish, Record, ShardAck, StreamKind,
};
use support::{Broker, Conn, ingress, key_on_core, record};

/// A `ProducerPublish` of `records` (all on `shard`).
fn produce(
    request_id: u64,
    stream: &str,
    producer: u64,
    sequence: u64,
    shard: u32,
    records: Vec<Record>,
) -> Frame {
    Frame::ProducerPublish(ProducerPublish {
        publish: Publish {
            request_id,
            ack: AckMode::Acked,
            stream: stream.to_owned(),
            records,
        },
        producer,
        sequence,
        shard,
    })
}

/// Feeds `frame` on `conn`, lets every core settle, and returns the one answer.
fn answer(broker: &mut Broker, conn: &Conn, frame: Frame) -> Frame {
    let flow = broker.feed(conn.core, conn.requests, frame);
    assert_eq!(flow, Flow::Continue);
    broker.settle();
    let mut frames = broker.read(conn.core, conn.requests);
    assert_eq!(frames.len(), 1, "{frames:?}");
    frames.remove(0)
}

fn ack_of(frame: &Frame) -> Vec<ShardAck> {
    match frame {
        Frame::Ack(ack) => ack.shards.clone(),
        other => panic!("expected an ack, got {other:?}"),
    }
}

fn error_of(frame: &Frame) -> (ErrorCode, u64) {
    match frame {
        Frame::Error(error) => (error.code, error.detail),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// The next offset of `shard` of `stream`, as `DescribeStream` answers it.
fn next_offset(broker: &mut Broker, conn: &Conn, stream: &str, shard: u32) -> u64 {
    let describe = Frame::DescribeStream {
        request_id: 99,
        name: stream.to_owned(),
    };
    let flow = broker.feed(conn.core, conn.requests, describe);
    assert!(matches!(flow, Flow::Continue | Flow::Blocked));
    broker.settle();
    let frames = broker.read(conn.core, conn.requests);
    let [Frame::StreamInfo(info)] = frames.as_slice() else {
        panic!("{frames:?}");
    };
    info.shards[shard as usize].next_offset
}

#[test]
fn a_stored_sequence_gets_its_original_ack_and_stores_nothing() {
    // Proves, for a shard owned by the core the publish arrives on and for one owned by
    // another core (forwarded), that a batch whose sequence was stored is answered with the
    // original offsets and appends nothing, while the next sequence is stored.
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "orders", 4, StreamKind::InMemory);
    for owner in [0u16, 1] {
        let key = key_on_core(4, 2, owner);
        let shard = felix_wire::shard_for_key(key.as_bytes(), 4);
        let batch = vec![record(&key, "a"), record(&key, "b")];
        let first = ack_of(&answer(
            &mut broker,
            &conn,
            produce(1, "orders", 7, 1, shard, batch.clone()),
        ));
        assert_eq!(
            first,
            vec![ShardAck {
                shard,
                first_offset: 0,
                count: 2
            }]
        );
        let second = ack_of(&answer(
            &mut broker,
            &conn,
            produce(2, "orders", 7, 2, shard, vec![record(&key, "c")]),
        ));
        assert_eq!(second[0].first_offset, 2);
        // The retry of batch 1: the original's offsets, nothing appended.
        let retry = ack_of(&answer(
            &mut broker,
            &conn,
            produce(3, "orders", 7, 1, shard, batch.clone()),
        ));
        assert_eq!(retry, first, "owner core {owner}");
        assert_eq!(next_offset(&mut broker, &conn, "orders", shard), 3);
        // Another producer's batch 1 is its own.
        let other = ack_of(&answer(
            &mut broker,
            &conn,
            produce(4, "orders", 8, 1, shard, batch),
        ));
        assert_eq!(other[0].first_offset, 3);
    }
    let duplicates: u64 = (0..2)
        .map(|core| broker.cores[core].counters().producer_duplicates)
        .sum();
    assert_eq!(duplicates, 2);
}

#[test]
fn a_sequence_that_skips_ahead_is_refused_and_stores_nothing() {
    // Proves a gap in a producer's sequence, and a first batch other than 1, are refused with
    // OutOfSequence naming the expected sequence (0 for an unknown producer), nothing stored;
    // sequence 0 asks for no deduplication.
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "s", 1, StreamKind::InMemory);
    let one = || vec![record("k", "v")];
    ack_of(&answer(&mut broker, &conn, produce(1, "s", 5, 1, 0, one())));
    let gap = answer(&mut broker, &conn, produce(2, "s", 5, 3, 0, one()));
    assert_eq!(error_of(&gap), (ErrorCode::OutOfSequence, 2));
    let unknown = answer(&mut broker, &conn, produce(3, "s", 6, 2, 0, one()));
    assert_eq!(error_of(&unknown), (ErrorCode::OutOfSequence, 1));
    assert_eq!(next_offset(&mut broker, &conn, "s", 0), 1);
    assert_eq!(broker.cores[0].counters().producer_out_of_sequence, 2);
    // The missing batch 2, then 3, are taken.
    let two = ack_of(&answer(&mut broker, &conn, produce(4, "s", 5, 2, 0, one())));
    let three = ack_of(&answer(&mut broker, &conn, produce(5, "s", 5, 3, 0, one())));
    assert_eq!((two[0].first_offset, three[0].first_offset), (1, 2));
    // Sequence 0: stored every time.
    for request in 6..8 {
        ack_of(&answer(
            &mut broker,
            &conn,
            produce(request, "s", 5, 0, 0, one()),
        ));
    }
    assert_eq!(next_offset(&mut broker, &conn, "s", 0), 5);
}

#[test]
fn the_window_remembers_the_last_batches_of_a_producer() {
    // Proves the last PRODUCER_WINDOW batches of a producer are answered with their original
    // acks, and an older one is refused (OutOfSequence, the next expected sequence).
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "w", 1, StreamKind::InMemory);
    let last = PRODUCER_WINDOW as u64 + 2;
    let mut acks = Vec::new();
    for sequence in 1..=last {
        let frame = produce(sequence, "w", 1, sequence, 0, vec![record("k", "v")]);
        acks.push(ack_of(&answer(&mut broker, &conn, frame)));
    }
    for sequence in last + 1 - PRODUCER_WINDOW as u64..=last {
        let frame = produce(100 + sequence, "w", 1, sequence, 0, vec![record("k", "v")]);
        let retry = ack_of(&answer(&mut broker, &conn, frame));
        assert_eq!(retry, acks[(sequence - 1) as usize], "sequence {sequence}");
    }
    let old = last - PRODUCER_WINDOW as u64;
    let frame = produce(200, "w", 1, old, 0, vec![record("k", "v")]);
    assert_eq!(
        error_of(&answer(&mut broker, &conn, frame)),
        (ErrorCode::OutOfSequence, last + 1)
    );
    assert_eq!(next_offset(&mut broker, &conn, "w", 0), last);
}

#[test]
fn the_least_recently_used_producer_is_forgotten_at_the_cap() {
    // Proves a shard remembers at most PRODUCERS_PER_SHARD_MAX producers: the next one
    // evicts the least recently used (counted), whose retry is then refused with
    // OutOfSequence detail 1 (taken for a new producer), while a recently used one is still
    // deduplicated.
    let mut broker = Broker::new(1, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "m", 1, StreamKind::InMemory);
    let cap = PRODUCERS_PER_SHARD_MAX as u64;
    let mut request = 0;
    let mut send = |broker: &mut Broker, producer: u64, sequence: u64| {
        request += 1;
        answer(
            broker,
            &conn,
            produce(request, "m", producer, sequence, 0, vec![record("k", "v")]),
        )
    };
    for producer in 1..=cap {
        ack_of(&send(&mut broker, producer, 1));
    }
    // Producer 1 retries (used again); producer 2 is now the least recently used.
    assert_eq!(ack_of(&send(&mut broker, 1, 1))[0].first_offset, 0);
    ack_of(&send(&mut broker, cap + 1, 1));
    assert_eq!(broker.cores[0].counters().producer_evictions, 1);
    assert_eq!(ack_of(&send(&mut broker, 1, 1))[0].first_offset, 0);
    // Producer 2 is unknown now: its next batch is refused, nothing stored.
    assert_eq!(
        error_of(&send(&mut broker, 2, 2)),
        (ErrorCode::OutOfSequence, 1)
    );
    assert_eq!(next_offset(&mut broker, &conn, "m", 0), cap + 1);
}

#[test]
fn a_batch_of_several_shards_or_a_wrong_shard_is_refused() {
    // Proves a producer batch holds one shard's records: a record of another shard, or a
    // shard out of range, is InvalidArgument and stores nothing.
    let mut broker = Broker::new(2, ingress());
    let conn = broker.connect(0);
    broker.create(&conn, "x", 4, StreamKind::InMemory);
    let on_zero = key_on_core(4, 2, 0);
    let on_one = key_on_core(4, 2, 1);
    let shard = felix_wire::shard_for_key(on_zero.as_bytes(), 4);
    let mixed = vec![record(&on_zero, "a"), record(&on_one, "b")];
    let refused = answer(&mut broker, &conn, produce(1, "x", 3, 1, shard, mixed));
    assert_eq!(error_of(&refused).0, ErrorCode::InvalidArgument);
    let out_of_range = answer(
        &mut broker,
        &conn,
        produce(2, "x", 3, 1, 4, vec![record(&on_zero, "a")]),
    );
    assert_eq!(error_of(&out_of_range).0, ErrorCode::InvalidArgument);
    assert_eq!(next_offset(&mut broker, &conn, "x", shard), 0);
    // Batch 1 was not consumed by the refusals.
    let stored = answer(
        &mut broker,
        &conn,
        produce(3, "x", 3, 1, shard, vec![record(&on_zero, "a")]),
    );
    assert_eq!(ack_of(&stored)[0].first_offset, 0);
}

#[test]
fn the_broker_echoes_the_producer_feature() {
    // Proves HelloOk carries FEATURE_PRODUCER when the client set it (and not unknown bits),
    // and nothing when it did not.
    let mut broker = Broker::new(1, ingress());
    for (features, echoed) in [
        (FEATURE_PRODUCER | 1 << 40, FEATURE_PRODUCER),
        (1 << 40, 0),
        (0, 0),
    ] {
        let id = broker.cores[0]
            .handle_connection_opened(None)
            .expect("room");
        let hello = broker.cores[0].handle_stream_opened(id);
        let frame = Frame::Hello(Hello {
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            features,
            client_name: "t".to_owned(),
            token: None,
        });
        assert_eq!(broker.feed(0, hello, frame), Flow::Continue);
        let frames = broker.read(0, hello);
        let [Frame::HelloOk(ok)] = frames.as_slice() else {
            panic!("{frames:?}");
        };
        assert_eq!(ok.features, echoed);
        assert_eq!(ok.features & FEATURE_TOKEN, 0);
    }
}

#[test]
fn a_durable_retry_before_the_commit_is_unavailable_then_gets_the_original_ack() {
    // Proves a durable producer batch retried while its round is not yet synced is answered
    // Unavailable (nothing stored, no ack before durability), and once synced the retry gets
    // the original offsets.
    let dir = tempfile::tempdir().expect("temp dir");
    let mut broker = Broker::new(1, ingress());
    let (backend, fault) = FaultBackend::new(false).expect("fault backend");
    let settings = DurableSettings {
        fsync: FsyncMode::OnCommit,
        backend: BackendChoice::Pwrite,
        direct_io: true,
        rounds_in_flight: 2,
        segment_bytes: 1 << 20,
        retention_bytes: None,
        retention_age: None,
    };
    let mut log = DurableLog::open(0, settings.log_config(dir.path(), 0), backend).expect("log");
    let conn = broker.connect(0);
    let create = Frame::CreateStream(felix_wire::CreateStream {
        request_id: 1,
        name: "d".to_owned(),
        shard_count: 1,
        kind: StreamKind::Durable,
    });
    assert_eq!(broker.feed(0, conn.requests, create), Flow::Blocked);
    let write = broker.cores[0]
        .poll_catalog_write()
        .expect("persisted first");
    let now = broker.now();
    broker.cores[0].handle_catalog_written(now, write.id, Ok(()));
    assert_eq!(broker.read(0, conn.requests).len(), 1, "StreamInfo");
    let batch = vec![record("a", "1"), record("b", "2")];
    let flow = broker.feed(0, conn.requests, produce(2, "d", 9, 1, 0, batch.clone()));
    assert_eq!(flow, Flow::Continue);
    let now = broker.now();
    broker.cores[0].pump_log(&mut log, now).expect("pumped");
    assert!(broker.read(0, conn.requests).is_empty(), "not yet synced");
    let early = answer(&mut broker, &conn, produce(3, "d", 9, 1, 0, batch.clone()));
    assert_eq!(
        error_of(&early),
        (ErrorCode::Unavailable, 1),
        "detail: its sequence"
    );
    assert!(fault.complete_next());
    broker.cores[0].pump_log(&mut log, now).expect("pumped");
    let frames = broker.read(0, conn.requests);
    let [Frame::Ack(original)] = frames.as_slice() else {
        panic!("{frames:?}");
    };
    assert_eq!(original.request_id, 2);
    let retry = answer(&mut broker, &conn, produce(4, "d", 9, 1, 0, batch));
    assert_eq!(ack_of(&retry), original.shards);
    assert_eq!(
        next_offset(&mut broker, &conn, "d", 0),
        2,
        "the retry appended nothing"
    );
}

/// A one-core broker with durable stream `d` (one shard) on a fault log in `dir`
/// (`auto_complete`: rounds complete at once); returns the broker, its connection, the log,
/// its fault handle and the stream's catalogue entry.
fn durable_broker(
    dir: &std::path::Path,
    auto_complete: bool,
) -> (
    Broker,
    Conn,
    DurableLog<FaultBackend>,
    felix_storage::FaultHandle,
    felix_core::CatalogEntry,
) {
    let mut broker = Broker::new(1, ingress());
    let (backend, fault) = FaultBackend::new(auto_complete).expect("fault backend");
    let log = DurableLog::open(0, settings().log_config(dir, 0), backend).expect("log");
    let conn = broker.connect(0);
    let create = Frame::CreateStream(felix_wire::CreateStream {
        request_id: 1,
        name: "d".to_owned(),
        shard_count: 1,
        kind: StreamKind::Durable,
    });
    assert_eq!(broker.feed(0, conn.requests, create), Flow::Blocked);
    let write = broker.cores[0]
        .poll_catalog_write()
        .expect("persisted first");
    let felix_core::CatalogChange::Add(entry) = write.change.clone() else {
        panic!("{write:?}");
    };
    let now = broker.now();
    broker.cores[0].handle_catalog_written(now, write.id, Ok(()));
    assert_eq!(broker.read(0, conn.requests).len(), 1, "StreamInfo");
    (broker, conn, log, fault, entry)
}

fn settings() -> DurableSettings {
    DurableSettings {
        fsync: FsyncMode::OnCommit,
        backend: BackendChoice::Pwrite,
        direct_io: true,
        rounds_in_flight: 2,
        segment_bytes: 1 << 20,
        retention_bytes: None,
        retention_age: None,
    }
}

/// The same directory's log opened again (as after a crash) and restored into a new broker.
fn reopened(
    dir: &std::path::Path,
    entry: &felix_core::CatalogEntry,
) -> (Broker, Conn, DurableLog<FaultBackend>) {
    let mut broker = Broker::new(1, ingress());
    let (backend, _fault) = FaultBackend::new(true).expect("fault backend");
    let log = DurableLog::open(0, settings().log_config(dir, 0), backend).expect("reopened");
    broker.cores[0]
        .restore_durable(&log, std::slice::from_ref(entry))
        .expect("restored");
    let conn = broker.connect(0);
    (broker, conn, log)
}

/// Feeds a producer batch and pumps the log until it is answered.
fn durable_answer(
    broker: &mut Broker,
    conn: &Conn,
    log: &mut DurableLog<FaultBackend>,
    frame: Frame,
) -> Frame {
    assert_eq!(broker.feed(0, conn.requests, frame), Flow::Continue);
    for _ in 0..1000 {
        let now = broker.now();
        broker.cores[0].pump_log(log, now).expect("pumped");
        let mut frames = broker.read(0, conn.requests);
        if !frames.is_empty() {
            assert_eq!(frames.len(), 1, "{frames:?}");
            return frames.remove(0);
        }
        let fd = log.wake_fd();
        let _ = felix_storage::wait_readable(fd, std::time::Duration::from_secs(5));
    }
    panic!("no answer");
}

#[test]
fn a_durable_producer_is_remembered_across_a_restart() {
    // Proves the producer journal: after the log is reopened (as after SIGKILL) and the
    // stream restored, a retry of each acked batch gets its original offsets and stores
    // nothing, the next sequence is stored after them, and a gap is still refused.
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut broker, conn, mut log, _fault, entry) = durable_broker(dir.path(), true);
    let batch = |i: u64| {
        vec![
            record("k", &format!("r{i}a")),
            record("k", &format!("r{i}b")),
        ]
    };
    let mut acks = Vec::new();
    for sequence in 1..=3 {
        let frame = produce(sequence, "d", 11, sequence, 0, batch(sequence));
        acks.push(ack_of(&durable_answer(&mut broker, &conn, &mut log, frame)));
    }
    // A plain publish in between, and another producer.
    let other = produce(9, "d", 12, 1, 0, batch(9));
    let other_ack = ack_of(&durable_answer(&mut broker, &conn, &mut log, other));
    drop(log);
    drop(broker);
    let (mut broker, conn, mut log) = reopened(dir.path(), &entry);
    for sequence in 1..=3u64 {
        let frame = produce(20 + sequence, "d", 11, sequence, 0, batch(sequence));
        let retry = durable_answer(&mut broker, &conn, &mut log, frame);
        assert_eq!(ack_of(&retry), acks[(sequence - 1) as usize]);
    }
    let frame = produce(30, "d", 12, 1, 0, batch(9));
    assert_eq!(
        ack_of(&durable_answer(&mut broker, &conn, &mut log, frame)),
        other_ack
    );
    assert_eq!(
        next_offset(&mut broker, &conn, "d", 0),
        8,
        "nothing stored again"
    );
    let gap = durable_answer(
        &mut broker,
        &conn,
        &mut log,
        produce(31, "d", 11, 5, 0, batch(5)),
    );
    assert_eq!(error_of(&gap), (ErrorCode::OutOfSequence, 4));
    let next = durable_answer(
        &mut broker,
        &conn,
        &mut log,
        produce(32, "d", 11, 4, 0, batch(4)),
    );
    assert_eq!(ack_of(&next)[0].first_offset, 8);
}

#[test]
fn a_batch_refused_by_a_full_disk_is_not_remembered_across_a_restart() {
    // Proves the journal's rollback record: a producer batch whose write failed (ENOSPC) is
    // refused, its offsets go to the next publish, and after a restart the producer's retry of
    // that sequence is stored, not answered with the offsets someone else's records took.
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut broker, conn, mut log, fault, entry) = durable_broker(dir.path(), false);
    let pump = |broker: &mut Broker, log: &mut DurableLog<FaultBackend>| {
        let now = broker.now();
        broker.cores[0].pump_log(log, now).expect("pumped");
    };
    // Batch 1 stored.
    assert_eq!(
        broker.feed(
            0,
            conn.requests,
            produce(1, "d", 4, 1, 0, vec![record("k", "one")])
        ),
        Flow::Continue
    );
    pump(&mut broker, &mut log);
    assert!(fault.complete_next());
    pump(&mut broker, &mut log);
    assert_eq!(ack_of(&broker.read(0, conn.requests)[0])[0].first_offset, 0);
    // Batch 2: its round fails with ENOSPC.
    fault.fail_next_write(libc::ENOSPC, 0);
    assert_eq!(
        broker.feed(
            0,
            conn.requests,
            produce(2, "d", 4, 2, 0, vec![record("k", "two")])
        ),
        Flow::Continue
    );
    pump(&mut broker, &mut log);
    assert!(fault.complete_next());
    pump(&mut broker, &mut log);
    let frames = broker.read(0, conn.requests);
    assert_eq!(error_of(&frames[0]).0, ErrorCode::StorageFull, "{frames:?}");
    // Its offset goes to a plain publish.
    let plain = support::publish(3, AckMode::Acked, "d", vec![record("k", "plain")]);
    assert_eq!(broker.feed(0, conn.requests, plain), Flow::Continue);
    for _ in 0..4 {
        pump(&mut broker, &mut log);
        fault.complete_next();
    }
    pump(&mut broker, &mut log);
    let frames = broker.read(0, conn.requests);
    assert_eq!(ack_of(&frames[0])[0].first_offset, 1, "{frames:?}");
    while fault.complete_next() {
        pump(&mut broker, &mut log);
    }
    drop(log);
    drop(broker);
    let (mut broker, conn, mut log) = reopened(dir.path(), &entry);
    let retry = durable_answer(
        &mut broker,
        &conn,
        &mut log,
        produce(4, "d", 4, 2, 0, vec![record("k", "two")]),
    );
    assert_eq!(
        ack_of(&retry)[0].first_offset,
        2,
        "stored, not a false duplicate"
    );
}

#[test]
fn a_batch_cut_by_a_full_disk_between_two_rounds_is_not_remembered_across_a_restart() {
    // Proves the journal's rollback record where it matters: a producer batch larger than a
    // write round has its journal record and first records written by one round and the rest
    // refused by the next (ENOSPC); its offsets then go to a plain publish. After a restart,
    // the producer's retry of that batch is stored again at new offsets, not answered with the
    // offsets the plain publish's records took (the journal record alone would vouch for them).
    let dir = tempfile::tempdir().expect("temp dir");
    let mut broker = Broker::new(1, ingress());
    let (backend, fault) = FaultBackend::new(false).expect("fault backend");
    let mut config = settings().log_config(dir.path(), 0);
    config.max_round_bytes = 4096;
    config.max_pending_bytes = 4096;
    let mut log = DurableLog::open(0, config, backend).expect("log");
    let conn = broker.connect(0);
    let create = Frame::CreateStream(felix_wire::CreateStream {
        request_id: 1,
        name: "d".to_owned(),
        shard_count: 1,
        kind: StreamKind::Durable,
    });
    assert_eq!(broker.feed(0, conn.requests, create), Flow::Blocked);
    let write = broker.cores[0].poll_catalog_write().expect("catalogue");
    let felix_core::CatalogChange::Add(entry) = write.change.clone() else {
        panic!("{write:?}");
    };
    let now = broker.now();
    broker.cores[0].handle_catalog_written(now, write.id, Ok(()));
    assert_eq!(broker.read(0, conn.requests).len(), 1, "StreamInfo");
    let pump = |broker: &mut Broker, log: &mut DurableLog<FaultBackend>| {
        let now = broker.now();
        broker.cores[0].pump_log(log, now).expect("pumped");
    };
    let settle = |broker: &mut Broker, log: &mut DurableLog<FaultBackend>| {
        for _ in 0..64 {
            pump(broker, log);
            if !fault.complete_next() {
                break;
            }
        }
        pump(broker, log);
        broker.read(0, conn.requests)
    };
    let big = "x".repeat(1000);
    let batch_two: Vec<Record> = (0..8).map(|i| record("k", &format!("{i}{big}"))).collect();
    // Batch 1, stored.
    assert_eq!(
        broker.feed(
            0,
            conn.requests,
            produce(2, "d", 4, 1, 0, vec![record("k", "one")]),
        ),
        Flow::Continue
    );
    let frames = settle(&mut broker, &mut log);
    assert_eq!(ack_of(&frames[0])[0].first_offset, 0);
    // Batch 2: the first round (its journal record, its first records) is written, the next
    // one fails with ENOSPC.
    assert_eq!(
        broker.feed(
            0,
            conn.requests,
            produce(3, "d", 4, 2, 0, batch_two.clone()),
        ),
        Flow::Continue
    );
    pump(&mut broker, &mut log);
    assert!(fault.complete_next(), "the first round");
    fault.fail_next_write(libc::ENOSPC, 0);
    let frames = settle(&mut broker, &mut log);
    assert_eq!(error_of(&frames[0]).0, ErrorCode::StorageFull, "{frames:?}");
    let cut = next_offset(&mut broker, &conn, "d", 0);
    assert!(
        cut > 1 && cut < 9,
        "batch 2 was cut inside: next offset {cut}"
    );
    // Its offsets go to a plain publish reaching past where batch 2 would have ended.
    let plain: Vec<Record> = (0..10)
        .map(|i| record("k", &format!("plain {i}")))
        .collect();
    assert_eq!(
        broker.feed(
            0,
            conn.requests,
            support::publish(4, AckMode::Acked, "d", plain),
        ),
        Flow::Continue
    );
    let frames = settle(&mut broker, &mut log);
    assert_eq!(ack_of(&frames[0])[0].first_offset, cut, "{frames:?}");
    drop(log);
    drop(broker);
    let (mut broker, conn, mut log) = reopened(dir.path(), &entry);
    let retry = durable_answer(
        &mut broker,
        &conn,
        &mut log,
        produce(5, "d", 4, 2, 0, batch_two),
    );
    assert_eq!(
        ack_of(&retry)[0],
        ShardAck {
            shard: 0,
            first_offset: cut + 10,
            count: 8
        },
        "stored again, not a false duplicate"
    );
}
