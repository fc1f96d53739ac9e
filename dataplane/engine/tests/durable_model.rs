//! Property test for durable streams: random interleavings of publishes (tracked), appends
//! drained to a simulated log, durable progress, disk-full rollbacks, retention, subscribes
//! from random positions, log reads (short or whole) and polls, checked against a plain
//! model. Deterministic: the generator's seed is fixed.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use felix_engine::{
    Engine, EngineConfig, EngineEvent, LogRecord, LogShardId, PublishToken, SubscriptionId,
};
use felix_wire::{ErrorCode, Record, ShardSelection, StartPosition, shard_for_key};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

const STREAM: &str = "durable";
const STREAM_ID: u32 = 3;
const SHARDS_MAX: u32 = 3;

#[derive(Debug, Clone)]
enum Op {
    /// `(key byte, payload length)` per record (never empty).
    Publish(Vec<(u8, usize)>),
    DrainAppends,
    /// Make up to `count` more appended records of `shard` durable.
    Durable {
        shard: u32,
        count: u64,
    },
    /// Disk full on `shard` from `durable + skip` (clamped to next).
    Reject {
        shard: u32,
        skip: u64,
    },
    /// Retention moves `shard`'s oldest forward by `count` (clamped to durable).
    Retain {
        shard: u32,
        count: u64,
    },
    Subscribe {
        shards: Vec<u32>,
        start: Start,
    },
    /// Serve up to `reads` log reads, each capped at `max_records`.
    ServeReads {
        reads: usize,
        max_records: usize,
    },
    Poll {
        subscription: usize,
        max_records: usize,
    },
}

#[derive(Debug, Clone)]
enum Start {
    Latest,
    Earliest,
    /// `(shard, offset)`, offset possibly invalid.
    Offset(u32, u64),
}

fn op() -> impl Strategy<Value = Op> {
    let shard = 0..SHARDS_MAX;
    prop_oneof![
        5 => prop::collection::vec((any::<u8>(), 0usize..10), 1..8).prop_map(Op::Publish),
        3 => Just(Op::DrainAppends),
        4 => (shard.clone(), 0u64..8).prop_map(|(shard, count)| Op::Durable { shard, count }),
        1 => (shard.clone(), 0u64..4).prop_map(|(shard, skip)| Op::Reject { shard, skip }),
        1 => (shard.clone(), 0u64..4).prop_map(|(shard, count)| Op::Retain { shard, count }),
        2 => (
            prop::collection::btree_set(shard.clone(), 1..=SHARDS_MAX as usize),
            prop_oneof![
                Just(Start::Latest),
                Just(Start::Earliest),
                (shard, 0u64..40).prop_map(|(s, o)| Start::Offset(s, o)),
            ],
        )
            .prop_map(|(shards, start)| Op::Subscribe {
                shards: shards.into_iter().collect(),
                start
            }),
        4 => (0usize..4, 1usize..5).prop_map(|(reads, max_records)| Op::ServeReads {
            reads,
            max_records
        }),
        4 => (0usize..6, 0usize..8).prop_map(|(subscription, max_records)| Op::Poll {
            subscription,
            max_records
        }),
    ]
}

#[derive(Debug, Clone, PartialEq)]
struct ModelRecord {
    key: Bytes,
    payload: Bytes,
    timestamp_us: u64,
}

#[derive(Debug, Default)]
struct ModelShard {
    /// Every record given an offset and not rolled back.
    records: Vec<ModelRecord>,
    /// Appended to the simulated log (drained from the engine).
    logged: u64,
    durable: u64,
    oldest: u64,
}

struct ModelSub {
    id: SubscriptionId,
    /// Start position per shard (may lie past the durable offset after a rollback).
    start: HashMap<u32, u64>,
    next: HashMap<u32, u64>,
    live: bool,
}

/// A tracked publish: its unresolved `(shard, end)` ranges and whether it failed.
struct ModelPublish {
    ranges: Vec<(u32, u64)>,
    failed: bool,
    reported: bool,
}

struct Model {
    config: EngineConfig,
    shards: Vec<ModelShard>,
    subs: Vec<ModelSub>,
    publishes: BTreeMap<u64, ModelPublish>,
    /// The simulated log: `(shard, offset) -> record`, as the engine appended it.
    log: BTreeMap<(u32, u64), LogRecord>,
}

impl Model {
    fn ring_oldest(&self, shard: u32) -> u64 {
        let state = &self.shards[shard as usize];
        let released = &state.records[..state.durable as usize];
        let mut kept = 0usize;
        let mut bytes = 0u64;
        if self.config.ring_max_records > 0 && self.config.ring_max_bytes > 0 {
            for record in released.iter().rev() {
                let len = record.payload.len() as u64;
                if kept + 1 > self.config.ring_max_records
                    || bytes + len > self.config.ring_max_bytes
                {
                    break;
                }
                kept += 1;
                bytes += len;
            }
        }
        state.durable - kept as u64
    }

    fn oldest(&self, shard: u32) -> u64 {
        self.shards[shard as usize]
            .oldest
            .min(self.ring_oldest(shard))
    }

    fn next(&self, shard: u32) -> u64 {
        self.shards[shard as usize].records.len() as u64
    }

    /// Resolves tracked ranges of `shard`: durable through `end` (ok) or rolled back from
    /// `from` (failed); returns the tokens whose outcome is now due, with `Ok` or failure.
    fn resolve(&mut self, shard: u32, durable_end: Option<u64>, rolled_from: Option<u64>) {
        for publish in self.publishes.values_mut() {
            publish.ranges.retain(|&(s, end)| {
                if s != shard {
                    return true;
                }
                if durable_end.is_some_and(|d| end <= d) {
                    return false;
                }
                if rolled_from.is_some_and(|from| end > from) {
                    publish.failed = true;
                    return false;
                }
                true
            });
        }
    }
}

fn ls(shard: u32) -> LogShardId {
    LogShardId::new(STREAM_ID, shard).expect("valid")
}

fn check_delivered(model: &mut Model, index: usize, taken: &[felix_wire::DeliveredRecord]) {
    let sub = &mut model.subs[index];
    for record in taken {
        let next = sub.next.get_mut(&record.shard).expect("a selected shard");
        assert_eq!(record.offset, *next, "dense, in per-shard order");
        let shard = &model.shards[record.shard as usize];
        assert!(record.offset < shard.durable, "never before durable");
        let expected = &shard.records[record.offset as usize];
        assert_eq!(record.key, expected.key);
        assert_eq!(record.payload, expected.payload);
        assert_eq!(record.timestamp_us, expected.timestamp_us);
        *next += 1;
    }
}

fn serve(engine: &mut Engine, model: &Model, reads: usize, max_records: usize) {
    for _ in 0..reads {
        let Some(read) = engine.poll_log_read() else {
            return;
        };
        let shard = read.log_shard.shard();
        let state = &model.shards[shard as usize];
        if read.from_offset < state.oldest {
            engine.handle_log_read_too_old(read.subscription, read.log_shard, state.oldest);
            continue;
        }
        let records: Vec<LogRecord> = model
            .log
            .range((shard, read.from_offset)..(shard, state.durable.max(read.from_offset)))
            .take(read.max_records.min(max_records))
            .map(|(_, record)| record.clone())
            .collect();
        engine.handle_log_records(read.subscription, read.log_shard, records);
    }
}

fn run(config: EngineConfig, shard_count: u32, ops: Vec<Op>) {
    let mut engine = Engine::new(config);
    engine.enable_durable();
    engine
        .create_durable_stream(STREAM, shard_count, STREAM_ID)
        .expect("create");
    let mut model = Model {
        config,
        shards: (0..shard_count).map(|_| ModelShard::default()).collect(),
        subs: Vec::new(),
        publishes: BTreeMap::new(),
        log: BTreeMap::new(),
    };
    let mut now_us = 1_000u64;
    let mut next_token = 0u64;
    for op in ops {
        now_us += 1;
        match op {
            Op::Publish(batch) => {
                let records: Vec<Record> = batch
                    .iter()
                    .map(|&(key, len)| Record {
                        key: Bytes::from(vec![key]),
                        payload: Bytes::from(vec![key; len]),
                    })
                    .collect();
                next_token += 1;
                let acks = engine
                    .publish_tracked(now_us, STREAM, records.clone(), PublishToken(next_token))
                    .expect("publish");
                for record in records {
                    let shard = shard_for_key(&record.key, shard_count);
                    model.shards[shard as usize].records.push(ModelRecord {
                        key: record.key,
                        payload: record.payload,
                        timestamp_us: now_us,
                    });
                }
                let ranges = acks
                    .iter()
                    .map(|ack| {
                        assert_eq!(
                            ack.first_offset + u64::from(ack.count),
                            model.next(ack.shard)
                        );
                        (ack.shard, ack.first_offset + u64::from(ack.count))
                    })
                    .collect();
                model.publishes.insert(
                    next_token,
                    ModelPublish {
                        ranges,
                        failed: false,
                        reported: false,
                    },
                );
            }
            Op::DrainAppends => {
                while let Some(request) = engine.poll_append() {
                    let shard = request.log_shard.shard();
                    assert_eq!(request.log_shard, ls(shard));
                    let state = &mut model.shards[shard as usize];
                    assert_eq!(request.offset, state.logged, "appends dense per shard");
                    let expected = &state.records[request.offset as usize];
                    assert_eq!(request.payload, expected.payload);
                    state.logged += 1;
                    model.log.insert(
                        (shard, request.offset),
                        LogRecord {
                            offset: request.offset,
                            timestamp_us: request.timestamp_us,
                            key: request.key,
                            payload: request.payload,
                        },
                    );
                }
            }
            Op::Durable { shard, count } => {
                if shard < shard_count {
                    let state = &mut model.shards[shard as usize];
                    state.durable = (state.durable + count).min(state.logged);
                    let end = state.durable;
                    engine.handle_durable(ls(shard), end);
                    model.resolve(shard, Some(end), None);
                }
            }
            Op::Reject { shard, skip } => {
                if shard < shard_count {
                    let state = &mut model.shards[shard as usize];
                    let from = (state.durable + skip).min(state.records.len() as u64);
                    state.records.truncate(from as usize);
                    state.logged = state.logged.min(from);
                    model
                        .log
                        .retain(|&(s, offset), _| s != shard || offset < from);
                    engine.handle_rejected(ls(shard), from);
                    model.resolve(shard, None, Some(from));
                }
            }
            Op::Retain { shard, count } => {
                if shard < shard_count {
                    let state = &mut model.shards[shard as usize];
                    state.oldest = (state.oldest + count).min(state.durable);
                    let oldest = state.oldest;
                    model
                        .log
                        .retain(|&(s, offset), _| s != shard || offset >= oldest);
                    engine.handle_retention(ls(shard), oldest);
                }
            }
            Op::Subscribe { shards, start } => {
                let shards: Vec<u32> = shards.into_iter().filter(|&s| s < shard_count).collect();
                if shards.is_empty() {
                    continue;
                }
                let mut positions: Vec<(u32, u64)> = shards
                    .iter()
                    .map(|&s| match start {
                        Start::Earliest => (s, model.oldest(s)),
                        _ => (s, model.shards[s as usize].durable),
                    })
                    .collect();
                let mut expected_error = None;
                let from = match start {
                    Start::Latest => StartPosition::Latest,
                    Start::Earliest => StartPosition::Earliest,
                    Start::Offset(shard, offset) => {
                        if !shards.contains(&shard) || offset > model.next(shard) {
                            expected_error = Some((ErrorCode::InvalidArgument, 0));
                        } else if offset < model.oldest(shard) {
                            expected_error = Some((ErrorCode::TooOld, model.oldest(shard)));
                        }
                        for position in positions.iter_mut().filter(|p| p.0 == shard) {
                            position.1 = offset;
                        }
                        StartPosition::Offsets(vec![(shard, offset)])
                    }
                };
                match engine.subscribe(STREAM, &ShardSelection::List(shards), &from) {
                    Ok(subscription) => {
                        assert_eq!(expected_error, None);
                        assert_eq!(subscription.start, positions);
                        model.subs.push(ModelSub {
                            id: subscription.id,
                            start: positions.iter().copied().collect(),
                            next: positions.into_iter().collect(),
                            live: true,
                        });
                    }
                    Err(error) => {
                        assert_eq!(Some((error.code, error.detail)), expected_error);
                    }
                }
            }
            Op::ServeReads { reads, max_records } => {
                serve(&mut engine, &model, reads, max_records);
            }
            Op::Poll {
                subscription,
                max_records,
            } => {
                if let Some(sub) = model.subs.get(subscription) {
                    let taken = engine.poll_delivery(sub.id, max_records, 64);
                    if !sub.live {
                        assert!(taken.is_empty());
                    }
                    check_delivered(&mut model, subscription, &taken);
                }
            }
        }
        check_events_and_completions(&mut engine, &mut model);
        let counters = engine.durable_counters();
        let pending: u64 = model
            .shards
            .iter()
            .map(|s| s.records.len() as u64 - s.durable)
            .sum();
        assert_eq!(counters.records_pending, pending);
        let described = engine.describe_stream(STREAM).expect("describe");
        for state in &described.shards {
            assert_eq!(state.next_offset, model.next(state.shard));
            assert_eq!(state.oldest_offset, model.oldest(state.shard));
            assert_eq!(
                engine.durable_through(STREAM, state.shard),
                Some(model.shards[state.shard as usize].durable)
            );
        }
        engine.assert_invariants();
    }

    // Everything appended becomes durable; reads and polls run until nothing moves: every
    // live subscriber then holds exactly the durable records from its start.
    let mut drain_ops = vec![Op::DrainAppends];
    for shard in 0..shard_count {
        drain_ops.push(Op::Durable {
            shard,
            count: u64::MAX / 4,
        });
    }
    for op in drain_ops {
        match op {
            Op::DrainAppends => {
                while let Some(request) = engine.poll_append() {
                    let shard = request.log_shard.shard();
                    let state = &mut model.shards[shard as usize];
                    assert_eq!(request.offset, state.logged);
                    state.logged += 1;
                    model.log.insert(
                        (shard, request.offset),
                        LogRecord {
                            offset: request.offset,
                            timestamp_us: request.timestamp_us,
                            key: request.key,
                            payload: request.payload,
                        },
                    );
                }
            }
            Op::Durable { shard, .. } => {
                let state = &mut model.shards[shard as usize];
                state.durable = state.logged;
                engine.handle_durable(ls(shard), state.logged);
                let end = state.logged;
                model.resolve(shard, Some(end), None);
            }
            _ => unreachable!("only drain ops"),
        }
    }
    check_events_and_completions(&mut engine, &mut model);
    for _round in 0..10_000 {
        serve(&mut engine, &model, usize::MAX, usize::MAX);
        let mut moved = false;
        for index in 0..model.subs.len() {
            if !model.subs[index].live {
                continue;
            }
            let taken = engine.poll_delivery(model.subs[index].id, 16, 1 << 20);
            moved |= !taken.is_empty();
            check_delivered(&mut model, index, &taken);
        }
        check_events_and_completions(&mut engine, &mut model);
        if !moved {
            break;
        }
    }
    assert!(
        model.publishes.is_empty(),
        "every tracked publish completed"
    );
    for sub in model.subs.iter().filter(|sub| sub.live) {
        for (&shard, &next) in &sub.next {
            // A start past the durable offset (the shard rolled back below it) still waits.
            let durable = model.shards[shard as usize].durable;
            assert_eq!(
                next,
                durable.max(sub.start[&shard]),
                "subscriber got every durable record of shard {shard}"
            );
        }
    }
    engine.assert_invariants();
}

/// Checks events (only lag and retention may end a subscription) and that completions are
/// exactly the tracked publishes whose outcome the model says is due.
fn check_events_and_completions(engine: &mut Engine, model: &mut Model) {
    while let Some(event) = engine.poll_event() {
        let EngineEvent::SubscriptionEnded(id, error) = event else {
            continue;
        };
        let sub = model
            .subs
            .iter_mut()
            .find(|sub| sub.id == id)
            .expect("a known subscription");
        assert!(sub.live, "ended once");
        sub.live = false;
        match error.code {
            ErrorCode::SubscriberLagged => {}
            ErrorCode::TooOld => {
                let shard_of_error = sub
                    .next
                    .iter()
                    .any(|(&shard, &next)| next < model.shards[shard as usize].oldest);
                assert!(shard_of_error, "TooOld only below the log's oldest");
            }
            other => panic!("unexpected end {other:?}: {error:?}"),
        }
    }
    let mut got: BTreeMap<u64, bool> = BTreeMap::new();
    while let Some(completion) = engine.poll_completed_publish() {
        if let Err(error) = &completion.result {
            assert_eq!(error.code, ErrorCode::StorageFull);
        }
        let previous = got.insert(completion.token.0, completion.result.is_ok());
        assert!(previous.is_none(), "one completion per token per step");
    }
    let mut expected: BTreeMap<u64, bool> = BTreeMap::new();
    model.publishes.retain(|&token, publish| {
        if publish.failed && !publish.reported {
            publish.reported = true;
            expected.insert(token, false);
        }
        if publish.ranges.is_empty() {
            if !publish.failed {
                expected.insert(token, true);
            }
            return false;
        }
        true
    });
    assert_eq!(got, expected, "completions");
}

fn engine_config() -> impl Strategy<Value = EngineConfig> {
    (
        0usize..5,
        0u64..30,
        prop_oneof![3 => Just(u64::MAX), 1 => 0u64..60],
    )
        .prop_map(
            |(ring_max_records, ring_max_bytes, subscriber_queue_max_bytes)| EngineConfig {
                ring_max_records,
                ring_max_bytes,
                subscriber_queue_max_bytes,
                ..EngineConfig::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        rng_seed: RngSeed::Fixed(0xd0_4ab1e),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn durable_interleavings_deliver_exactly_the_durable_records(
        config in engine_config(),
        shard_count in 1..=SHARDS_MAX,
        ops in prop::collection::vec(op(), 1..100),
    ) {
        // Proves every subscriber gets exactly the durable records from its start, dense and
        // in per-shard order, never one before it is durable, whatever the interleaving of
        // publishes, durable progress, rollbacks, retention, reads and polls; and that
        // tracked publishes, offsets and counters match the model.
        run(config, shard_count, ops);
    }
}
