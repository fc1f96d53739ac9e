//! One shard of a stream: its offset counter, its replay ring and the subscriptions covering
//! it. Lives on the core that owns the shard.
//!
//! An in-memory shard releases a record as it is appended: ring push and fan-out at once. A
//! durable shard (`durable` is set) keeps appended records pending until the log makes them
//! durable (`Engine::handle_durable`), then releases them in order to the ring and to live
//! subscribers; its ring and its "released" offset stop at the durable offset.

use felix_wire::DeliveredRecord;

use crate::ShardState;
use crate::durable::DurableShard;
use crate::ring::{Held, ReplayRing};
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
    /// Key and payload bytes of the records this shard takes in the publish being applied
    /// (counted before the first is appended); 0 outside `Engine::publish_routed_from`.
    pub(crate) batch_bytes: u64,
    /// Set for a shard of a durable stream.
    pub(crate) durable: Option<Box<DurableShard>>,
}

impl Shard {
    #[must_use]
    pub(crate) fn new(ring_max_records: usize, ring_max_bytes: u64) -> Shard {
        Shard {
            next_offset: 0,
            ring: ReplayRing::new(ring_max_records, ring_max_bytes),
            subscribers: Vec::new(),
            batch_records: 0,
            batch_bytes: 0,
            durable: None,
        }
    }

    /// A durable shard whose records `oldest..next` are all durable in the log (none in the
    /// ring).
    #[must_use]
    pub(crate) fn new_durable(
        ring_max_records: usize,
        ring_max_bytes: u64,
        durable: DurableShard,
    ) -> Shard {
        let mut shard = Shard::new(ring_max_records, ring_max_bytes);
        shard.next_offset = durable.durable;
        shard.durable = Some(Box::new(durable));
        shard
    }

    /// Offset of the next record to be released (delivered live): `next_offset` for an
    /// in-memory shard, the durable offset for a durable one.
    #[must_use]
    pub(crate) fn released_offset(&self) -> u64 {
        match &self.durable {
            None => self.next_offset,
            Some(durable) => durable.durable,
        }
    }

    /// Oldest offset the replay ring holds (`released_offset()` when it is empty).
    #[must_use]
    pub(crate) fn ring_oldest(&self) -> u64 {
        self.ring.oldest_offset(self.released_offset())
    }

    #[must_use]
    pub(crate) fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// Oldest offset a subscription may start from: the ring's oldest (`next_offset` when
    /// the ring is empty) in memory; for a durable shard the older of the log's and the
    /// ring's oldest.
    #[must_use]
    pub(crate) fn oldest_offset(&self) -> u64 {
        let ring_oldest = self.ring_oldest();
        match &self.durable {
            None => ring_oldest,
            Some(durable) => durable.log_oldest.min(ring_oldest),
        }
    }

    /// Gives the next record of this shard its offset.
    #[must_use]
    pub(crate) fn assign_offset(&mut self) -> u64 {
        let offset = self.next_offset;
        // 2^64 records cannot be appended in the life of a process; overflow is a defect.
        self.next_offset = offset.checked_add(1).expect("shard offsets never wrap");
        offset
    }

    /// Takes back the offsets from `from` (a disk-full rollback of a durable shard).
    pub(crate) fn roll_back_to(&mut self, from: u64) {
        assert!(from <= self.next_offset, "a rollback only goes back");
        assert!(
            from >= self.released_offset(),
            "released records are never rolled back"
        );
        self.next_offset = from;
    }

    /// Keeps a released record, which keeps `held` alive, for replay (the ring decides how
    /// long).
    pub(crate) fn retain(&mut self, record: DeliveredRecord, held: Held) {
        assert!(
            record.offset < self.released_offset(),
            "only released records are retained"
        );
        self.ring.push(record, held);
    }

    /// Whether the ring keeps anything, and its byte bound.
    #[must_use]
    pub(crate) fn ring_bound(&self) -> Option<u64> {
        self.ring.is_enabled().then(|| self.ring.max_bytes())
    }

    /// The held records from `offset` (in `ring_oldest()..=released_offset()`) to the newest.
    pub(crate) fn replay_from(&self, offset: u64) -> impl Iterator<Item = &DeliveredRecord> {
        self.ring.records_from(offset, self.released_offset())
    }

    #[must_use]
    pub(crate) fn state(&self, shard: u32) -> ShardState {
        ShardState {
            shard,
            oldest_offset: self.oldest_offset(),
            next_offset: self.next_offset,
            ring_records: self.ring.len(),
            ring_bytes: self.ring.held_bytes(),
        }
    }

    pub(crate) fn assert_invariants(&self, shard: u32) {
        assert_eq!(
            self.batch_records, 0,
            "batch counts are reset when a publish ends"
        );
        assert_eq!(
            self.batch_bytes, 0,
            "batch bytes are reset when a publish ends"
        );
        let released = self.released_offset();
        self.ring.assert_invariants(shard, released);
        let Some(durable) = &self.durable else {
            return;
        };
        assert_eq!(
            durable.log_shard.shard(),
            shard,
            "the log shard id names its shard"
        );
        assert!(
            durable.log_oldest <= durable.durable,
            "the log holds up to durable"
        );
        assert!(durable.durable <= self.next_offset, "durable <= next");
        assert_eq!(
            durable.pending.len() as u64,
            self.next_offset - durable.durable,
            "every record not yet durable is pending"
        );
        for (expected, (record, _)) in (durable.durable..).zip(&durable.pending) {
            assert_eq!(
                record.offset, expected,
                "pending offsets dense from durable"
            );
            assert_eq!(record.shard, shard, "pending records are the shard's");
        }
        let mut previous_end = durable.durable;
        for waiter in &durable.waiters {
            assert!(waiter.end > previous_end, "waiters ascend past durable");
            previous_end = waiter.end;
        }
        assert!(
            previous_end <= self.next_offset,
            "waiters end at most at next"
        );
    }
}
