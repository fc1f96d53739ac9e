//! Subscriptions of one engine: their delivery queues and the slab that holds them. Lives on
//! the engine's core.

use std::collections::{HashMap, VecDeque};

use felix_wire::DeliveredRecord;

use crate::SubscriptionId;
use crate::ring::payload_len;

/// Live records queued for one subscription beyond which it is ended as lagged, whatever
/// their payload size. The byte bound (`EngineConfig::subscriber_queue_max_bytes`) alone does
/// not bound empty or tiny payloads; at 88 bytes per queued record this caps a lagging
/// subscriber's queue slots at 22 MiB, and at the reference's smallest payload (256 B) the
/// default byte bound (64 MiB) is reached at the same count.
pub const SUBSCRIBER_QUEUE_MAX_LIVE_RECORDS: usize = 256 * 1024;

/// Index of a subscription in the engine's slab. Slots are reused; `SubscriptionId`s are not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot(u32);

impl Slot {
    fn index(self) -> usize {
        // u32 -> usize is lossless on every target Felix builds for (64-bit).
        self.0 as usize
    }
}

/// One subscription: which shards it covers and the records waiting for `poll_delivery`.
#[derive(Debug)]
pub(crate) struct SubState {
    pub(crate) id: SubscriptionId,
    pub(crate) stream: Box<str>,
    /// Subscribed shards, ascending, no duplicates, at least one.
    pub(crate) shards: Box<[u32]>,
    /// Records in engine order, which keeps per-shard order: catch-up from the rings (queued at
    /// subscribe, shard by shard) first, then live records as they are appended.
    pub(crate) queue: VecDeque<DeliveredRecord>,
    /// How many records at the front of `queue` are catch-up; they do not count toward the
    /// lag bounds.
    pub(crate) catch_up_records: usize,
    /// Payload bytes of the live records in `queue`.
    pub(crate) live_bytes: u64,
}

impl SubState {
    #[must_use]
    fn live_records(&self) -> usize {
        self.queue.len() - self.catch_up_records
    }

    /// Whether queueing one more live record with `payload_bytes` of payload goes over the
    /// bounds. A record that finds no live record queued is always taken, so a subscriber
    /// that keeps up is never ended, however large a single record is.
    #[must_use]
    pub(crate) fn would_lag(&self, payload_bytes: u64, queue_max_bytes: u64) -> bool {
        let live_records = self.live_records();
        live_records > 0
            && (self.live_bytes.saturating_add(payload_bytes) > queue_max_bytes
                || live_records >= SUBSCRIBER_QUEUE_MAX_LIVE_RECORDS)
    }

    /// Queues a live record; returns whether the queue was empty before (a `DeliveryReady`
    /// is due).
    #[must_use]
    pub(crate) fn push_live(&mut self, record: DeliveredRecord) -> bool {
        let was_empty = self.queue.is_empty();
        self.live_bytes += payload_len(&record);
        self.queue.push_back(record);
        was_empty
    }

    /// Takes up to `max_records` records and about `max_bytes` of payload from the front; at
    /// least one record if any is queued and `max_records > 0`.
    #[must_use]
    pub(crate) fn take(&mut self, max_records: usize, max_bytes: usize) -> Vec<DeliveredRecord> {
        let mut taken = Vec::with_capacity(max_records.min(self.queue.len()));
        let mut taken_bytes: usize = 0;
        while taken.len() < max_records {
            let Some(front) = self.queue.front() else {
                break;
            };
            let len = front.payload.len();
            if !taken.is_empty() && taken_bytes.saturating_add(len) > max_bytes {
                break;
            }
            let record = self
                .queue
                .pop_front()
                .expect("front() just returned a record");
            taken_bytes = taken_bytes.saturating_add(len);
            if self.catch_up_records > 0 {
                self.catch_up_records -= 1;
            } else {
                assert!(
                    self.live_bytes >= payload_len(&record),
                    "live bytes cover the queue"
                );
                self.live_bytes -= payload_len(&record);
            }
            taken.push(record);
        }
        if self.queue.is_empty() {
            assert_eq!(self.live_bytes, 0, "an empty queue holds no live bytes");
            assert_eq!(self.catch_up_records, 0, "an empty queue holds no catch-up");
        }
        taken
    }

    /// Checks every invariant of the subscription; O(queued records).
    pub(crate) fn assert_invariants(&self) {
        assert!(
            !self.shards.is_empty(),
            "a subscription covers at least one shard"
        );
        assert!(
            self.shards.windows(2).all(|w| w[0] < w[1]),
            "shards ascending, unique"
        );
        assert!(self.catch_up_records <= self.queue.len());
        let live_bytes: u64 = self
            .queue
            .iter()
            .skip(self.catch_up_records)
            .map(payload_len)
            .sum();
        assert_eq!(
            live_bytes, self.live_bytes,
            "live bytes == sum of live payload lengths"
        );
        // Per shard, queued offsets are dense and ascending.
        let mut last: HashMap<u32, u64> = HashMap::new();
        for record in &self.queue {
            assert!(
                self.shards.binary_search(&record.shard).is_ok(),
                "only selected shards"
            );
            if let Some(previous) = last.insert(record.shard, record.offset) {
                assert_eq!(
                    previous + 1,
                    record.offset,
                    "per-shard offsets dense, in order"
                );
            }
        }
    }
}

/// All subscriptions of an engine: a slab (so the publish fan-out reaches a subscription by
/// index, without hashing) plus the id -> slot map for the shell's calls.
#[derive(Debug)]
pub(crate) struct Subscriptions {
    slots: Vec<Option<SubState>>,
    free: Vec<Slot>,
    by_id: HashMap<SubscriptionId, Slot>,
    /// Next id to hand out; ids start at 1 and are never reused.
    next_id: u64,
}

impl Subscriptions {
    #[must_use]
    pub(crate) fn new() -> Subscriptions {
        Subscriptions {
            slots: Vec::new(),
            free: Vec::new(),
            by_id: HashMap::new(),
            next_id: 1,
        }
    }

    /// Number of live subscriptions.
    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Stores a new subscription built by `build` from its fresh id.
    pub(crate) fn insert(&mut self, build: impl FnOnce(SubscriptionId) -> SubState) -> Slot {
        let id = SubscriptionId(self.next_id);
        self.next_id += 1;
        let state = build(id);
        assert_eq!(state.id, id, "the subscription carries the id it was given");
        let slot = match self.free.pop() {
            Some(slot) => {
                assert!(self.slots[slot.index()].is_none(), "free slots are empty");
                self.slots[slot.index()] = Some(state);
                slot
            }
            None => {
                // More than 2^32 simultaneous subscriptions would exhaust memory long before.
                let slot = Slot(u32::try_from(self.slots.len()).expect("fewer than 2^32 slots"));
                self.slots.push(Some(state));
                slot
            }
        };
        let previous = self.by_id.insert(id, slot);
        assert!(previous.is_none(), "subscription ids are never reused");
        slot
    }

    #[must_use]
    pub(crate) fn slot_of(&self, id: SubscriptionId) -> Option<Slot> {
        self.by_id.get(&id).copied()
    }

    /// The subscription in `slot`; `None` if it ended earlier in the current publish.
    #[must_use]
    pub(crate) fn get(&self, slot: Slot) -> Option<&SubState> {
        self.slots.get(slot.index()).and_then(Option::as_ref)
    }

    /// The subscription in `slot`; `None` if it ended earlier in the current publish.
    #[must_use]
    pub(crate) fn get_mut(&mut self, slot: Slot) -> Option<&mut SubState> {
        self.slots.get_mut(slot.index()).and_then(Option::as_mut)
    }

    /// Forgets the subscription in `slot` (which must hold one) and frees the slot.
    pub(crate) fn remove(&mut self, slot: Slot) -> SubState {
        let state = self.slots[slot.index()]
            .take()
            .expect("only occupied slots are removed");
        let removed = self.by_id.remove(&state.id);
        assert_eq!(removed, Some(slot), "id map and slab agree");
        self.free.push(slot);
        state
    }

    /// Every live subscription with its slot.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Slot, &SubState)> {
        self.slots.iter().enumerate().filter_map(|(index, state)| {
            let slot = Slot(u32::try_from(index).expect("fewer than 2^32 slots"));
            state.as_ref().map(|state| (slot, state))
        })
    }

    pub(crate) fn assert_invariants(&self) {
        assert_eq!(
            self.iter().count(),
            self.by_id.len(),
            "slab and id map agree"
        );
        for (slot, state) in self.iter() {
            assert_eq!(
                self.by_id.get(&state.id),
                Some(&slot),
                "id map and slab agree"
            );
            assert!(state.id.0 < self.next_id, "ids come from the counter");
            state.assert_invariants();
        }
        for slot in &self.free {
            assert!(self.slots[slot.index()].is_none(), "free slots are empty");
        }
    }
}
