//! Durable streams through the engine's public API (docs/semantics.md, 2 Data model,
//! 3 Publishing, 4 Subscribing): append requests,
//! release on durability, tracked publishes, disk-full rollback, catch-up from a simulated
//! log, retention and restore. The log is a `BTreeMap` the test fills from `poll_append` and
//! serves `LogRead`s from, as the broker does with `felix_storage::Log`. Deterministic.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use felix_engine::{
    AppendRequest, CATCH_UP_REFILL_RECORDS, Engine, EngineConfig, EngineEvent,
    LOG_READ_RECORDS_MAX, LogRead, LogRecord, LogShardId, PublishCompletion, PublishToken,
    SubscriptionId,
};
use felix_wire::{
    DeliveredRecord, ErrorCode, Record, ShardSelection, StartPosition, StreamKind, shard_for_key,
};

const NOW_US: u64 = 1_700_000_000_000_000;
const STREAM: &str = "orders";
const STREAM_ID: u32 = 7;

/// The per-core log as the engine sees it: appended records, and per log shard the offset
/// below which records are committed (readable) and the oldest retained one.
#[derive(Default)]
struct SimLog {
    records: BTreeMap<(LogShardId, u64), LogRecord>,
    next: HashMap<LogShardId, u64>,
    committed: HashMap<LogShardId, u64>,
    oldest: HashMap<LogShardId, u64>,
}

impl SimLog {
    /// Moves every queued append request into the log, checking dense offsets.
    fn drain_appends(&mut self, engine: &mut Engine) -> Vec<(LogShardId, u64)> {
        let mut appended = Vec::new();
        while let Some(request) = engine.poll_append() {
            let next = self.next.entry(request.log_shard).or_default();
            assert_eq!(request.offset, *next, "appends are dense per log shard");
            *next += 1;
            appended.push((request.log_shard, request.offset));
            self.records.insert(
                (request.log_shard, request.offset),
                LogRecord {
                    offset: request.offset,
                    timestamp_us: request.timestamp_us,
                    key: request.key,
                    payload: request.payload,
                },
            );
        }
        appended
    }

    /// Commits `log_shard` through `end` and tells the engine.
    fn commit(&mut self, engine: &mut Engine, log_shard: LogShardId, end: u64) {
        assert!(end <= self.next.get(&log_shard).copied().unwrap_or(0));
        self.committed.insert(log_shard, end);
        engine.handle_durable(log_shard, end);
    }

    /// Commits everything appended.
    fn commit_all(&mut self, engine: &mut Engine) {
        self.drain_appends(engine);
        let shards: Vec<(LogShardId, u64)> = self.next.iter().map(|(&k, &v)| (k, v)).collect();
        for (log_shard, end) in shards {
            self.commit(engine, log_shard, end);
        }
    }

    /// Rolls `log_shard` back to `from` (disk full) and tells the engine.
    fn reject(&mut self, engine: &mut Engine, log_shard: LogShardId, from: u64) {
        self.records
            .retain(|&(shard, offset), _| shard != log_shard || offset < from);
        self.next.insert(log_shard, from);
        engine.handle_rejected(log_shard, from);
    }

    /// What `Log::read` returns: committed records from `from`, at most `max_records`;
    /// `Err(oldest)` below the oldest retained offset.
    fn read(&self, read: &LogRead) -> Result<Vec<LogRecord>, u64> {
        let oldest = self.oldest.get(&read.log_shard).copied().unwrap_or(0);
        if read.from_offset < oldest {
            return Err(oldest);
        }
        let end = self.committed.get(&read.log_shard).copied().unwrap_or(0);
        Ok(self
            .records
            .range((read.log_shard, read.from_offset)..(read.log_shard, end.max(read.from_offset)))
            .take(read.max_records)
            .map(|(_, record)| record.clone())
            .collect())
    }

    /// Serves one pending log read; returns whether there was one.
    fn serve_one(&self, engine: &mut Engine) -> bool {
        let Some(read) = engine.poll_log_read() else {
            return false;
        };
        assert!(read.max_records > 0);
        match self.read(&read) {
            Ok(records) => engine.handle_log_records(read.subscription, read.log_shard, records),
            Err(oldest) => {
                engine.handle_log_read_too_old(read.subscription, read.log_shard, oldest)
            }
        }
        true
    }

    fn serve_all(&self, engine: &mut Engine) {
        while self.serve_one(engine) {}
    }
}

fn durable_engine(ring_max_records: usize) -> Engine {
    let mut engine = Engine::new(EngineConfig {
        ring_max_records,
        ..EngineConfig::default()
    });
    engine.enable_durable();
    engine
}

fn record(key: &[u8], payload: &[u8]) -> Record {
    Record {
        key: Bytes::copy_from_slice(key),
        payload: Bytes::copy_from_slice(payload),
    }
}

/// The `n`-th key (in a fixed sequence) that routes to `shard` of a `shard_count` stream.
fn key_for_shard(shard: u32, shard_count: u32, n: usize) -> Vec<u8> {
    (0u64..)
        .map(|i| format!("key-{i}").into_bytes())
        .filter(|key| shard_for_key(key, shard_count) == shard)
        .nth(n)
        .expect("the key sequence is unbounded")
}

/// `count` records for `shard` of a `shard_count` stream, payloads `p{first + i}`.
fn records_for(shard: u32, shard_count: u32, first: usize, count: usize) -> Vec<Record> {
    let key = key_for_shard(shard, shard_count, 0);
    (first..first + count)
        .map(|i| record(&key, format!("p{i}").as_bytes()))
        .collect()
}

fn ls(shard: u32) -> LogShardId {
    LogShardId::new(STREAM_ID, shard).expect("valid id")
}

fn drain(engine: &mut Engine, id: SubscriptionId) -> Vec<DeliveredRecord> {
    let mut all = Vec::new();
    loop {
        let batch = engine.poll_delivery(id, 7, 1 << 20);
        if batch.is_empty() {
            return all;
        }
        all.extend(batch);
    }
}

fn offsets(records: &[DeliveredRecord]) -> Vec<u64> {
    records.iter().map(|r| r.offset).collect()
}

fn completions(engine: &mut Engine) -> Vec<PublishCompletion> {
    std::iter::from_fn(|| engine.poll_completed_publish()).collect()
}

fn events(engine: &mut Engine) -> Vec<EngineEvent> {
    std::iter::from_fn(|| engine.poll_event()).collect()
}

fn subscribe(engine: &mut Engine, shards: &[u32], from: StartPosition) -> SubscriptionId {
    engine
        .subscribe(STREAM, &ShardSelection::List(shards.to_vec()), &from)
        .expect("subscribe")
        .id
}

/// Commits everything appended to `log`, shard by shard in ascending order (`commit_all`
/// walks a `HashMap`, whose order differs between two logs), so two engines fed the same
/// appends release records in the same order.
fn commit_in_shard_order(log: &mut SimLog, engine: &mut Engine, shard_count: u32) {
    for shard in 0..shard_count {
        let end = log.next.get(&ls(shard)).copied().unwrap_or(0);
        log.commit(engine, ls(shard), end);
    }
}

#[test]
fn log_shard_ids_pack_stream_id_and_shard() {
    // Proves log shard ids are (stream_id << 12) | shard and refuse out-of-range parts.
    let id = LogShardId::new(5, 4095).expect("valid");
    assert_eq!(id.0, (5 << 12) | 4095);
    assert_eq!((id.stream_id(), id.shard()), (5, 4095));
    assert_eq!(LogShardId::new(5, 4096), None);
    assert_eq!(LogShardId::new(1 << 20, 0), None);
    assert!(LogShardId::new((1 << 20) - 1, 0).is_some());
}

#[test]
fn durable_creation_rules() {
    // Proves durable streams need enable_durable, a free in-range catalogue id and a shard
    // count within the log shard bits, and that create_stream still refuses them.
    let mut engine = Engine::new(EngineConfig {
        max_shards: 10_000,
        ..EngineConfig::default()
    });
    let refused = engine
        .create_durable_stream(STREAM, 2, STREAM_ID)
        .expect_err("not enabled");
    assert_eq!(refused.code, ErrorCode::InvalidArgument);
    assert_eq!(
        refused.message,
        "durable streams are not available in this build yet"
    );
    engine.enable_durable();
    assert!(engine.durable_enabled());
    let code = |result: Result<_, felix_engine::EngineError>| result.expect_err("refused").code;
    assert_eq!(
        code(engine.create_stream(STREAM, 2, StreamKind::Durable)),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(engine.create_durable_stream(STREAM, 4097, STREAM_ID)),
        ErrorCode::LimitExceeded
    );
    assert_eq!(
        code(engine.create_durable_stream(STREAM, 2, 1 << 20)),
        ErrorCode::InvalidArgument
    );
    let description = engine
        .create_durable_stream(STREAM, 4096, STREAM_ID)
        .expect("create");
    assert_eq!(description.kind, StreamKind::Durable);
    assert_eq!(
        code(engine.create_durable_stream("other", 1, STREAM_ID)),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(engine.create_durable_stream(STREAM, 1, STREAM_ID + 1)),
        ErrorCode::StreamExists
    );
    assert_eq!(
        code(engine.restore_durable_stream("r", 2, 9, &[(0, 1)])),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(engine.restore_durable_stream("r", 1, 9, &[(2, 1)])),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        engine.log_shard(STREAM, 4095),
        LogShardId::new(STREAM_ID, 4095)
    );
    assert_eq!(engine.log_shard(STREAM, 4096), None);
    engine.assert_invariants();
}

#[test]
fn durable_publish_queues_appends_and_delivers_nothing_before_durable() {
    // Proves a durable publish gets dense offsets and acks as in memory, yields append
    // requests in batch order with the right log shard ids, and reaches no subscriber and no
    // ring until handle_durable.
    let mut engine = durable_engine(1024);
    engine
        .create_durable_stream(STREAM, 4, STREAM_ID)
        .expect("create");
    let sub = engine
        .subscribe(STREAM, &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    let batch: Vec<Record> = (0..12)
        .map(|i| record(format!("k{i}").as_bytes(), format!("v{i}").as_bytes()))
        .collect();
    let acks = engine
        .publish(NOW_US, STREAM, batch.clone())
        .expect("publish");
    let mut expected_next: HashMap<u32, u64> = HashMap::new();
    for input in &batch {
        let shard = shard_for_key(&input.key, 4);
        let request = engine.poll_append().expect("one request per record");
        let next = expected_next.entry(shard).or_default();
        assert_eq!(request.log_shard, ls(shard));
        assert_eq!(request.log_shard.0, (STREAM_ID << 12) | shard);
        assert_eq!(request.offset, *next);
        assert_eq!(request.timestamp_us, NOW_US);
        assert_eq!(
            (&request.key, &request.payload),
            (&input.key, &input.payload)
        );
        *next += 1;
    }
    assert_eq!(engine.poll_append(), None);
    let acked: u32 = acks.iter().map(|ack| ack.count).sum();
    assert_eq!(acked, 12);
    for ack in &acks {
        assert_eq!(ack.first_offset, 0);
        assert_eq!(u64::from(ack.count), expected_next[&ack.shard]);
    }
    assert!(events(&mut engine).is_empty(), "nothing is ready");
    assert!(drain(&mut engine, sub).is_empty());
    let described = engine.describe_stream(STREAM).expect("describe");
    for state in &described.shards {
        assert_eq!(state.ring_records, 0, "the ring holds durable records only");
        assert_eq!(
            state.next_offset,
            expected_next.get(&state.shard).copied().unwrap_or(0)
        );
        assert_eq!(engine.durable_through(STREAM, state.shard), Some(0));
    }
    let counters = engine.durable_counters();
    assert_eq!(counters.records_pending, 12);
    assert_eq!(counters.records_appended, 12);
    assert_eq!(counters.records_durable, 0);
    assert_eq!(engine.counters().records_appended, 12);
    engine.assert_invariants();
}

#[test]
fn handle_durable_releases_in_order_to_subscribers_and_ring() {
    // Proves handle_durable releases exactly the covered records, in order, to live
    // subscribers and the ring, is idempotent, and that Earliest then starts in the log.
    let mut engine = durable_engine(1024);
    engine
        .create_durable_stream(STREAM, 2, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    let sub = subscribe(&mut engine, &[0], StartPosition::Latest);
    engine
        .publish(NOW_US, STREAM, records_for(0, 2, 0, 5))
        .expect("publish");
    log.drain_appends(&mut engine);
    log.commit(&mut engine, ls(0), 3);
    assert_eq!(events(&mut engine), vec![EngineEvent::DeliveryReady(sub)]);
    let got = drain(&mut engine, sub);
    assert_eq!(offsets(&got), vec![0, 1, 2]);
    assert_eq!(got[2].payload, Bytes::from_static(b"p2"));
    assert_eq!(engine.durable_through(STREAM, 0), Some(3));
    let state = engine.describe_stream(STREAM).expect("describe").shards[0];
    assert_eq!((state.ring_records, state.next_offset), (3, 5));
    log.commit(&mut engine, ls(0), 2);
    assert!(drain(&mut engine, sub).is_empty(), "idempotent");
    log.commit(&mut engine, ls(0), 5);
    assert_eq!(offsets(&drain(&mut engine, sub)), vec![3, 4]);
    // A late subscriber from Earliest gets the ring (the log holds the same records).
    let late = subscribe(&mut engine, &[0], StartPosition::Earliest);
    assert_eq!(offsets(&drain(&mut engine, late)), vec![0, 1, 2, 3, 4]);
    let counters = engine.durable_counters();
    assert_eq!((counters.records_pending, counters.records_durable), (0, 5));
    engine.assert_invariants();
}

#[test]
fn tracked_publish_completes_once_every_shard_range_is_durable() {
    // Proves a tracked publish completes only when all its shard ranges are durable, in the
    // order ranges become durable, and that an in-memory tracked publish completes at once.
    let mut engine = durable_engine(1024);
    engine
        .create_durable_stream(STREAM, 2, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    let mut batch = records_for(0, 2, 0, 2);
    batch.extend(records_for(1, 2, 0, 3));
    engine
        .publish_tracked(NOW_US, STREAM, batch, PublishToken(1))
        .expect("publish");
    engine
        .publish_tracked(NOW_US, STREAM, records_for(0, 2, 2, 2), PublishToken(2))
        .expect("publish");
    assert_eq!(engine.tracked_publishes(), 2);
    log.drain_appends(&mut engine);
    log.commit(&mut engine, ls(0), 4);
    // Token 2 is wholly on shard 0; token 1 waits for shard 1.
    assert_eq!(
        completions(&mut engine),
        vec![PublishCompletion {
            token: PublishToken(2),
            result: Ok(())
        }]
    );
    log.commit(&mut engine, ls(1), 2);
    assert!(
        completions(&mut engine).is_empty(),
        "shard 1 is durable through 2 of 3"
    );
    log.commit(&mut engine, ls(1), 3);
    assert_eq!(
        completions(&mut engine),
        vec![PublishCompletion {
            token: PublishToken(1),
            result: Ok(())
        }]
    );
    assert_eq!(engine.tracked_publishes(), 0);
    engine
        .create_stream("mem", 1, StreamKind::InMemory)
        .expect("create");
    engine
        .publish_tracked(NOW_US, "mem", vec![record(b"k", b"v")], PublishToken(3))
        .expect("publish");
    assert_eq!(completions(&mut engine).len(), 1);
    engine.assert_invariants();
}

#[test]
fn disk_full_rolls_offsets_back_and_fails_tracked_publishes() {
    // Proves handle_rejected rolls the shard's next offset back, drops pending records and
    // their queued appends, fails every tracked publish with a record past the rollback
    // (StorageFull) and keeps those below, and that offsets are reused afterwards.
    let mut engine = durable_engine(1024);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    let sub = subscribe(&mut engine, &[0], StartPosition::Latest);
    for (token, first) in [(1u64, 0usize), (2, 2), (3, 4)] {
        engine
            .publish_tracked(
                NOW_US,
                STREAM,
                records_for(0, 1, first, 2),
                PublishToken(token),
            )
            .expect("publish");
    }
    log.drain_appends(&mut engine);
    // A publish whose appends the shell has not drained yet.
    engine
        .publish_tracked(NOW_US, STREAM, records_for(0, 1, 6, 1), PublishToken(4))
        .expect("publish");
    log.commit(&mut engine, ls(0), 2);
    assert_eq!(completions(&mut engine).len(), 1, "token 1 is durable");
    // The log wrote 2..3 and rejected the rest from 3 (the storage crate's rule: next goes
    // back to the written offset).
    log.reject(&mut engine, ls(0), 3);
    let failed: Vec<PublishToken> = completions(&mut engine)
        .into_iter()
        .map(|completion| {
            let error = completion.result.expect_err("failed");
            assert_eq!(error.code, ErrorCode::StorageFull);
            completion.token
        })
        .collect();
    assert_eq!(failed.len(), 3);
    for token in [2, 3, 4] {
        assert!(failed.contains(&PublishToken(token)));
    }
    assert_eq!(
        engine.poll_append(),
        None,
        "the undrained append was dropped"
    );
    let state = engine.describe_stream(STREAM).expect("describe").shards[0];
    assert_eq!(state.next_offset, 3);
    let counters = engine.durable_counters();
    assert_eq!(
        (counters.records_pending, counters.records_rolled_back),
        (1, 4)
    );
    // Offset 2 is still pending and becomes durable; the next publish reuses offset 3.
    let acks = engine
        .publish_tracked(NOW_US, STREAM, records_for(0, 1, 10, 1), PublishToken(5))
        .expect("publish");
    assert_eq!(acks[0].first_offset, 3);
    assert_eq!(log.drain_appends(&mut engine), vec![(ls(0), 3)]);
    log.commit(&mut engine, ls(0), 4);
    assert_eq!(completions(&mut engine).len(), 1);
    let got = drain(&mut engine, sub);
    assert_eq!(offsets(&got), vec![0, 1, 2, 3]);
    assert_eq!(
        got[3].payload,
        Bytes::from_static(b"p10"),
        "the new record at 3"
    );
    // A rejection at or past next changes nothing.
    engine.handle_rejected(ls(0), 4);
    assert_eq!(
        engine.describe_stream(STREAM).expect("d").shards[0].next_offset,
        4
    );
    engine.assert_invariants();
}

#[test]
fn catch_up_from_the_log_switches_to_ring_then_live() {
    // Proves a start older than the ring is read from the log, then the ring, then live,
    // with no gap and no duplicate.
    let mut engine = durable_engine(4);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 0, 20))
        .expect("publish");
    log.commit_all(&mut engine);
    assert_eq!(
        engine.describe_stream(STREAM).expect("d").shards[0].oldest_offset,
        0
    );
    let subscription = engine
        .subscribe(
            STREAM,
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(0, 2)]),
        )
        .expect("subscribe");
    assert_eq!(subscription.start, vec![(0, 2)]);
    let read = engine.poll_log_read().expect("a log read");
    assert_eq!(read.log_shard, ls(0));
    assert_eq!(read.from_offset, 2);
    assert_eq!(read.max_records, 14, "up to the ring's oldest (16)");
    assert!(drain(&mut engine, subscription.id).is_empty());
    let records = log.read(&read).expect("readable");
    engine.handle_log_records(read.subscription, read.log_shard, records);
    assert_eq!(engine.poll_log_read(), None, "the ring covers the rest");
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 20, 3))
        .expect("publish");
    log.commit_all(&mut engine);
    let got = drain(&mut engine, subscription.id);
    assert_eq!(offsets(&got), (2..23).collect::<Vec<u64>>());
    for record in &got {
        assert_eq!(record.payload, Bytes::from(format!("p{}", record.offset)));
    }
    let counters = engine.durable_counters();
    assert_eq!((counters.log_reads, counters.log_records_read), (1, 14));
    engine.assert_invariants();
}

#[test]
fn catch_up_survives_ring_eviction_and_concurrent_durable_progress() {
    // Proves catch-up reaches live with no gap or duplicate when, between reads, new records
    // become durable, the ring evicts past the read position, and the log answers in short
    // reads or returns records not yet durable in the engine.
    let mut engine = durable_engine(3);
    engine
        .create_durable_stream(STREAM, 2, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    engine
        .publish(NOW_US, STREAM, records_for(0, 2, 0, 10))
        .expect("publish");
    log.commit_all(&mut engine);
    let sub = subscribe(&mut engine, &[0, 1], StartPosition::Earliest);
    let mut published = 10usize;
    let mut rounds = 0;
    while let Some(mut read) = engine.poll_log_read() {
        rounds += 1;
        assert!(rounds < 100, "catch-up converges");
        // Short reads: at most 2 records.
        read.max_records = read.max_records.min(2);
        let records = log.read(&read).expect("readable");
        // Meanwhile: more records, some durable (evicting the ring), some only appended,
        // and the log commits one more than the engine has been told.
        engine
            .publish(NOW_US, STREAM, records_for(0, 2, published, 3))
            .expect("publish");
        published += 3;
        log.drain_appends(&mut engine);
        let durable = published as u64 - 2;
        log.commit(&mut engine, ls(0), durable);
        log.committed.insert(ls(0), durable + 1);
        let records = if rounds == 3 {
            // A read served after the commit: it may reach past the engine's durable offset.
            log.read(&LogRead {
                max_records: 100,
                ..read
            })
            .expect("readable")
        } else {
            records
        };
        engine.handle_log_records(read.subscription, read.log_shard, records);
        // Deliver some, interleaved.
        let _ = engine.poll_delivery(sub, 1, 1 << 20);
    }
    log.commit_all(&mut engine);
    let mut got = Vec::new();
    // Everything delivered so far plus the rest, per shard 0 dense from 0.
    got.extend(drain(&mut engine, sub));
    let all_offsets: Vec<u64> = got.iter().map(|r| r.offset).collect();
    let last = *all_offsets.last().expect("records");
    assert_eq!(
        last,
        published as u64 - 1,
        "reached the newest durable record"
    );
    assert!(
        all_offsets.windows(2).all(|w| w[0] + 1 == w[1]),
        "dense after the interleaved polls: {all_offsets:?}"
    );
    assert!(rounds >= 3, "the catch-up needed several reads");
    engine.assert_invariants();
}

#[test]
fn catch_up_delivers_every_record_exactly_once_under_interleaving() {
    // Proves the union of everything polled during and after catch-up is each durable
    // record from the start exactly once, in order, when reads, publishes, durable progress
    // and polls interleave.
    let mut engine = durable_engine(2);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 0, 30))
        .expect("publish");
    log.commit_all(&mut engine);
    let sub = subscribe(&mut engine, &[0], StartPosition::Offsets(vec![(0, 1)]));
    let mut got = Vec::new();
    let mut published = 30usize;
    for step in 0..40 {
        if step % 3 == 0 {
            engine
                .publish(NOW_US, STREAM, records_for(0, 1, published, 2))
                .expect("publish");
            published += 2;
            log.commit_all(&mut engine);
        }
        if let Some(mut read) = engine.poll_log_read() {
            read.max_records = read.max_records.min(3);
            let records = log.read(&read).expect("readable");
            engine.handle_log_records(read.subscription, read.log_shard, records);
        }
        got.extend(engine.poll_delivery(sub, 2, 1 << 20));
    }
    log.serve_all(&mut engine);
    got.extend(drain(&mut engine, sub));
    assert_eq!(offsets(&got), (1..published as u64).collect::<Vec<u64>>());
    engine.assert_invariants();
}

#[test]
fn catch_up_reads_wait_for_the_queue_to_drain() {
    // Proves a catching-up subscription holds a bounded catch-up queue: the next log read is
    // parked while CATCH_UP_REFILL_RECORDS are queued and issued once polling drains them.
    let mut engine = durable_engine(0);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    let total = 3 * CATCH_UP_REFILL_RECORDS;
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 0, total))
        .expect("publish");
    log.commit_all(&mut engine);
    let sub = subscribe(&mut engine, &[0], StartPosition::Earliest);
    log.serve_all(&mut engine);
    let queued = engine.queued_records(sub).expect("live");
    assert_eq!(
        queued, CATCH_UP_REFILL_RECORDS,
        "reads stop at the refill mark"
    );
    assert_eq!(queued % LOG_READ_RECORDS_MAX, 0);
    assert!(engine.poll_log_read().is_none(), "the next read is parked");
    let mut got = offsets(&engine.poll_delivery(sub, 1, 1 << 20));
    let read = engine
        .poll_log_read()
        .expect("polling issues the parked read");
    assert_eq!(read.from_offset, CATCH_UP_REFILL_RECORDS as u64);
    let records = log.read(&read).expect("readable");
    engine.handle_log_records(read.subscription, read.log_shard, records);
    loop {
        log.serve_all(&mut engine);
        let batch = engine.poll_delivery(sub, 100, 1 << 30);
        if batch.is_empty() {
            break;
        }
        got.extend(offsets(&batch));
    }
    assert_eq!(got, (0..total as u64).collect::<Vec<u64>>());
    engine.assert_invariants();
}

#[test]
fn retention_moves_earliest_and_ends_catch_up_below_it() {
    // Proves Earliest is the log's oldest retained offset, positions below it are TooOld,
    // and a catch-up whose read hits deleted records ends with TooOld (detail = oldest).
    let mut engine = durable_engine(2);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 0, 10))
        .expect("publish");
    log.commit_all(&mut engine);
    let sub = subscribe(&mut engine, &[0], StartPosition::Offsets(vec![(0, 1)]));
    log.oldest.insert(ls(0), 5);
    engine.handle_retention(ls(0), 5);
    let state = engine.describe_stream(STREAM).expect("d").shards[0];
    assert_eq!(state.oldest_offset, 5);
    let error = engine
        .subscribe(
            STREAM,
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(0, 4)]),
        )
        .expect_err("too old");
    assert_eq!((error.code, error.detail), (ErrorCode::TooOld, 5));
    let earliest = engine
        .subscribe(STREAM, &ShardSelection::All, &StartPosition::Earliest)
        .expect("subscribe");
    assert_eq!(earliest.start, vec![(0, 5)]);
    log.serve_all(&mut engine);
    let ended: Vec<(SubscriptionId, ErrorCode, u64)> = events(&mut engine)
        .into_iter()
        .filter_map(|event| match event {
            EngineEvent::SubscriptionEnded(id, error) => Some((id, error.code, error.detail)),
            EngineEvent::DeliveryReady(_) => None,
        })
        .collect();
    assert_eq!(ended, vec![(sub, ErrorCode::TooOld, 5)]);
    assert_eq!(
        offsets(&drain(&mut engine, earliest.id)),
        (5..10).collect::<Vec<u64>>()
    );
    engine.assert_invariants();
}

#[test]
fn empty_read_below_the_ring_ends_the_subscription() {
    // Proves an empty log answer that would leave a gap before the ring ends the
    // subscription with StorageFailed instead of skipping records, and that stale answers
    // (no read outstanding) are ignored.
    let mut engine = durable_engine(2);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 0, 6))
        .expect("publish");
    log.commit_all(&mut engine);
    let sub = subscribe(&mut engine, &[0], StartPosition::Earliest);
    let read = engine.poll_log_read().expect("read");
    engine.handle_log_records(SubscriptionId(999), read.log_shard, Vec::new());
    engine.handle_log_records(read.subscription, ls(1), Vec::new());
    assert!(events(&mut engine).is_empty(), "stale answers are ignored");
    engine.handle_log_records(read.subscription, read.log_shard, Vec::new());
    match events(&mut engine).as_slice() {
        [EngineEvent::SubscriptionEnded(id, error)] => {
            assert_eq!(*id, sub);
            assert_eq!(error.code, ErrorCode::StorageFailed);
        }
        other => panic!("unexpected events {other:?}"),
    }
    engine.assert_invariants();
}

#[test]
fn start_past_the_durable_offset_waits_for_that_record() {
    // Proves a start between the durable and the next offset delivers from exactly that
    // record once it is durable, and Latest starts at the durable offset.
    let mut engine = durable_engine(8);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 0, 6))
        .expect("publish");
    log.drain_appends(&mut engine);
    log.commit(&mut engine, ls(0), 2);
    let waiting = engine
        .subscribe(
            STREAM,
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(0, 4)]),
        )
        .expect("subscribe");
    assert_eq!(waiting.start, vec![(0, 4)]);
    let latest = engine
        .subscribe(STREAM, &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe");
    assert_eq!(latest.start, vec![(0, 2)]);
    let beyond = engine.subscribe(
        STREAM,
        &ShardSelection::All,
        &StartPosition::Offsets(vec![(0, 7)]),
    );
    assert_eq!(
        beyond.expect_err("beyond next").code,
        ErrorCode::InvalidArgument
    );
    log.commit(&mut engine, ls(0), 4);
    assert!(drain(&mut engine, waiting.id).is_empty());
    log.commit(&mut engine, ls(0), 6);
    assert_eq!(offsets(&drain(&mut engine, waiting.id)), vec![4, 5]);
    assert_eq!(offsets(&drain(&mut engine, latest.id)), vec![2, 3, 4, 5]);
    engine.assert_invariants();
}

#[test]
fn restored_stream_reads_from_the_log() {
    // Proves a restored durable stream keeps its offsets, serves Earliest from the log and
    // appends after its last offset.
    let mut engine = durable_engine(16);
    let mut log = SimLog::default();
    for offset in 3..8u64 {
        log.records.insert(
            (ls(1), offset),
            LogRecord {
                offset,
                timestamp_us: NOW_US,
                key: Bytes::from_static(b"k"),
                payload: Bytes::from(format!("p{offset}")),
            },
        );
    }
    log.next.insert(ls(1), 8);
    log.committed.insert(ls(1), 8);
    log.oldest.insert(ls(1), 3);
    let description = engine
        .restore_durable_stream(STREAM, 2, STREAM_ID, &[(0, 0), (3, 8)])
        .expect("restore");
    assert_eq!(description.shards[1].oldest_offset, 3);
    assert_eq!(description.shards[1].next_offset, 8);
    assert_eq!(description.shards[1].ring_records, 0);
    assert_eq!(engine.durable_through(STREAM, 1), Some(8));
    let sub = engine
        .subscribe(STREAM, &ShardSelection::All, &StartPosition::Earliest)
        .expect("subscribe");
    assert_eq!(sub.start, vec![(0, 0), (1, 3)]);
    log.serve_all(&mut engine);
    let acks = engine
        .publish(NOW_US, STREAM, records_for(1, 2, 8, 1))
        .expect("publish");
    assert_eq!(acks[0].first_offset, 8);
    log.commit_all(&mut engine);
    let got = drain(&mut engine, sub.id);
    assert_eq!(offsets(&got), (3..9).collect::<Vec<u64>>());
    assert_eq!(got[0].payload, Bytes::from_static(b"p3"));
    engine.assert_invariants();
}

#[test]
fn deleting_a_durable_stream_fails_its_pending_publishes() {
    // Proves deleting a durable stream drops its pending records and queued appends, fails
    // tracked publishes with StreamNotFound, and makes later log events for it no-ops.
    let mut engine = durable_engine(16);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let mut log = SimLog::default();
    engine
        .publish_tracked(NOW_US, STREAM, records_for(0, 1, 0, 2), PublishToken(1))
        .expect("publish");
    log.drain_appends(&mut engine);
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 2, 2))
        .expect("publish");
    engine.delete_stream(STREAM).expect("delete");
    assert_eq!(engine.poll_append(), None);
    let done = completions(&mut engine);
    assert_eq!(done.len(), 1);
    assert_eq!(
        done[0].result.as_ref().expect_err("failed").code,
        ErrorCode::StreamNotFound
    );
    engine.handle_durable(ls(0), 2);
    engine.handle_rejected(ls(0), 0);
    engine.handle_retention(ls(0), 1);
    assert_eq!(engine.durable_counters().records_pending, 0);
    // The id is free again in this engine (the catalogue never reuses it; the engine allows it).
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID + 1)
        .expect("recreate");
    engine.assert_invariants();
}

#[test]
fn publish_routed_matches_publish_tracked_on_a_durable_stream() {
    // Proves publish_routed with a token and shard_for_key's shards gives the same acks,
    // append requests, completions, deliveries and counters as publish_tracked.
    let shard_count = 3;
    let mut by_name = durable_engine(1024);
    let mut by_handle = durable_engine(1024);
    let mut subs = Vec::new();
    for engine in [&mut by_name, &mut by_handle] {
        engine
            .create_durable_stream(STREAM, shard_count, STREAM_ID)
            .expect("create");
        subs.push(
            engine
                .subscribe(STREAM, &ShardSelection::All, &StartPosition::Latest)
                .expect("subscribe")
                .id,
        );
    }
    let meta = by_handle.lookup(STREAM).expect("exists");
    assert_eq!(
        (meta.kind, meta.shard_count),
        (StreamKind::Durable, shard_count)
    );
    let mut logs = [SimLog::default(), SimLog::default()];
    for token in 0..8u64 {
        let batch: Vec<Record> = (0..1 + token % 5)
            .map(|i| record(format!("k{token}-{i}").as_bytes(), b"v"))
            .collect();
        let shards: Vec<u32> = batch
            .iter()
            .map(|input| shard_for_key(&input.key, meta.shard_count))
            .collect();
        let expected = by_name
            .publish_tracked(NOW_US, STREAM, batch.clone(), PublishToken(token))
            .expect("publish");
        let got = by_handle
            .publish_routed(
                NOW_US,
                meta.handle,
                batch,
                &shards,
                Some(PublishToken(token)),
            )
            .expect("publish_routed");
        assert_eq!(got, expected, "token {token}");
        let appends = |engine: &mut Engine| -> Vec<AppendRequest> {
            std::iter::from_fn(|| engine.poll_append()).collect()
        };
        let requests = appends(&mut by_handle);
        assert_eq!(requests, appends(&mut by_name), "token {token}");
        // Replay the requests into both simulated logs (they were drained to compare them).
        for (log, engine) in logs.iter_mut().zip([&mut by_name, &mut by_handle]) {
            for request in &requests {
                *log.next.entry(request.log_shard).or_default() = request.offset + 1;
                log.records.insert(
                    (request.log_shard, request.offset),
                    LogRecord {
                        offset: request.offset,
                        timestamp_us: request.timestamp_us,
                        key: request.key.clone(),
                        payload: request.payload.clone(),
                    },
                );
            }
            if token % 3 == 2 {
                commit_in_shard_order(log, engine, shard_count);
            }
        }
    }
    for (log, engine) in logs.iter_mut().zip([&mut by_name, &mut by_handle]) {
        commit_in_shard_order(log, engine, shard_count);
    }
    assert_eq!(completions(&mut by_handle), completions(&mut by_name));
    assert_eq!(events(&mut by_handle), events(&mut by_name));
    assert_eq!(drain(&mut by_handle, subs[1]), drain(&mut by_name, subs[0]));
    assert_eq!(by_handle.durable_counters(), by_name.durable_counters());
    assert_eq!(by_handle.counters(), by_name.counters());
    assert_eq!(
        by_handle.describe_stream(STREAM),
        by_name.describe_stream(STREAM)
    );
    by_handle.assert_invariants();
}

#[test]
fn stale_durable_handle_after_re_create_is_not_found() {
    // Proves a durable stream's handle goes stale when the stream is deleted and re-created
    // under the same name: StreamNotFound, no append request, no tracked publish, nothing
    // completed.
    let mut engine = durable_engine(16);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    let stale = engine.lookup(STREAM).expect("exists").handle;
    engine.delete_stream(STREAM).expect("delete");
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID + 1)
        .expect("recreate");
    let error = engine
        .publish_routed(
            NOW_US,
            stale,
            vec![record(b"k", b"v")],
            &[0],
            Some(PublishToken(1)),
        )
        .expect_err("stale");
    assert_eq!(error.code, ErrorCode::StreamNotFound);
    assert_eq!(engine.poll_append(), None);
    assert_eq!(engine.tracked_publishes(), 0);
    assert!(completions(&mut engine).is_empty());
    assert_eq!(engine.durable_counters().records_appended, 0);
    assert_eq!(
        engine.describe_stream(STREAM).expect("d").shards[0].next_offset,
        0
    );
    engine.assert_invariants();
}

#[test]
fn check_create_gives_the_durable_create_errors_and_changes_nothing() {
    // Proves check_create of kind Durable answers each bad create (name, shard count over
    // min(max_shards, DURABLE_SHARDS_MAX), name taken) with create_durable_stream's error,
    // Ok for a good one, and creates nothing.
    let mut engine = Engine::new(EngineConfig {
        max_shards: 10_000,
        ..EngineConfig::default()
    });
    engine.enable_durable();
    engine
        .create_durable_stream("taken", 1, STREAM_ID)
        .expect("create");
    for (name, shard_count) in [
        ("", 1),
        ("bad/name", 1),
        ("s", 0),
        ("s", 4097),
        ("taken", 1),
    ] {
        let before = engine.list_streams();
        let checked = engine
            .check_create(name, shard_count, StreamKind::Durable)
            .expect_err("refused");
        assert_eq!(engine.list_streams(), before, "nothing created");
        let created = engine
            .create_durable_stream(name, shard_count, STREAM_ID + 1)
            .expect_err("create refuses the same");
        assert_eq!(checked, created, "{name:?} {shard_count}");
    }
    assert_eq!(engine.check_create("s", 4096, StreamKind::Durable), Ok(()));
    assert_eq!(engine.lookup("s"), None, "checking creates nothing");
    assert_eq!(engine.poll_append(), None);
    engine
        .create_durable_stream("s", 4096, STREAM_ID + 1)
        .expect("what was checked succeeds");
    engine.assert_invariants();
}

#[test]
fn has_log_work_follows_append_requests_and_log_reads() {
    // Proves has_log_work is false on a quiet engine, true after a durable publish until its
    // appends are drained, true after a subscribe starting below the ring until its reads
    // are served, and false once everything is drained.
    let mut engine = durable_engine(4);
    engine
        .create_durable_stream(STREAM, 1, STREAM_ID)
        .expect("create");
    engine
        .create_stream("mem", 1, StreamKind::InMemory)
        .expect("create");
    let mut log = SimLog::default();
    assert!(!engine.has_log_work());
    engine
        .publish(NOW_US, "mem", vec![record(b"k", b"v")])
        .expect("publish");
    assert!(!engine.has_log_work(), "an in-memory publish needs no log");
    engine
        .publish(NOW_US, STREAM, records_for(0, 1, 0, 10))
        .expect("publish");
    assert!(engine.has_log_work(), "append requests are queued");
    log.drain_appends(&mut engine);
    assert!(!engine.has_log_work(), "appends drained");
    log.commit_all(&mut engine);
    assert!(!engine.has_log_work(), "durable progress queues nothing");
    let sub = subscribe(&mut engine, &[0], StartPosition::Earliest);
    assert!(
        engine.has_log_work(),
        "a log read is queued below the ring (6)"
    );
    log.serve_all(&mut engine);
    assert!(!engine.has_log_work(), "reads served");
    assert_eq!(
        offsets(&drain(&mut engine, sub)),
        (0..10).collect::<Vec<u64>>()
    );
    assert!(!engine.has_log_work(), "everything drained");
    engine.assert_invariants();
}

#[test]
fn stream_limits_apply_to_creates_not_restores() {
    // Proves FELIX_MAX_STREAMS and FELIX_MAX_SHARDS_PER_STREAM refuse creates with
    // LimitExceeded (the limit in `detail`, the setting named), a shard count of 0 stays
    // InvalidArgument, and a restore after a restart is never refused by a lowered limit.
    let mut engine = Engine::new(EngineConfig {
        max_shards: 4,
        max_streams: 1,
        ..EngineConfig::default()
    });
    engine.enable_durable();
    let zero = engine
        .create_stream("zero", 0, StreamKind::InMemory)
        .expect_err("no shards");
    assert_eq!(zero.code, ErrorCode::InvalidArgument);
    let wide = engine
        .create_stream("wide", 5, StreamKind::InMemory)
        .expect_err("over the shard limit");
    assert_eq!((wide.code, wide.detail), (ErrorCode::LimitExceeded, 4));
    assert!(
        wide.message.contains("FELIX_MAX_SHARDS_PER_STREAM"),
        "{}",
        wide.message
    );
    engine
        .create_stream("first", 4, StreamKind::InMemory)
        .expect("within the limits");
    let second = engine
        .create_durable_stream("second", 1, STREAM_ID)
        .expect_err("over the stream limit");
    assert_eq!((second.code, second.detail), (ErrorCode::LimitExceeded, 1));
    assert!(
        second.message.contains("FELIX_MAX_STREAMS"),
        "{}",
        second.message
    );
    let restored = engine
        .restore_durable_stream("restored", 8, STREAM_ID, &[(0, 0); 8])
        .expect("a restore ignores the configured limits");
    assert_eq!(restored.shards.len(), 8);
}
