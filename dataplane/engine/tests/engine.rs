//! Behaviour of the shard engine through its public API (docs/semantics.md, 2 Data model,
//! 3 Publishing, 4 Subscribing; in-memory streams). Deterministic: time is a number the test passes in.

use bytes::Bytes;
use felix_engine::{
    ERROR_MESSAGE_BYTES_MAX, Engine, EngineConfig, EngineCounters, EngineError, EngineEvent,
    StreamDescription, SubscriptionId, select_shards,
};
use felix_wire::{
    DeliveredRecord, ErrorCode, HashKind, Record, ShardAck, ShardSelection, StartPosition,
    StreamKind, shard_for_key,
};

const NOW_US: u64 = 1_700_000_000_000_000;

fn config(ring_max_records: usize, ring_max_bytes: u64, queue_max_bytes: u64) -> EngineConfig {
    EngineConfig {
        ring_max_records,
        ring_max_bytes,
        subscriber_queue_max_bytes: queue_max_bytes,
        ..EngineConfig::default()
    }
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

/// Publishes one record with `payload` to `shard`, returning its offset.
fn publish_to(engine: &mut Engine, stream: &str, shard: u32, payload: &[u8]) -> u64 {
    let shard_count = engine.shard_count(stream).expect("stream exists");
    let key = key_for_shard(shard, shard_count, 0);
    let acks = engine
        .publish(NOW_US, stream, vec![record(&key, payload)])
        .expect("publish succeeds");
    assert_eq!(acks.len(), 1);
    assert_eq!(acks[0].shard, shard);
    acks[0].first_offset
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

fn events(engine: &mut Engine) -> Vec<EngineEvent> {
    std::iter::from_fn(|| engine.poll_event()).collect()
}

fn offsets_of(records: &[DeliveredRecord], shard: u32) -> Vec<u64> {
    records
        .iter()
        .filter(|r| r.shard == shard)
        .map(|r| r.offset)
        .collect()
}

fn list(shards: &[u32]) -> ShardSelection {
    ShardSelection::List(shards.to_vec())
}

fn code(result: Result<impl std::fmt::Debug, EngineError>) -> ErrorCode {
    result.expect_err("the call is refused").code
}

#[test]
fn create_stream_checks_name_shard_count_kind_and_existence() {
    // Proves the documented name rules, shard-count bounds, durable refusal and StreamExists.
    let mut engine = Engine::new(EngineConfig {
        max_shards: 8,
        max_name_bytes: 10,
        ..EngineConfig::default()
    });
    let created = engine
        .create_stream("a.B_9-z", 3, StreamKind::InMemory)
        .expect("valid stream");
    assert_eq!(created.name, "a.B_9-z");
    assert_eq!(created.kind, StreamKind::InMemory);
    assert_eq!(created.hash, HashKind::Fnv1a64Mod);
    assert_eq!(created.shards.len(), 3);
    for (index, shard) in created.shards.iter().enumerate() {
        assert_eq!(shard.shard as usize, index);
        assert_eq!((shard.oldest_offset, shard.next_offset), (0, 0));
    }
    for bad in ["", "has space", "slash/", "é", "elevenbytes"] {
        let error = engine
            .create_stream(bad, 1, StreamKind::InMemory)
            .expect_err("bad name");
        assert_eq!(error.code, ErrorCode::InvalidArgument, "{bad:?}");
        assert!(
            error.message.contains("[A-Za-z0-9._-]"),
            "{}",
            error.message
        );
    }
    assert!(
        engine
            .create_stream("tenbytes10", 8, StreamKind::InMemory)
            .is_ok()
    );
    let none = engine
        .create_stream("s", 0, StreamKind::InMemory)
        .expect_err("no shards");
    assert_eq!(none.code, ErrorCode::InvalidArgument);
    assert!(
        none.message.contains("at least 1 shard"),
        "{}",
        none.message
    );
    let over = engine
        .create_stream("s", 9, StreamKind::InMemory)
        .expect_err("too many shards");
    assert_eq!((over.code, over.detail), (ErrorCode::LimitExceeded, 8));
    assert!(
        over.message.contains("limit of 8 shards"),
        "{}",
        over.message
    );
    let durable = engine
        .create_stream("d", 1, StreamKind::Durable)
        .expect_err("durable refused");
    assert_eq!(durable.code, ErrorCode::InvalidArgument);
    assert_eq!(
        durable.message,
        "durable streams are not available in this build yet"
    );
    assert_eq!(
        code(engine.create_stream("a.B_9-z", 3, StreamKind::InMemory)),
        ErrorCode::StreamExists
    );
    assert_eq!(
        engine.list_streams(),
        vec![
            ("a.B_9-z".to_owned(), StreamKind::InMemory, 3),
            ("tenbytes10".to_owned(), StreamKind::InMemory, 8),
        ]
    );
    engine.assert_invariants();
}

#[test]
fn unknown_streams_are_not_found() {
    // Proves every stream-addressed call answers StreamNotFound for a missing stream.
    let mut engine = Engine::new(EngineConfig::default());
    assert_eq!(code(engine.describe_stream("x")), ErrorCode::StreamNotFound);
    assert_eq!(code(engine.delete_stream("x")), ErrorCode::StreamNotFound);
    assert_eq!(
        code(engine.publish(NOW_US, "x", vec![record(b"k", b"v")])),
        ErrorCode::StreamNotFound
    );
    let error = engine
        .subscribe("x", &ShardSelection::All, &StartPosition::Latest)
        .expect_err("no stream");
    assert_eq!(error.code, ErrorCode::StreamNotFound);
    assert_eq!(error.message, "stream \"x\" does not exist");
    assert!(engine.list_streams().is_empty());
}

#[test]
fn list_streams_is_sorted_by_name() {
    // Proves list_streams returns every stream sorted by name whatever the creation order.
    let mut engine = Engine::new(EngineConfig::default());
    for name in ["m", "b", "z", "a"] {
        engine
            .create_stream(name, 2, StreamKind::InMemory)
            .expect("create");
    }
    let names: Vec<String> = engine.list_streams().into_iter().map(|s| s.0).collect();
    assert_eq!(names, ["a", "b", "m", "z"]);
}

#[test]
fn publish_gives_dense_offsets_in_batch_order_and_acks_by_ascending_shard() {
    // Proves offsets are dense per shard from 0, in batch order, acked once per shard touched.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 4, StreamKind::InMemory)
        .expect("create");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    // Batch: shard 3, shard 1, shard 3, shard 1, shard 3 (batch order interleaves shards).
    let batch: Vec<Record> = [(3, 0), (1, 0), (3, 1), (1, 1), (3, 2)]
        .iter()
        .map(|&(shard, n)| {
            record(
                &key_for_shard(shard, 4, n),
                format!("{shard}/{n}").as_bytes(),
            )
        })
        .collect();
    let acks = engine.publish(NOW_US, "s", batch.clone()).expect("publish");
    assert_eq!(
        acks,
        vec![
            ShardAck {
                shard: 1,
                first_offset: 0,
                count: 2
            },
            ShardAck {
                shard: 3,
                first_offset: 0,
                count: 3
            },
        ]
    );
    let acks = engine.publish(NOW_US + 1, "s", batch).expect("publish");
    assert_eq!(
        acks[0],
        ShardAck {
            shard: 1,
            first_offset: 2,
            count: 2
        }
    );
    assert_eq!(
        acks[1],
        ShardAck {
            shard: 3,
            first_offset: 3,
            count: 3
        }
    );

    let delivered = drain(&mut engine, id);
    assert_eq!(offsets_of(&delivered, 3), [0, 1, 2, 3, 4, 5]);
    assert_eq!(offsets_of(&delivered, 1), [0, 1, 2, 3]);
    let shard3: Vec<&[u8]> = delivered
        .iter()
        .filter(|r| r.shard == 3)
        .map(|r| &r.payload[..])
        .collect();
    assert_eq!(
        shard3,
        [&b"3/0"[..], b"3/1", b"3/2", b"3/0", b"3/1", b"3/2"]
    );
    assert!(delivered[..5].iter().all(|r| r.timestamp_us == NOW_US));
    assert!(delivered[5..].iter().all(|r| r.timestamp_us == NOW_US + 1));
    let counters = engine.counters();
    assert_eq!(counters.records_appended, 10);
    assert_eq!(counters.payload_bytes_appended, 30);
    assert_eq!(counters.records_delivered, 10);
    assert_eq!(counters.subscriptions_active, 1);
    engine.assert_invariants();
}

#[test]
fn key_routing_is_the_documented_fnv1a_hash() {
    // Proves records land on shard_for_key(key, count), the function the client uses, and
    // on the documented FNV-1a value computed independently for a few keys.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 48, StreamKind::InMemory)
        .expect("create");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    // fnv1a_64("a") = 0xaf63dc4c8601ec8c -> 28 of 48; "foobar" -> 24; "order-17" -> 46.
    for (key, shard) in [(&b"a"[..], 28), (b"foobar", 24), (b"order-17", 46)] {
        let acks = engine
            .publish(NOW_US, "s", vec![record(key, b"")])
            .expect("publish");
        assert_eq!(acks[0].shard, shard);
    }
    let keys: Vec<Vec<u8>> = (0u32..500).map(|i| i.to_le_bytes().repeat(4)).collect();
    let batch = keys.iter().map(|key| record(key, b"p")).collect();
    engine.publish(NOW_US, "s", batch).expect("publish");
    let delivered = drain(&mut engine, id);
    assert_eq!(delivered.len(), 503);
    for r in &delivered {
        assert_eq!(r.shard, shard_for_key(&r.key, 48));
    }
}

#[test]
fn refused_publish_changes_nothing() {
    // Proves an empty batch and an unknown stream are refused all-or-nothing.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("create");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    engine
        .publish(NOW_US, "s", vec![record(b"k", b"v")])
        .expect("publish");
    let _ = events(&mut engine);
    let before = (engine.describe_stream("s"), engine.counters());
    let error = engine.publish(NOW_US, "s", Vec::new()).expect_err("empty");
    assert_eq!(error.code, ErrorCode::InvalidArgument);
    assert_eq!(
        code(engine.publish(NOW_US, "t", vec![record(b"k", b"v")])),
        ErrorCode::StreamNotFound
    );
    assert_eq!((engine.describe_stream("s"), engine.counters()), before);
    assert!(events(&mut engine).is_empty());
    assert_eq!(drain(&mut engine, id).len(), 1);
    engine.assert_invariants();
}

#[test]
fn ring_evicts_oldest_first_by_count() {
    // Proves the ring keeps the newest ring_max_records records and Earliest starts there.
    let mut engine = Engine::new(config(4, 1 << 20, 1 << 20));
    engine
        .create_stream("s", 1, StreamKind::InMemory)
        .expect("create");
    for i in 0..10u8 {
        publish_to(&mut engine, "s", 0, &[i; 3]);
    }
    let shard = engine.describe_stream("s").expect("describe").shards[0];
    assert_eq!((shard.oldest_offset, shard.next_offset), (6, 10));
    assert_eq!((shard.ring_records, shard.ring_bytes), (4, 12));
    let sub = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Earliest)
        .expect("subscribe");
    assert_eq!(sub.start, vec![(0, 6)]);
    let delivered = drain(&mut engine, sub.id);
    assert_eq!(offsets_of(&delivered, 0), [6, 7, 8, 9]);
    assert_eq!(delivered[0].payload, Bytes::from_static(&[6; 3]));
    engine.assert_invariants();
}

#[test]
fn ring_evicts_oldest_first_by_bytes() {
    // Proves the byte bound evicts as many old records as needed to fit the newest.
    let mut engine = Engine::new(config(100, 10, 1 << 20));
    engine
        .create_stream("s", 1, StreamKind::InMemory)
        .expect("create");
    for len in [4usize, 4, 2] {
        publish_to(&mut engine, "s", 0, &vec![1; len]);
    }
    let shard = engine.describe_stream("s").expect("describe").shards[0];
    assert_eq!(
        (shard.oldest_offset, shard.ring_records, shard.ring_bytes),
        (0, 3, 10)
    );
    // 9 bytes: evicts offsets 0 and 1 (4 + 4), keeps 2 (2 bytes) -> 11 > 10, so evicts 2 too.
    publish_to(&mut engine, "s", 0, &[2; 9]);
    let shard = engine.describe_stream("s").expect("describe").shards[0];
    assert_eq!((shard.oldest_offset, shard.next_offset), (3, 4));
    assert_eq!((shard.ring_records, shard.ring_bytes), (1, 9));
    publish_to(&mut engine, "s", 0, &[3; 1]);
    let shard = engine.describe_stream("s").expect("describe").shards[0];
    assert_eq!(
        (shard.oldest_offset, shard.ring_records, shard.ring_bytes),
        (3, 2, 10)
    );
    engine.assert_invariants();
}

#[test]
fn oversized_record_empties_the_ring_but_gets_its_offset_and_is_delivered_live() {
    // Proves a record over ring_max_bytes is not kept (nor anything older) yet is delivered.
    let mut engine = Engine::new(config(100, 10, 1 << 20));
    engine
        .create_stream("s", 1, StreamKind::InMemory)
        .expect("create");
    publish_to(&mut engine, "s", 0, b"abc");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    assert_eq!(publish_to(&mut engine, "s", 0, &[7; 11]), 1);
    let shard = engine.describe_stream("s").expect("describe").shards[0];
    assert_eq!((shard.oldest_offset, shard.next_offset), (2, 2));
    assert_eq!((shard.ring_records, shard.ring_bytes), (0, 0));
    assert_eq!(publish_to(&mut engine, "s", 0, b"x"), 2);
    let delivered = drain(&mut engine, id);
    assert_eq!(offsets_of(&delivered, 0), [1, 2]);
    assert_eq!(delivered[0].payload.len(), 11);
    let error = engine
        .subscribe(
            "s",
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(0, 1)]),
        )
        .expect_err("offset 1 was never held");
    assert_eq!((error.code, error.detail), (ErrorCode::TooOld, 2));
    engine.assert_invariants();
}

#[test]
fn live_delivery_works_without_a_ring() {
    // Proves ring_max_records = 0 or ring_max_bytes = 0 disables replay but not live delivery.
    for cfg in [config(0, 1 << 20, 1 << 20), config(1024, 0, 1 << 20)] {
        let mut engine = Engine::new(cfg);
        engine
            .create_stream("s", 3, StreamKind::InMemory)
            .expect("create");
        let sub = engine
            .subscribe("s", &ShardSelection::All, &StartPosition::Earliest)
            .expect("subscribe");
        assert_eq!(sub.start, vec![(0, 0), (1, 0), (2, 0)]);
        let batch = (0..30u32).map(|i| record(&i.to_le_bytes(), b"")).collect();
        engine.publish(NOW_US, "s", batch).expect("publish");
        assert_eq!(drain(&mut engine, sub.id).len(), 30);
        for shard in engine.describe_stream("s").expect("describe").shards {
            assert_eq!(shard.oldest_offset, shard.next_offset);
            assert_eq!(shard.ring_records, 0);
        }
        let error = engine
            .subscribe("s", &list(&[0]), &StartPosition::Offsets(vec![(0, 0)]))
            .expect_err("nothing held");
        assert_eq!(error.code, ErrorCode::TooOld);
        engine.assert_invariants();
    }
}

#[test]
fn resume_inside_the_ring_catches_up_then_goes_live() {
    // Proves a start offset inside the ring replays from exactly there, then live records follow.
    let mut engine = Engine::new(config(8, 1 << 20, 1 << 20));
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("create");
    for i in 0..12u8 {
        publish_to(&mut engine, "s", 1, &[i]);
        publish_to(&mut engine, "s", 0, &[100 + i]);
    }
    let sub = engine
        .subscribe(
            "s",
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(1, 9)]),
        )
        .expect("subscribe");
    assert_eq!(sub.start, vec![(0, 12), (1, 9)]);
    assert_eq!(engine.queued_records(sub.id), Some(3));
    assert_eq!(events(&mut engine), [EngineEvent::DeliveryReady(sub.id)]);
    publish_to(&mut engine, "s", 1, &[12]);
    publish_to(&mut engine, "s", 0, &[112]);
    let delivered = drain(&mut engine, sub.id);
    assert_eq!(offsets_of(&delivered, 1), [9, 10, 11, 12]);
    assert_eq!(offsets_of(&delivered, 0), [12]);
    let payloads: Vec<u8> = delivered
        .iter()
        .filter(|r| r.shard == 1)
        .map(|r| r.payload[0])
        .collect();
    assert_eq!(payloads, [9, 10, 11, 12]);
    engine.assert_invariants();
}

#[test]
fn too_old_names_the_shard_and_carries_the_oldest_offset() {
    // Proves a position older than the ring is TooOld with detail = oldest offset held.
    let mut engine = Engine::new(config(5, 1 << 20, 1 << 20));
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("create");
    for i in 0..15u8 {
        publish_to(&mut engine, "s", 1, &[i]);
    }
    let error = engine
        .subscribe(
            "s",
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(1, 3)]),
        )
        .expect_err("too old");
    assert_eq!(error.code, ErrorCode::TooOld);
    assert_eq!(error.detail, 10);
    assert_eq!(
        error.message,
        "offset 3 of shard 1 is older than the oldest record still held (10)"
    );
    let frame = error.to_frame(42);
    assert_eq!(
        (frame.request_id, frame.code, frame.detail),
        (42, ErrorCode::TooOld, 10)
    );
    let ok = engine
        .subscribe(
            "s",
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(1, 10)]),
        )
        .expect("oldest held is fine");
    assert_eq!(drain(&mut engine, ok.id).len(), 5);
    assert_eq!(engine.counters().subscriptions_active, 1);
}

#[test]
fn offset_beyond_next_is_refused_and_next_is_accepted() {
    // Proves start offsets above next_offset are InvalidArgument and next_offset means "live".
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 1, StreamKind::InMemory)
        .expect("create");
    for i in 0..3u8 {
        publish_to(&mut engine, "s", 0, &[i]);
    }
    let error = engine
        .subscribe(
            "s",
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(0, 4)]),
        )
        .expect_err("beyond next");
    assert_eq!(error.code, ErrorCode::InvalidArgument);
    assert!(
        error.message.contains("offset 4 of shard 0"),
        "{}",
        error.message
    );
    let sub = engine
        .subscribe(
            "s",
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(0, 3)]),
        )
        .expect("next offset");
    assert_eq!(sub.start, vec![(0, 3)]);
    assert_eq!(engine.queued_records(sub.id), Some(0));
    assert!(events(&mut engine).is_empty());
    assert_eq!(engine.counters().subscriptions_active, 1);
}

#[test]
fn latest_earliest_and_offsets_start_where_documented() {
    // Proves Latest starts at next_offset, Earliest at the oldest held, Offsets per shard with
    // unlisted selected shards at latest.
    let mut engine = Engine::new(config(3, 1 << 20, 1 << 20));
    engine
        .create_stream("s", 3, StreamKind::InMemory)
        .expect("create");
    for i in 0..5u8 {
        publish_to(&mut engine, "s", 0, &[i]);
        publish_to(&mut engine, "s", 2, &[i]);
    }
    publish_to(&mut engine, "s", 1, b"x");
    let latest = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("latest");
    assert_eq!(latest.start, vec![(0, 5), (1, 1), (2, 5)]);
    assert_eq!(engine.queued_records(latest.id), Some(0));
    let earliest = engine
        .subscribe("s", &list(&[2, 0]), &StartPosition::Earliest)
        .expect("earliest");
    assert_eq!(earliest.start, vec![(0, 2), (2, 2)]);
    let offsets = engine
        .subscribe(
            "s",
            &list(&[0, 1, 2]),
            &StartPosition::Offsets(vec![(2, 4)]),
        )
        .expect("offsets");
    assert_eq!(offsets.start, vec![(0, 5), (1, 1), (2, 4)]);
    let earliest_records = drain(&mut engine, earliest.id);
    assert_eq!(offsets_of(&earliest_records, 0), [2, 3, 4]);
    assert_eq!(offsets_of(&earliest_records, 2), [2, 3, 4]);
    assert_eq!(offsets_of(&earliest_records, 1), Vec::<u64>::new());
    assert_eq!(offsets_of(&drain(&mut engine, offsets.id), 2), [4]);

    publish_to(&mut engine, "s", 1, b"y");
    assert_eq!(offsets_of(&drain(&mut engine, latest.id), 1), [1]);
    assert_eq!(offsets_of(&drain(&mut engine, offsets.id), 1), [1]);
    assert!(
        drain(&mut engine, earliest.id).is_empty(),
        "shard 1 not selected"
    );
    engine.assert_invariants();
}

#[test]
fn bad_shard_selections_and_offsets_are_refused() {
    // Proves out-of-range, duplicate, empty and unselected shards are InvalidArgument.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 4, StreamKind::InMemory)
        .expect("create");
    let cases = [
        (list(&[4]), StartPosition::Latest),
        (list(&[]), StartPosition::Latest),
        (list(&[1, 2, 1]), StartPosition::Latest),
        (list(&[1]), StartPosition::Offsets(vec![(2, 0)])),
        (ShardSelection::All, StartPosition::Offsets(vec![(4, 0)])),
        (
            ShardSelection::All,
            StartPosition::Offsets(vec![(1, 0), (1, 0)]),
        ),
    ];
    for (selection, from) in cases {
        let error = engine
            .subscribe("s", &selection, &from)
            .expect_err("refused");
        assert_eq!(
            error.code,
            ErrorCode::InvalidArgument,
            "{selection:?} {from:?}"
        );
        assert!(!error.message.is_empty());
    }
    assert_eq!(engine.counters().subscriptions_active, 0);
    assert!(events(&mut engine).is_empty());
    engine.assert_invariants();
}

#[test]
fn per_shard_order_holds_across_many_batches_and_shards() {
    // Proves each subscriber sees every shard's records dense and in order over many batches.
    let mut engine = Engine::new(config(64, 1 << 20, u64::MAX));
    engine
        .create_stream("s", 48, StreamKind::InMemory)
        .expect("create");
    let all = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    let some = engine
        .subscribe("s", &list(&[0, 7, 47]), &StartPosition::Latest)
        .expect("subscribe")
        .id;
    let mut published = 0u32;
    let mut delivered_all = Vec::new();
    for batch_index in 0..200u32 {
        let size = 1 + (batch_index * 7) % 64;
        let batch = (0..size)
            .map(|i| {
                let n = published + i;
                record(&n.to_be_bytes(), &n.to_le_bytes())
            })
            .collect();
        published += size;
        engine.publish(NOW_US, "s", batch).expect("publish");
        if batch_index % 3 == 0 {
            delivered_all.extend(engine.poll_delivery(all, 100, usize::MAX));
        }
    }
    delivered_all.extend(drain(&mut engine, all));
    let delivered_some = drain(&mut engine, some);
    assert_eq!(delivered_all.len(), published as usize);
    let described = engine.describe_stream("s").expect("describe");
    for shard in 0..48u32 {
        let next = described.shards[shard as usize].next_offset;
        let expected: Vec<u64> = (0..next).collect();
        assert_eq!(offsets_of(&delivered_all, shard), expected, "shard {shard}");
        if [0, 7, 47].contains(&shard) {
            assert_eq!(
                offsets_of(&delivered_some, shard),
                expected,
                "shard {shard}"
            );
        } else {
            assert!(offsets_of(&delivered_some, shard).is_empty());
        }
    }
    // Within a shard, records keep publish order (the payload is the global sequence number).
    for shard in 0..48u32 {
        let seq: Vec<u32> = delivered_all
            .iter()
            .filter(|r| r.shard == shard)
            .map(|r| u32::from_le_bytes(r.payload[..].try_into().expect("4 bytes")))
            .collect();
        assert!(seq.windows(2).all(|w| w[0] < w[1]), "shard {shard}");
    }
    engine.assert_invariants();
}

#[test]
fn delivery_ready_is_emitted_once_per_empty_to_non_empty_transition() {
    // Proves DeliveryReady fires on each empty -> non-empty transition and not otherwise.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 1, StreamKind::InMemory)
        .expect("create");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    assert!(events(&mut engine).is_empty(), "nothing to catch up");
    publish_to(&mut engine, "s", 0, b"1");
    publish_to(&mut engine, "s", 0, b"2");
    assert_eq!(events(&mut engine), [EngineEvent::DeliveryReady(id)]);
    assert_eq!(engine.poll_delivery(id, 1, usize::MAX).len(), 1);
    publish_to(&mut engine, "s", 0, b"3");
    assert!(events(&mut engine).is_empty(), "queue was not empty");
    assert_eq!(drain(&mut engine, id).len(), 2);
    publish_to(&mut engine, "s", 0, b"4");
    assert_eq!(events(&mut engine), [EngineEvent::DeliveryReady(id)]);
}

#[test]
fn poll_delivery_honours_record_and_byte_limits_but_returns_at_least_one() {
    // Proves max_records and max_bytes bound a poll and a lone oversized record still comes out.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 1, StreamKind::InMemory)
        .expect("create");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    for len in [100usize, 10, 10, 10, 10] {
        publish_to(&mut engine, "s", 0, &vec![0; len]);
    }
    assert_eq!(engine.poll_delivery(id, 10, 0).len(), 1, "at least one");
    assert_eq!(engine.poll_delivery(id, 10, 25).len(), 2);
    assert_eq!(engine.poll_delivery(id, 0, usize::MAX).len(), 0);
    assert_eq!(engine.poll_delivery(id, 1, usize::MAX).len(), 1);
    assert_eq!(engine.poll_delivery(id, 10, usize::MAX).len(), 1);
    assert!(engine.poll_delivery(id, 10, usize::MAX).is_empty());
    assert!(
        engine
            .poll_delivery(SubscriptionId(999), 10, usize::MAX)
            .is_empty()
    );
    assert_eq!(engine.counters().records_delivered, 5);
}

#[test]
fn lagging_subscriber_is_ended_with_resume_positions() {
    // Proves a subscriber over subscriber_queue_max_bytes of live records is ended with
    // SubscriberLagged listing shard:next_offset resume positions, and its queue is freed.
    let mut engine = Engine::new(config(1024, 1 << 20, 10));
    engine
        .create_stream("s", 3, StreamKind::InMemory)
        .expect("create");
    for _ in 0..4 {
        publish_to(&mut engine, "s", 2, b"old");
    }
    let slow = engine
        .subscribe(
            "s",
            &list(&[0, 1, 2]),
            &StartPosition::Offsets(vec![(2, 1)]),
        )
        .expect("subscribe")
        .id;
    let fast = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    assert_eq!(
        engine.queued_records(slow),
        Some(3),
        "catch-up does not count as lag"
    );
    assert_eq!(engine.poll_delivery(slow, 1, usize::MAX)[0].offset, 1);
    publish_to(&mut engine, "s", 0, &[0; 4]); // shard 0 offset 0: live 4 bytes
    publish_to(&mut engine, "s", 1, &[0; 4]); // shard 1 offset 0: live 8 bytes
    let _ = drain(&mut engine, fast);
    let _ = events(&mut engine);
    // 8 + 4 > 10: this record (shard 1 offset 1) ends `slow`; `fast` keeps up.
    publish_to(&mut engine, "s", 1, &[0; 4]);
    let ended = events(&mut engine);
    assert_eq!(ended.len(), 2, "{ended:?}");
    let EngineEvent::SubscriptionEnded(id, error) = &ended[0] else {
        panic!("expected SubscriptionEnded first, got {ended:?}");
    };
    assert_eq!(*id, slow);
    assert_eq!((error.code, error.detail), (ErrorCode::SubscriberLagged, 0));
    // Shard 0 resumes at its queued offset 0, shard 1 at queued offset 0, shard 2 at the
    // first catch-up record not yet taken (2).
    assert!(
        error
            .message
            .ends_with("resume from shard:next_offset 0:0 1:0 2:2"),
        "{}",
        error.message
    );
    assert_eq!(ended[1], EngineEvent::DeliveryReady(fast));
    assert_eq!(engine.queued_records(slow), None);
    assert!(engine.poll_delivery(slow, 10, usize::MAX).is_empty());
    assert_eq!(engine.counters().subscriptions_active, 1);
    // The fast subscriber got everything, and publishing goes on.
    publish_to(&mut engine, "s", 1, b"z");
    assert_eq!(offsets_of(&drain(&mut engine, fast), 1), [1, 2]);
    // Resuming from the listed positions works and replays exactly what was lost.
    let resumed = engine
        .subscribe(
            "s",
            &ShardSelection::All,
            &StartPosition::Offsets(vec![(0, 0), (1, 0), (2, 2)]),
        )
        .expect("resume");
    let replay = drain(&mut engine, resumed.id);
    assert_eq!(offsets_of(&replay, 1), [0, 1, 2]);
    assert_eq!(offsets_of(&replay, 2), [2, 3]);
    engine.assert_invariants();
}

#[test]
fn resume_positions_use_next_offset_for_shards_with_nothing_queued() {
    // Proves a lagged subscriber's resume position is the shard's next offset when it has
    // taken everything of that shard, and the triggering record's offset for its shard.
    let mut engine = Engine::new(config(1024, 1 << 20, 5));
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("create");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    publish_to(&mut engine, "s", 0, b"a");
    let _ = drain(&mut engine, id);
    publish_to(&mut engine, "s", 1, &[0; 6]);
    // A lone live record above the bound is taken (the live queue was empty); the next ends it.
    assert_eq!(engine.queued_records(id), Some(1));
    publish_to(&mut engine, "s", 1, b"b");
    let ended = events(&mut engine);
    let Some(EngineEvent::SubscriptionEnded(_, error)) = ended.last() else {
        panic!("expected SubscriptionEnded, got {ended:?}");
    };
    assert!(
        error.message.ends_with("shard:next_offset 0:1 1:0"),
        "{}",
        error.message
    );
}

#[test]
fn lag_message_fits_an_error_frame() {
    // Proves the resume list of a many-shard subscription is cut to fit ERROR_MESSAGE_BYTES_MAX.
    let mut engine = Engine::new(config(0, 0, 0));
    engine
        .create_stream("s", 4096, StreamKind::InMemory)
        .expect("create");
    let id = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    let batch = (0..2u32)
        .map(|i| record(&key_for_shard(5, 4096, i as usize), b"x"))
        .collect();
    engine.publish(NOW_US, "s", batch).expect("publish");
    let ended = events(&mut engine);
    let Some(EngineEvent::SubscriptionEnded(ended_id, error)) = ended.last() else {
        panic!("expected SubscriptionEnded, got {ended:?}");
    };
    assert_eq!(*ended_id, id);
    assert!(error.message.len() <= ERROR_MESSAGE_BYTES_MAX);
    assert!(error.message.contains(" 0:0 1:0 "), "{}", error.message);
    assert!(error.message.ends_with(" ..."), "{}", error.message);
    engine.assert_invariants();
}

#[test]
fn deleting_a_stream_ends_its_subscriptions() {
    // Proves delete_stream ends each of the stream's subscriptions with StreamNotFound, and
    // leaves other streams' subscriptions alone.
    let mut engine = Engine::new(EngineConfig::default());
    for name in ["a", "b"] {
        engine
            .create_stream(name, 2, StreamKind::InMemory)
            .expect("create");
    }
    let a1 = engine
        .subscribe("a", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    let b1 = engine
        .subscribe("b", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    let a2 = engine
        .subscribe("a", &list(&[1]), &StartPosition::Latest)
        .expect("subscribe")
        .id;
    publish_to(&mut engine, "a", 1, b"queued");
    let _ = events(&mut engine);
    engine.delete_stream("a").expect("delete");
    let ended = events(&mut engine);
    assert_eq!(ended.len(), 2);
    for (event, expected) in ended.iter().zip([a1, a2]) {
        let EngineEvent::SubscriptionEnded(id, error) = event else {
            panic!("expected SubscriptionEnded, got {event:?}");
        };
        assert_eq!(*id, expected);
        assert_eq!(error.code, ErrorCode::StreamNotFound);
        assert_eq!(error.message, "stream \"a\" was deleted");
    }
    assert!(engine.poll_delivery(a2, 10, usize::MAX).is_empty());
    assert_eq!(engine.counters().subscriptions_active, 1);
    assert_eq!(code(engine.describe_stream("a")), ErrorCode::StreamNotFound);
    // A stream of the same name starts afresh.
    engine
        .create_stream("a", 1, StreamKind::InMemory)
        .expect("recreate");
    assert_eq!(publish_to(&mut engine, "a", 0, b"x"), 0);
    publish_to(&mut engine, "b", 0, b"y");
    assert_eq!(drain(&mut engine, b1).len(), 1);
    engine.assert_invariants();
}

#[test]
fn unsubscribe_stops_delivery_and_ignores_unknown_ids() {
    // Proves unsubscribe forgets a subscription (no event), ids are never reused, and unknown
    // ids are ignored.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("create");
    let first = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    publish_to(&mut engine, "s", 0, b"x");
    engine.unsubscribe(first);
    engine.unsubscribe(first);
    engine.unsubscribe(SubscriptionId(12345));
    assert_eq!(engine.counters().subscriptions_active, 0);
    assert_eq!(engine.queued_records(first), None);
    let second = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
        .expect("subscribe")
        .id;
    assert_ne!(first, second);
    publish_to(&mut engine, "s", 1, b"y");
    assert!(engine.poll_delivery(first, 10, usize::MAX).is_empty());
    assert_eq!(drain(&mut engine, second).len(), 1);
    engine.assert_invariants();
}

/// The shards `shard_for_key` gives each record of `records` on a `shard_count` stream.
fn routes(records: &[Record], shard_count: u32) -> Vec<u32> {
    records
        .iter()
        .map(|record| shard_for_key(&record.key, shard_count))
        .collect()
}

/// What [`observed`] returns: the stream's description, the counters and the stream list.
type Observed = (
    Result<StreamDescription, EngineError>,
    EngineCounters,
    Vec<(String, StreamKind, u32)>,
);

/// Everything a test can observe of `stream` on `engine` without draining anything.
fn observed(engine: &Engine, stream: &str) -> Observed {
    (
        engine.describe_stream(stream),
        engine.counters(),
        engine.list_streams(),
    )
}

#[test]
fn lookup_gives_kind_shard_count_and_a_handle_per_stream() {
    // Proves lookup answers None for an unknown name, and for a stream its kind, its shard
    // count and the same handle every time, distinct from another stream's.
    let mut engine = Engine::new(EngineConfig::default());
    assert_eq!(engine.lookup("s"), None);
    engine
        .create_stream("s", 5, StreamKind::InMemory)
        .expect("create");
    engine
        .create_stream("t", 2, StreamKind::InMemory)
        .expect("create");
    let meta = engine.lookup("s").expect("exists");
    assert_eq!((meta.kind, meta.shard_count), (StreamKind::InMemory, 5));
    assert_eq!(engine.lookup("s"), Some(meta));
    let other = engine.lookup("t").expect("exists");
    assert_eq!(other.shard_count, 2);
    assert_ne!(other.handle, meta.handle);
}

#[test]
fn publish_routed_matches_publish_in_memory() {
    // Proves publish_routed with shard_for_key's shards gives the same acks, offsets,
    // deliveries, ring contents and counters as publish for the same batches.
    let shard_count = 6;
    let mut by_name = Engine::new(config(16, 1 << 20, 1 << 20));
    let mut by_handle = Engine::new(config(16, 1 << 20, 1 << 20));
    let mut subs = Vec::new();
    for engine in [&mut by_name, &mut by_handle] {
        engine
            .create_stream("s", shard_count, StreamKind::InMemory)
            .expect("create");
        subs.push(
            engine
                .subscribe("s", &ShardSelection::All, &StartPosition::Latest)
                .expect("subscribe")
                .id,
        );
    }
    let meta = by_handle.lookup("s").expect("exists");
    for batch_index in 0..20u32 {
        let batch: Vec<Record> = (0..1 + batch_index % 9)
            .map(|i| {
                record(
                    format!("k{}", batch_index * 31 + i).as_bytes(),
                    &batch_index.to_le_bytes(),
                )
            })
            .collect();
        let now = NOW_US + u64::from(batch_index);
        let expected = by_name.publish(now, "s", batch.clone()).expect("publish");
        let shards = routes(&batch, meta.shard_count);
        let got = by_handle
            .publish_routed(now, meta.handle, batch, &shards, None)
            .expect("publish_routed");
        assert_eq!(got, expected, "batch {batch_index}");
    }
    assert_eq!(events(&mut by_handle), events(&mut by_name));
    assert_eq!(drain(&mut by_handle, subs[1]), drain(&mut by_name, subs[0]));
    assert_eq!(observed(&by_handle, "s"), observed(&by_name, "s"));
    by_handle.assert_invariants();
}

#[test]
fn stale_handles_are_not_found_and_change_nothing() {
    // Proves a handle whose stream was deleted answers StreamNotFound, changing nothing,
    // whether its slot is empty, holds a re-created stream of the same name, or another
    // stream; and that the new stream's own handle works.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("create");
    engine
        .create_stream("other", 2, StreamKind::InMemory)
        .expect("create");
    let stale = engine.lookup("s").expect("exists").handle;
    let batch = vec![record(b"k", b"v")];
    let shards = routes(&batch, 2);
    engine
        .publish_routed(NOW_US, stale, batch.clone(), &shards, None)
        .expect("the handle is live");
    engine.delete_stream("s").expect("delete");

    let refuse = |engine: &mut Engine| {
        let before = (observed(engine, "s"), observed(engine, "other"));
        let error = engine
            .publish_routed(NOW_US, stale, batch.clone(), &shards, None)
            .expect_err("stale");
        assert_eq!((error.code, error.detail), (ErrorCode::StreamNotFound, 0));
        assert!(error.message.contains("is stale"), "{}", error.message);
        assert_eq!((observed(engine, "s"), observed(engine, "other")), before);
        assert!(events(engine).is_empty());
        engine.assert_invariants();
    };
    // The slot is empty.
    refuse(&mut engine);
    // The slot holds a stream of the same name, created afresh.
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("recreate");
    let fresh = engine.lookup("s").expect("exists").handle;
    assert_ne!(fresh, stale);
    refuse(&mut engine);
    assert_eq!(
        engine.describe_stream("s").expect("describe").shards[shards[0] as usize].next_offset,
        0,
        "the new stream took nothing"
    );
    // The slot holds another stream.
    engine.delete_stream("s").expect("delete");
    engine
        .create_stream("third", 2, StreamKind::InMemory)
        .expect("create");
    refuse(&mut engine);
    let third = engine.lookup("third").expect("exists").handle;
    let acks = engine
        .publish_routed(NOW_US, third, batch, &shards, None)
        .expect("a live handle");
    assert_eq!(acks[0].first_offset, 0);
    engine.assert_invariants();
}

#[test]
fn publish_routed_panics_on_a_caller_defect_before_any_change() {
    // Proves a shard list of the wrong length, or a shard past the shard count, panics with
    // a message naming the defect, and leaves the engine as it was.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 3, StreamKind::InMemory)
        .expect("create");
    let handle = engine.lookup("s").expect("exists").handle;
    let batch = vec![record(b"a", b"1"), record(b"b", b"2")];
    let cases: [(&[u32], &str); 2] = [
        (&[0], "one shard per record"),
        (&[0, 3], "record 1 is routed to shard 3"),
    ];
    for (shards, expected) in cases {
        let before = observed(&engine, "s");
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine.publish_routed(NOW_US, handle, batch.clone(), shards, None)
        }))
        .expect_err("a caller defect panics");
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        assert!(message.contains(expected), "{message}");
        assert_eq!(observed(&engine, "s"), before);
        engine.assert_invariants();
    }
}

#[test]
fn select_shards_gives_each_error_and_the_sorted_selection() {
    // Proves select_shards answers each selection error with its code and message, exactly
    // as subscribe does, and otherwise the selected shards ascending, offsets unchecked.
    let mut engine = Engine::new(EngineConfig::default());
    engine
        .create_stream("s", 4, StreamKind::InMemory)
        .expect("create");
    let offsets = |positions: &[(u32, u64)]| StartPosition::Offsets(positions.to_vec());
    let cases = [
        (
            list(&[]),
            StartPosition::Latest,
            "a subscription selects at least one shard",
        ),
        (
            list(&[0, 4]),
            StartPosition::Latest,
            "shard 4 is out of range: the stream has 4 shards",
        ),
        (
            list(&[1, 2, 1]),
            StartPosition::Earliest,
            "shard 1 is selected more than once",
        ),
        (
            list(&[1]),
            offsets(&[(2, 0)]),
            "shard 2 has a start offset but is not selected",
        ),
        (
            list(&[1]),
            offsets(&[(9, 0)]),
            "shard 9 is out of range: the stream has 4 shards",
        ),
        (
            ShardSelection::All,
            offsets(&[(4, 0)]),
            "shard 4 is out of range: the stream has 4 shards",
        ),
        (
            ShardSelection::All,
            offsets(&[(1, 0), (1, 0)]),
            "shard 1 has more than one start offset",
        ),
    ];
    for (selection, from, message) in cases {
        let error = select_shards(&selection, &from, 4).expect_err("refused");
        assert_eq!(
            (error.code, error.detail, error.message.as_str()),
            (ErrorCode::InvalidArgument, 0, message),
            "{selection:?} {from:?}"
        );
        let refused = engine
            .subscribe("s", &selection, &from)
            .expect_err("subscribe refuses the same");
        assert_eq!(refused, error, "{selection:?} {from:?}");
    }
    assert_eq!(
        *select_shards(&ShardSelection::All, &StartPosition::Latest, 4).expect("all"),
        [0, 1, 2, 3]
    );
    assert_eq!(
        *select_shards(&list(&[3, 0, 2]), &offsets(&[(2, 99), (0, 0)]), 4).expect("list"),
        [0, 2, 3],
        "sorted; offsets are not checked here"
    );
    assert_eq!(engine.counters().subscriptions_active, 0);
    assert!(events(&mut engine).is_empty());
}

#[test]
fn check_create_gives_the_create_errors_and_changes_nothing() {
    // Proves check_create answers each bad in-memory create (name, shard count, name taken)
    // and a durable one on an engine without durable streams with exactly create's error,
    // Ok for a good one, and creates nothing either way.
    let mut engine = Engine::new(EngineConfig {
        max_shards: 8,
        max_name_bytes: 10,
        ..EngineConfig::default()
    });
    engine
        .create_stream("taken", 1, StreamKind::InMemory)
        .expect("create");
    let cases = [
        ("", 1, StreamKind::InMemory),
        ("has space", 1, StreamKind::InMemory),
        ("elevenbytes", 1, StreamKind::InMemory),
        ("s", 0, StreamKind::InMemory),
        ("s", 9, StreamKind::InMemory),
        ("taken", 2, StreamKind::InMemory),
    ];
    for (name, shard_count, kind) in cases {
        let before = engine.list_streams();
        let checked = engine
            .check_create(name, shard_count, kind)
            .expect_err("refused");
        assert_eq!(engine.list_streams(), before, "nothing created");
        let created = engine
            .create_stream(name, shard_count, kind)
            .expect_err("create refuses the same");
        assert_eq!(checked, created, "{name:?} {shard_count}");
    }
    let checked = engine
        .check_create("d", 1, StreamKind::Durable)
        .expect_err("durable not enabled");
    assert_eq!(
        Err(checked),
        engine.create_durable_stream("d", 1, 1).map(|_| ())
    );
    assert_eq!(
        engine.check_create("tenbytes10", 8, StreamKind::InMemory),
        Ok(())
    );
    assert_eq!(
        engine.lookup("tenbytes10"),
        None,
        "checking creates nothing"
    );
    engine
        .create_stream("tenbytes10", 8, StreamKind::InMemory)
        .expect("what was checked succeeds");
    engine.assert_invariants();
}

/// A publish to `stream` of `records` as the broker hands it over: encoded, then decoded, so
/// every key and payload is a slice of the frame. Returns the records and the frame's length.
fn decoded_publish(stream: &str, records: Vec<Record>) -> (Vec<Record>, u64) {
    let frame = felix_wire::Frame::Publish(felix_wire::Publish {
        request_id: 1,
        ack: felix_wire::AckMode::Acked,
        stream: stream.to_owned(),
        records,
    });
    let mut wire = bytes::BytesMut::new();
    felix_wire::encode(&frame, &mut wire);
    let frame_len = wire.len();
    let decoded = felix_wire::Decoder::new(felix_wire::Limits::DEFAULT)
        .decode(&mut wire)
        .expect("valid")
        .expect("whole");
    let felix_wire::Frame::Publish(publish) = decoded else {
        panic!("a publish decodes as a publish");
    };
    let key_payload: usize = publish
        .records
        .iter()
        .map(|r| r.key.len() + r.payload.len())
        .sum();
    assert_eq!(
        felix_wire::encoded_publish_len(stream, publish.records.len(), key_payload),
        frame_len
    );
    (publish.records, frame_len as u64)
}

/// Index of the frame (by the address range of its records' payloads) `payload` is a slice of.
fn frame_of(frames: &[(usize, usize)], payload: &Bytes) -> Option<usize> {
    let at = payload.as_ptr() as usize;
    frames
        .iter()
        .position(|&(start, end)| start <= at && at + payload.len() <= end)
}

#[test]
fn ring_bytes_count_the_frames_their_records_keep_alive() {
    // Proves a shard's ring charges each frame its records are slices of once, by the frame's
    // length: with 8 shards and 64-record frames the rings' counted bytes stay within their
    // bound and equal the lengths of the distinct frames their records keep alive (payload
    // counting would have counted 1/8 of that and kept far more frames alive).
    const SHARDS: u32 = 8;
    const RING_BYTES: u64 = 300_000;
    let mut engine = Engine::new(config(1024, RING_BYTES, 1 << 30));
    engine
        .create_stream("s", SHARDS, StreamKind::InMemory)
        .expect("create");
    let meta = engine.lookup("s").expect("stream");
    let mut frames = Vec::new();
    let mut alive = Vec::new();
    let mut lens = Vec::new();
    let mut frame_len = 0;
    for batch in 0..20usize {
        let records: Vec<Record> = (0..64usize)
            .map(|i| {
                let key = key_for_shard((i % SHARDS as usize) as u32, SHARDS, batch * 64 + i);
                record(&key, &vec![(batch % 251) as u8; 1_000])
            })
            .collect();
        let (records, len) = decoded_publish("s", records);
        frame_len = len;
        let start = records.iter().map(|r| r.payload.as_ptr() as usize).min();
        let end = records
            .iter()
            .map(|r| r.payload.as_ptr() as usize + r.payload.len())
            .max();
        frames.push((start.expect("records"), end.expect("records")));
        // Kept alive by the test, so no later frame reuses its addresses.
        alive.push(records.clone());
        lens.push(len);
        let shards: Vec<u32> = records
            .iter()
            .map(|r| shard_for_key(&r.key, SHARDS))
            .collect();
        engine
            .publish_routed_from(
                NOW_US,
                meta.handle,
                records,
                &shards,
                None,
                felix_engine::RecordBuffers::Shared { len },
            )
            .expect("publish");
        engine.assert_invariants();
    }
    // 66 KB frames, 8 records of 1 KB per shard each: a ring of 300,000 bytes holds 4 frames.
    assert!(frame_len > 60_000 && frame_len * 4 <= RING_BYTES && frame_len * 5 > RING_BYTES);
    for shard in engine.describe_stream("s").expect("describe").shards {
        assert!(shard.ring_bytes <= RING_BYTES);
        let sub = engine
            .subscribe(
                "s",
                &ShardSelection::List(vec![shard.shard]),
                &StartPosition::Earliest,
            )
            .expect("subscribe");
        let replayed = drain(&mut engine, sub.id);
        assert_eq!(replayed.len(), shard.ring_records);
        let mut held: Vec<usize> = replayed
            .iter()
            .map(|r| frame_of(&frames, &r.payload).expect("a slice of its frame, uncopied"))
            .collect();
        held.dedup();
        assert_eq!(held, vec![16, 17, 18, 19], "the newest frames, each once");
        assert_eq!(
            shard.ring_bytes,
            held.iter().map(|&frame| lens[frame]).sum::<u64>()
        );
        engine.unsubscribe(sub.id);
    }
    engine.assert_invariants();
}

#[test]
fn a_thin_share_of_a_big_frame_is_copied_and_charged_its_own_size() {
    // Proves a shard whose records are under 1/RING_COPY_RATIO of their frame keeps a copy of
    // them (charged its payload length), while the shard with the frame's bulk keeps slices
    // of the frame (charged the frame once).
    let mut engine = Engine::new(config(1024, 1 << 20, 1 << 30));
    engine
        .create_stream("s", 2, StreamKind::InMemory)
        .expect("create");
    let meta = engine.lookup("s").expect("stream");
    let mut records: Vec<Record> = (0..8)
        .map(|i| record(&key_for_shard(0, 2, i), &[1; 10_000]))
        .collect();
    records.push(record(&key_for_shard(1, 2, 0), &[2; 16]));
    let (records, len) = decoded_publish("s", records);
    let frame = (
        records[0].payload.as_ptr() as usize,
        records[7].payload.as_ptr() as usize + 10_000,
    );
    let shards: Vec<u32> = records.iter().map(|r| shard_for_key(&r.key, 2)).collect();
    engine
        .publish_routed_from(
            NOW_US,
            meta.handle,
            records,
            &shards,
            None,
            felix_engine::RecordBuffers::Shared { len },
        )
        .expect("publish");
    let described = engine.describe_stream("s").expect("describe");
    assert_eq!(
        (
            described.shards[0].ring_records,
            described.shards[0].ring_bytes
        ),
        (8, len)
    );
    assert_eq!(
        (
            described.shards[1].ring_records,
            described.shards[1].ring_bytes
        ),
        (1, 16)
    );
    let sub = engine
        .subscribe("s", &ShardSelection::All, &StartPosition::Earliest)
        .expect("subscribe");
    for delivered in drain(&mut engine, sub.id) {
        let sliced = frame_of(&[frame], &delivered.payload).is_some();
        assert_eq!(
            sliced,
            delivered.shard == 0,
            "only the thin share is copied"
        );
        let expected: &[u8] = if delivered.shard == 0 {
            &[1; 10_000]
        } else {
            &[2; 16]
        };
        assert_eq!(&delivered.payload[..], expected);
    }
    engine.assert_invariants();
}
