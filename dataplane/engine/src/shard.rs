//! One shard of a stream: its offset counter, its replay ring and the subscriptions covering
//! it. Lives on the core that owns the shard.
//!
//! Storage lands later: a durable shard will add its log handle and a commit offset here.
//! `Engine::publish` already keeps the two steps apart: `assign_offset` + ring push (append),
//! then the fan-out to subscribers (release), so a durable shard can release records when its
//! log commits them instead of when they are appended.

use felix_wire::DeliveredRecord;

use crate::ShardState;
use crate::ring::ReplayRing;
use crate::subscription::Slot;

#[derive(Debug)]
pub(crate) struct Shard {
    /// Offset the next record appended to this shard gets (dense from 0).
    next_offset: u64,
    ring: ReplayRing,
    /// Subscriptions covering this shard, in the order they subscribed.
    pub(crate) subscribers: Vec<Slot>,
    /// Records this shard took in the publish being applied; 0 outside `Engine::publish`.
    pub(crate) batch_records: u32,
}

impl Shard {
    #[must_use]
    pub(crate) fn new(ring_max_records: usize, ring_max_bytes: u64) -> Shard {
        Shard {
            next_offset: 0,
            ring: ReplayRing::new(ring_max_records, ring_max_bytes),
            subscribers: Vec::new(),
            batch_records: 0,
        }
    }

    #[must_use]
    pub(crate) fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// Oldest offset a subscription may start from (`next_offset` when the ring is empty).
    #[must_use]
    pub(crate) fn oldest_offset(&self) -> u64 {
        self.ring.oldest_offset(self.next_offset)
    }

    /// Gives the next record of this shard its offset.
    #[must_use]
    pub(crate) fn assign_offset(&mut self) -> u64 {
        let offset = self.next_offset;
        // 2^64 records cannot be appended in the life of a process; overflow is a defect.
        self.next_offset = offset.checked_add(1).expect("shard offsets never wrap");
        offset
    }

    /// Keeps an appended record for replay (the ring decides how long).
    pub(crate) fn retain(&mut self, record: DeliveredRecord) {
        assert!(
            record.offset < self.next_offset,
            "only appended records are retained"
        );
        self.ring.push(record);
    }

    /// The held records from `offset` (in `oldest_offset()..=next_offset()`) to the newest.
    pub(crate) fn replay_from(&self, offset: u64) -> impl Iterator<Item = &DeliveredRecord> {
        self.ring.records_from(offset, self.next_offset)
    }

    #[must_use]
    pub(crate) fn state(&self, shard: u32) -> ShardState {
        ShardState {
            shard,
            oldest_offset: self.oldest_offset(),
            next_offset: self.next_offset,
            ring_records: self.ring.len(),
            ring_bytes: self.ring.payload_bytes(),
        }
    }

    pub(crate) fn assert_invariants(&self, shard: u32) {
        assert_eq!(
            self.batch_records, 0,
            "batch counts are reset when a publish ends"
        );
        self.ring.assert_invariants(shard, self.next_offset);
    }
}
