//! Property test: random interleavings of publishes, subscribes, polls, unsubscribes and
//! stream deletions, checked against a plain model of the shards. Deterministic: the
//! generator's seed is fixed.

use std::collections::HashMap;

use bytes::Bytes;
use felix_engine::{Engine, EngineConfig, EngineEvent, SubscriptionId};
use felix_wire::{ErrorCode, Record, ShardSelection, StartPosition, StreamKind, shard_for_key};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

const STREAM: &str = "model";
/// Largest shard count generated: small, so subscriptions overlap and rings fill.
const SHARDS_MAX: u32 = 4;
/// Shard numbers generated for selections, a little past the largest shard count so that
/// out-of-range shards are exercised too.
const SHARD_NUMBER_MAX: u32 = SHARDS_MAX + 1;

#[derive(Debug, Clone)]
enum Op {
    /// `(key byte, payload length)` per record; an empty batch must be refused.
    Publish(Vec<(u8, usize)>),
    /// `None` selects all shards.
    Subscribe {
        selection: Option<Vec<u32>>,
        start: Start,
    },
    Poll {
        subscription: usize,
        max_records: usize,
        max_bytes: usize,
    },
    Unsubscribe(usize),
    DeleteAndRecreate,
}

#[derive(Debug, Clone)]
enum Start {
    Latest,
    Earliest,
    Offsets(Vec<(u32, u64)>),
}

fn op() -> impl Strategy<Value = Op> {
    let shard = 0..=SHARD_NUMBER_MAX;
    prop_oneof![
        6 => prop::collection::vec((any::<u8>(), 0usize..12), 0..10).prop_map(Op::Publish),
        2 => (
            prop::option::weighted(0.6, prop::collection::vec(shard.clone(), 0..5)),
            prop_oneof![
                Just(Start::Latest),
                Just(Start::Earliest),
                prop::collection::vec((shard, 0u64..40), 0..4).prop_map(Start::Offsets),
            ],
        )
            .prop_map(|(selection, start)| Op::Subscribe { selection, start }),
        5 => (0usize..8, 0usize..6, 0usize..40).prop_map(|(subscription, max_records, max_bytes)| {
            Op::Poll { subscription, max_records, max_bytes }
        }),
        1 => (0usize..8).prop_map(Op::Unsubscribe),
        1 => Just(Op::DeleteAndRecreate),
    ]
}

/// A record as the model holds it.
#[derive(Debug, Clone)]
struct ModelRecord {
    key: Bytes,
    payload: Bytes,
    timestamp_us: u64,
}

/// A subscription as the model sees it: the next offset it must receive per shard.
#[derive(Debug)]
struct ModelSub {
    id: SubscriptionId,
    next: HashMap<u32, u64>,
    live: bool,
}

struct Model {
    config: EngineConfig,
    shards: Vec<Vec<ModelRecord>>,
    subs: Vec<ModelSub>,
    records_appended: u64,
    records_delivered: u64,
}

impl Model {
    /// The oldest offset the ring of `shard` must hold: the longest suffix within both bounds.
    fn oldest(&self, shard: u32) -> u64 {
        let records = &self.shards[shard as usize];
        let mut kept = 0usize;
        let mut bytes = 0u64;
        if self.config.ring_max_records > 0 && self.config.ring_max_bytes > 0 {
            for record in records.iter().rev() {
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
        (records.len() - kept) as u64
    }

    fn next(&self, shard: u32) -> u64 {
        self.shards[shard as usize].len() as u64
    }

    fn shard_count(&self) -> u32 {
        self.shards.len() as u32
    }

    /// Error codes the engine may answer for this subscribe, or the expected start positions.
    fn expect_subscribe(
        &self,
        selection: &Option<Vec<u32>>,
        start: &Start,
    ) -> Result<Vec<(u32, u64)>, Refusals> {
        let mut errors = Vec::new();
        let selected: Vec<u32> = match selection {
            None => (0..self.shard_count()).collect(),
            Some(list) => {
                let mut sorted = list.clone();
                sorted.sort_unstable();
                sorted.dedup();
                if list.is_empty()
                    || sorted.len() != list.len()
                    || list.iter().any(|&s| s >= self.shard_count())
                {
                    errors.push((ErrorCode::InvalidArgument, 0));
                }
                sorted
            }
        };
        let mut positions: Vec<(u32, u64)> = selected
            .iter()
            .filter(|&&s| s < self.shard_count())
            .map(|&s| match start {
                Start::Earliest => (s, self.oldest(s)),
                Start::Latest | Start::Offsets(_) => (s, self.next(s)),
            })
            .collect();
        if let Start::Offsets(list) = start {
            let mut seen = Vec::new();
            for &(shard, offset) in list {
                if !selected.contains(&shard)
                    || shard >= self.shard_count()
                    || seen.contains(&shard)
                {
                    errors.push((ErrorCode::InvalidArgument, 0));
                    continue;
                }
                seen.push(shard);
                if offset > self.next(shard) {
                    errors.push((ErrorCode::InvalidArgument, 0));
                } else if offset < self.oldest(shard) {
                    errors.push((ErrorCode::TooOld, self.oldest(shard)));
                }
                for position in positions.iter_mut().filter(|p| p.0 == shard) {
                    position.1 = offset;
                }
            }
        }
        if errors.is_empty() {
            Ok(positions)
        } else {
            Err(Refusals(errors))
        }
    }
}

/// `(code, detail)` answers the engine may give to a subscribe that breaks several rules.
#[derive(Debug)]
struct Refusals(Vec<(ErrorCode, u64)>);

/// Parses the `shard:next_offset` resume list of a `SubscriberLagged` message.
fn resume_positions(message: &str) -> HashMap<u32, u64> {
    let (_, list) = message
        .split_once("shard:next_offset")
        .expect("the message lists resume positions");
    list.split_whitespace()
        .map(|entry| {
            let (shard, offset) = entry.split_once(':').expect("shard:offset");
            (
                shard.parse().expect("shard number"),
                offset.parse().expect("offset"),
            )
        })
        .collect()
}

fn run(config: EngineConfig, shard_count: u32, ops: Vec<Op>) {
    let mut engine = Engine::new(config);
    engine
        .create_stream(STREAM, shard_count, StreamKind::InMemory)
        .expect("create");
    let mut model = Model {
        config,
        shards: vec![Vec::new(); shard_count as usize],
        subs: Vec::new(),
        records_appended: 0,
        records_delivered: 0,
    };
    let mut now_us = 1_000_000u64;

    for op in ops {
        now_us += 1;
        let queued_before: Vec<Option<usize>> = model
            .subs
            .iter()
            .map(|sub| engine.queued_records(sub.id))
            .collect();
        let mut expect_lag = false;
        let mut expect_deleted = false;
        match op {
            Op::Publish(batch) => {
                let records: Vec<Record> = batch
                    .iter()
                    .map(|&(key, len)| Record {
                        key: Bytes::from(vec![key]),
                        payload: Bytes::from(vec![key; len]),
                    })
                    .collect();
                let result = engine.publish(now_us, STREAM, records.clone());
                if records.is_empty() {
                    assert_eq!(result.expect_err("empty").code, ErrorCode::InvalidArgument);
                } else {
                    let acks = result.expect("publish");
                    let mut counts: HashMap<u32, u32> = HashMap::new();
                    for record in records {
                        let shard = shard_for_key(&record.key, shard_count);
                        *counts.entry(shard).or_default() += 1;
                        model.shards[shard as usize].push(ModelRecord {
                            key: record.key,
                            payload: record.payload,
                            timestamp_us: now_us,
                        });
                        model.records_appended += 1;
                    }
                    let mut expected: Vec<(u32, u64, u32)> = counts
                        .into_iter()
                        .map(|(shard, count)| (shard, model.next(shard) - u64::from(count), count))
                        .collect();
                    expected.sort_unstable();
                    let got: Vec<(u32, u64, u32)> = acks
                        .iter()
                        .map(|a| (a.shard, a.first_offset, a.count))
                        .collect();
                    assert_eq!(got, expected);
                    expect_lag = true;
                }
            }
            Op::Subscribe { selection, start } => {
                let expected = model.expect_subscribe(&selection, &start);
                let shards = match &selection {
                    None => ShardSelection::All,
                    Some(list) => ShardSelection::List(list.clone()),
                };
                let from = match &start {
                    Start::Latest => StartPosition::Latest,
                    Start::Earliest => StartPosition::Earliest,
                    Start::Offsets(list) => StartPosition::Offsets(list.clone()),
                };
                match (engine.subscribe(STREAM, &shards, &from), expected) {
                    (Ok(subscription), Ok(positions)) => {
                        assert_eq!(subscription.start, positions);
                        model.subs.push(ModelSub {
                            id: subscription.id,
                            next: positions.into_iter().collect(),
                            live: true,
                        });
                    }
                    (Err(error), Err(Refusals(possible))) => {
                        assert!(
                            possible.contains(&(error.code, error.detail)),
                            "{error:?} not in {possible:?}"
                        );
                    }
                    (got, expected) => panic!("engine {got:?}, model {expected:?}"),
                }
            }
            Op::Poll {
                subscription,
                max_records,
                max_bytes,
            } => {
                if let Some(sub) = model.subs.get_mut(subscription) {
                    let queued = engine.queued_records(sub.id);
                    let taken = engine.poll_delivery(sub.id, max_records, max_bytes);
                    assert!(taken.len() <= max_records);
                    if !sub.live {
                        assert!(taken.is_empty());
                        assert_eq!(queued, None);
                    } else if max_records > 0 && queued > Some(0) {
                        assert!(!taken.is_empty(), "at least one record");
                    }
                    if taken.len() > 1 {
                        let bytes: usize = taken.iter().map(|r| r.payload.len()).sum();
                        assert!(
                            bytes <= max_bytes,
                            "byte bound kept beyond the first record"
                        );
                    }
                    for record in &taken {
                        let next = sub.next.get_mut(&record.shard).expect("a selected shard");
                        assert_eq!(record.offset, *next, "dense, in per-shard order");
                        let expected = &model.shards[record.shard as usize][*next as usize];
                        assert_eq!(record.key, expected.key);
                        assert_eq!(record.payload, expected.payload);
                        assert_eq!(record.timestamp_us, expected.timestamp_us);
                        *next += 1;
                    }
                    model.records_delivered += taken.len() as u64;
                }
            }
            Op::Unsubscribe(subscription) => {
                if let Some(sub) = model.subs.get_mut(subscription) {
                    engine.unsubscribe(sub.id);
                    sub.live = false;
                }
            }
            Op::DeleteAndRecreate => {
                engine.delete_stream(STREAM).expect("delete");
                engine
                    .create_stream(STREAM, shard_count, StreamKind::InMemory)
                    .expect("recreate");
                model.shards = vec![Vec::new(); shard_count as usize];
                expect_deleted = true;
            }
        }

        // Events: every end matches the operation; DeliveryReady once per empty -> non-empty.
        let mut ready: HashMap<SubscriptionId, usize> = HashMap::new();
        let mut ended: Vec<SubscriptionId> = Vec::new();
        while let Some(event) = engine.poll_event() {
            match event {
                EngineEvent::DeliveryReady(id) => *ready.entry(id).or_default() += 1,
                EngineEvent::SubscriptionEnded(id, error) => {
                    let sub = model
                        .subs
                        .iter_mut()
                        .find(|sub| sub.id == id)
                        .expect("a known subscription");
                    assert!(sub.live, "ended once");
                    sub.live = false;
                    ended.push(id);
                    match error.code {
                        ErrorCode::SubscriberLagged => {
                            assert!(expect_lag, "lag only on publish");
                            assert_eq!(error.detail, 0);
                            assert_eq!(resume_positions(&error.message), sub.next);
                            assert_ne!(config.subscriber_queue_max_bytes, u64::MAX);
                        }
                        ErrorCode::StreamNotFound => assert!(expect_deleted),
                        other => panic!("unexpected end {other:?}"),
                    }
                }
            }
        }
        for (index, sub) in model.subs.iter().enumerate() {
            if !sub.live || ended.contains(&sub.id) {
                continue;
            }
            // A subscription made by this operation had nothing queued before it.
            let before = queued_before.get(index).copied().flatten().unwrap_or(0);
            let after = engine.queued_records(sub.id).expect("live");
            let emitted = ready.get(&sub.id).copied().unwrap_or(0);
            let grew_from_empty = before == 0 && after > 0;
            assert_eq!(
                emitted,
                usize::from(grew_from_empty),
                "ready for {:?}",
                sub.id
            );
        }

        let counters = engine.counters();
        assert_eq!(counters.records_appended, model.records_appended);
        assert_eq!(counters.records_delivered, model.records_delivered);
        let live = model.subs.iter().filter(|sub| sub.live).count();
        assert_eq!(counters.subscriptions_active, live as u64);
        let described = engine.describe_stream(STREAM).expect("describe");
        for state in &described.shards {
            assert_eq!(state.next_offset, model.next(state.shard));
            assert_eq!(state.oldest_offset, model.oldest(state.shard));
        }
        engine.assert_invariants();
    }

    // Every live subscriber receives exactly the rest of its shards, dense and in order.
    for sub in model.subs.iter_mut().filter(|sub| sub.live) {
        loop {
            let taken = engine.poll_delivery(sub.id, 5, 16);
            if taken.is_empty() {
                break;
            }
            for record in taken {
                let next = sub.next.get_mut(&record.shard).expect("a selected shard");
                assert_eq!(record.offset, *next);
                let expected = &model.shards[record.shard as usize][*next as usize];
                assert_eq!(record.payload, expected.payload);
                *next += 1;
            }
        }
        for (&shard, &next) in &sub.next {
            let appended = model.shards[shard as usize].len() as u64;
            assert_eq!(
                next, appended,
                "subscriber got every record of shard {shard}"
            );
        }
    }
}

fn engine_config() -> impl Strategy<Value = EngineConfig> {
    (0usize..6, 0u64..40, prop_oneof![Just(u64::MAX), 0u64..60]).prop_map(
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
        rng_seed: RngSeed::Fixed(0x00fe_11c5),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn interleavings_deliver_exactly_the_expected_records(
        config in engine_config(),
        shard_count in 1..=SHARDS_MAX,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        // Proves every subscriber gets exactly its records, dense and in per-shard order,
        // whatever the interleaving, and that acks, rings, events and counters match the model.
        run(config, shard_count, ops);
    }
}
