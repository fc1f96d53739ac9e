//! Seeded simulation of one replicated shard (`felix_cluster::shard`): three (or five)
//! members of the shard's Raft group in the simulated group of `group/mod.rs` (drops, delays,
//! reordering, partitions, crash-restarts; election and state machine safety every step),
//! with idempotent producers that publish batches to the member they believe leads, and
//! retry the same batch (same sequence) at the current leader when no ack comes in time.
//!
//! Audited at the end, after the faults heal and every producer's last batch is acked:
//! - offsets are dense and every member gave each offset the same record;
//! - every acknowledged record is in the shard exactly once, at the offsets its ack named;
//! - each producer's batches are in sequence order;
//! - every member reads back, from its own log store, exactly the committed records.
//!
//! `FELIX_CLUSTER_SIM_SEEDS` (default 60) and `FELIX_CLUSTER_SIM_FIRST` choose the seeds.

mod group;
mod seeds;

use std::collections::BTreeMap;

use bytes::Bytes;
use felix_cluster::node::Machine;
use felix_cluster::shard::{Batch, ShardApplied, ShardRecord, ShardState};
use group::{Group, Identity, STEP_MS};
use rand::Rng;

impl Identity for ShardApplied {
    fn index(&self) -> u64 {
        self.index
    }
    fn identity(&self) -> (u64, u64, u64) {
        (self.producer, self.sequence, u64::from(self.count))
    }
}

/// Simulated milliseconds a producer waits for an ack before it retries.
const ACK_TIMEOUT_MS: u64 = 1_000;
const PRODUCERS: u64 = 3;

#[derive(Debug, Clone, Copy)]
struct InFlight {
    sequence: u64,
    member: u64,
    sent_ms: u64,
}

#[derive(Default)]
struct Producer {
    next_sequence: u64,
    in_flight: Option<InFlight>,
    /// sequence -> (first offset, count) of each acknowledged batch.
    acked: BTreeMap<u64, (u64, u32)>,
}

fn batch(producer: u64, sequence: u64) -> Batch {
    // 1..=4 records, sized from the sequence: the same batch every retry.
    let count = 1 + (producer + sequence) % 4;
    Batch {
        producer,
        sequence,
        client: None,
        records: (0..count)
            .map(|i| ShardRecord {
                timestamp_us: sequence,
                key: Bytes::from(format!("p{producer}")),
                payload: Bytes::from(format!("{producer}-{sequence}-{i}")),
            })
            .collect(),
    }
}

struct Run {
    group: Group<ShardState>,
    producers: BTreeMap<u64, Producer>,
    /// offset -> (producer, sequence, position) as applied (every member must agree).
    history: BTreeMap<u64, (u64, u64, u64)>,
    /// The highest Raft index any member applied: committed, so every member applies it
    /// once healed (a member that applied it may crash before the others learn the commit).
    applied_upto: u64,
    publish_per_mille: u32,
}

impl Run {
    fn step(&mut self, faults: bool, publishing: bool) {
        let now = self.group.now_ms;
        let publish_per_mille = self.publish_per_mille;
        let producers = &mut self.producers;
        let stepped = self.group.step(faults, |group| {
            for (id, producer) in producers.iter_mut() {
                let due = producer
                    .in_flight
                    .is_none_or(|f| now.saturating_sub(f.sent_ms) >= ACK_TIMEOUT_MS);
                if !due || !publishing || !group.rng.random_ratio(publish_per_mille, 1000) {
                    continue;
                }
                // The producer learns the leader (a cluster client follows leader changes).
                let Some(leader) = group.leader() else {
                    continue;
                };
                let sequence = producer
                    .in_flight
                    .map_or(producer.next_sequence, |f| f.sequence);
                let node = group.member(leader).expect("the leader is alive");
                if node.propose_data(batch(*id, sequence).encode()).is_ok() {
                    producer.in_flight = Some(InFlight {
                        sequence,
                        member: leader,
                        sent_ms: now + STEP_MS,
                    });
                }
            }
        });
        for (member, applied) in stepped.applied {
            self.applied_upto = self.applied_upto.max(applied.index);
            assert!(
                !applied.out_of_order,
                "a producer's batches arrive in sequence: {applied:?}"
            );
            if !applied.duplicate {
                for position in 0..u64::from(applied.count) {
                    let offset = applied.first_offset + position;
                    let identity = (applied.producer, applied.sequence, position);
                    let seen = *self.history.entry(offset).or_insert(identity);
                    assert_eq!(
                        seen, identity,
                        "member {member} gave offset {offset} another record"
                    );
                }
            }
            let Some(producer) = self.producers.get_mut(&applied.producer) else {
                continue;
            };
            if let Some(flight) = producer.in_flight
                && flight.member == member
                && flight.sequence == applied.sequence
            {
                // The leader that took the batch applied it: the ack.
                producer
                    .acked
                    .insert(applied.sequence, (applied.first_offset, applied.count));
                producer.in_flight = None;
                producer.next_sequence = applied.sequence + 1;
            }
        }
    }

    fn converge(&mut self) {
        self.group.heal();
        // Bounded: 60 simulated seconds for every in-flight batch to be acked and every member
        // to apply everything.
        for _ in 0..6_000 {
            let waiting = self.producers.values().any(|p| p.in_flight.is_some());
            self.step(false, waiting);
            let offsets: Vec<(u64, u64)> = self
                .group
                .live()
                .map(|n| (n.state().next_offset(), n.state().applied_index()))
                .collect();
            if !waiting
                && offsets.windows(2).all(|pair| pair[0] == pair[1])
                && offsets.first().is_some_and(|o| o.1 >= self.applied_upto)
            {
                return;
            }
        }
        panic!(
            "the shard did not converge within 60 simulated seconds: {}",
            self.group.describe()
        );
    }

    fn audit(&mut self) {
        let next_offset = self
            .group
            .live()
            .next()
            .expect("a member")
            .state()
            .next_offset();
        // Dense: every offset below the end holds a record.
        assert_eq!(self.history.len() as u64, next_offset, "offsets are dense");
        assert!(self.history.keys().copied().eq(0..next_offset));
        // Exactly once: no record at two offsets.
        let mut seen = BTreeMap::new();
        for (offset, identity) in &self.history {
            if let Some(other) = seen.insert(*identity, *offset) {
                panic!("record {identity:?} is at offsets {other} and {offset}");
            }
        }
        let mut acked_records = 0u64;
        for (id, producer) in &self.producers {
            let mut previous = None;
            for (sequence, (first, count)) in &producer.acked {
                for position in 0..u64::from(*count) {
                    assert_eq!(
                        self.history.get(&(first + position)),
                        Some(&(*id, *sequence, position)),
                        "acked batch {sequence} of producer {id} is not where its ack said"
                    );
                }
                assert!(
                    previous < Some(*first),
                    "producer {id}'s batches out of order"
                );
                previous = Some(*first);
                acked_records += u64::from(*count);
            }
        }
        assert!(
            acked_records <= next_offset,
            "more acked records than offsets"
        );
        // Every member reads the committed records back from its own log store.
        for id in self.group.ids() {
            let node = self.group.member(id).expect("healed");
            let state = node.state();
            let oldest = state.oldest_offset();
            assert_eq!(
                oldest,
                (0..next_offset)
                    .find(|offset| state.locate(*offset).is_some())
                    .unwrap_or(next_offset),
                "member {id}: the oldest offset held is the first one located"
            );
            let read = state
                .read(node.store(), oldest, usize::MAX, usize::MAX)
                .expect("read back");
            assert_eq!(
                read.len() as u64,
                next_offset - oldest,
                "member {id} reads all"
            );
            for (offset, record) in read {
                let (producer, sequence, position) = self.history[&offset];
                let expected = format!("{producer}-{sequence}-{position}");
                assert_eq!(
                    record.payload,
                    Bytes::from(expected),
                    "member {id} offset {offset}"
                );
            }
        }
    }
}

fn run(seed: u64) {
    let group = Group::new(seed, ShardState::default());
    let mut run = Run {
        publish_per_mille: [50, 300][usize::from(seed % 2 == 1)],
        group,
        producers: (1..=PRODUCERS)
            .map(|id| {
                (
                    id,
                    Producer {
                        next_sequence: 1,
                        ..Producer::default()
                    },
                )
            })
            .collect(),
        history: BTreeMap::new(),
        applied_upto: 0,
    };
    for _ in 0..3_000 {
        run.step(true, true);
    }
    run.converge();
    run.audit();
}

#[test]
fn a_replicated_shard_keeps_every_acked_record_once_in_order() {
    seeds::for_seeds("replicated-shard", "FELIX_CLUSTER_SIM", 0, 60, run);
}
