//! Subscriptions of one engine: which shards they select, their delivery queues and the slab
//! that holds them. Lives on the engine's core.

use std::collections::{HashMap, VecDeque};

use felix_wire::{DeliveredRecord, ShardSelection, StartPosition};

use crate::ring::payload_len;
use crate::stream::StreamSlot;
use crate::{EngineError, SubscriptionId};

/// Live records queued for one subscription beyond which it is ended as lagged, whatever
/// their payload size. The byte bound (`EngineConfig::subscriber_queue_max_bytes`) alone does
/// not bound empty or tiny payloads; at 88 bytes per queued record this caps a lagging
/// subscriber's queue slots at 22 MiB, and at the reference's smallest payload (256 B) the
/// default byte bound (64 MiB) is reached at the same count.
pub const SUBSCRIBER_QUEUE_LIVE_RECORDS_MAX: usize = 256 * 1024;

/// The shards a subscription of `selection` starting `from` covers on a stream of
/// `shard_count` shards, ascending. `InvalidArgument` for an empty list, a shard out of range
/// (selected or given a start offset), a shard selected twice, a start offset for a shard not
/// selected, and more than one start offset for a shard. The offsets themselves are not
/// checked here (beyond the next offset, too old): that needs the shards, see
/// [`crate::Engine::subscribe`], which calls this first. A broker that splits a subscription
/// over cores calls it once before the split.
///
/// `shard_count == 0` is a caller defect (a stream has at least one shard) and panics.
pub fn select_shards(
    selection: &ShardSelection,
    from: &StartPosition,
    shard_count: u32,
) -> Result<Box<[u32]>, EngineError> {
    assert!(shard_count > 0, "a stream has at least one shard");
    let out_of_range = |shard: u32| {
        EngineError::invalid(format!(
            "shard {shard} is out of range: the stream has {shard_count} shards"
        ))
    };
    let selected: Box<[u32]> = match selection {
        ShardSelection::All => (0..shard_count).collect(),
        ShardSelection::List(list) => {
            if list.is_empty() {
                return Err(EngineError::invalid(
                    "a subscription selects at least one shard".to_owned(),
                ));
            }
            if let Some(&shard) = list.iter().find(|&&shard| shard >= shard_count) {
                return Err(out_of_range(shard));
            }
            let mut sorted = list.clone();
            sorted.sort_unstable();
            if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
                return Err(EngineError::invalid(format!(
                    "shard {} is selected more than once",
                    pair[0]
                )));
            }
            sorted.into_boxed_slice()
        }
    };
    if let StartPosition::Offsets(positions) = from {
        let mut listed = vec![false; selected.len()];
        for &(shard, _) in positions {
            let Ok(position) = selected.binary_search(&shard) else {
                if shard >= shard_count {
                    return Err(out_of_range(shard));
                }
                return Err(EngineError::invalid(format!(
                    "shard {shard} has a start offset but is not selected"
                )));
            };
            if listed[position] {
                return Err(EngineError::invalid(format!(
                    "shard {shard} has more than one start offset"
                )));
            }
            listed[position] = true;
        }
    }
    Ok(selected)
}

/// Index of a subscription in the engine's slab. Slots are reused; `SubscriptionId`s are not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot(u32);

impl Slot {
    fn index(self) -> usize {
        // u32 -> usize is lossless on every target Felix builds for (64-bit).
        self.0 as usize
    }
}

/// Where a catching-up shard of a subscription stands (durable streams only). A shard with a
/// cursor receives no live records: they are reached by reading (or, for `AwaitingStart`,
/// skipped until the start offset is released).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// A log read from `next` is out (queued in `poll_log_read` or with the shell).
    Reading,
    /// The next log read waits for room in the catch-up queue (`poll_delivery` issues it).
    Parked,
    /// The start offset is beyond the released records: live records below `next` are
    /// skipped, the one at `next` makes the shard live.
    AwaitingStart,
}

/// The catch-up position of one shard of a subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub(crate) shard: u32,
    /// The next offset this subscription must receive for `shard`; every record of the shard
    /// below it is queued or taken.
    pub(crate) next: u64,
    pub(crate) phase: Phase,
}

/// One subscription: which shards it covers and the records waiting for `poll_delivery`.
#[derive(Debug)]
pub(crate) struct SubState {
    pub(crate) id: SubscriptionId,
    /// The subscription's stream; deleting a stream ends its subscriptions, so the slot
    /// always holds this stream while the subscription lives.
    pub(crate) stream: StreamSlot,
    /// Subscribed shards, ascending, no duplicates, at least one.
    pub(crate) shards: Box<[u32]>,
    /// Catch-up records (from the ring, or read from the log), taken before `live`. They do
    /// not count toward the lag bounds. A shard's live records are queued only once all its
    /// catch-up records are, so taking `catch_up` first keeps per-shard order.
    pub(crate) catch_up: VecDeque<DeliveredRecord>,
    /// Live records as they are released.
    pub(crate) live: VecDeque<DeliveredRecord>,
    /// Payload bytes of the records in `live`.
    pub(crate) live_bytes: u64,
    /// Shards still catching up, ascending by shard; empty for in-memory streams, so the
    /// fan-out's per-record check is one `is_empty` on the hot path.
    pub(crate) cursors: Vec<Cursor>,
}

impl SubState {
    /// Records queued (catch-up and live).
    #[must_use]
    pub(crate) fn queued(&self) -> usize {
        self.catch_up.len() + self.live.len()
    }

    /// Whether queueing one more live record with `payload_bytes` of payload goes over the
    /// bounds. A record that finds no live record queued is always taken, so a subscriber
    /// that keeps up is never ended, however large a single record is.
    #[must_use]
    pub(crate) fn would_lag(&self, payload_bytes: u64, queue_max_bytes: u64) -> bool {
        let live_records = self.live.len();
        live_records > 0
            && (self.live_bytes.saturating_add(payload_bytes) > queue_max_bytes
                || live_records >= SUBSCRIBER_QUEUE_LIVE_RECORDS_MAX)
    }

    /// Queues a live record; returns whether the queue was empty before (a `DeliveryReady`
    /// is due).
    #[must_use]
    pub(crate) fn push_live(&mut self, record: DeliveredRecord) -> bool {
        let was_empty = self.queued() == 0;
        self.live_bytes += payload_len(&record);
        self.live.push_back(record);
        was_empty
    }

    /// Position of `shard`'s cursor in `cursors`, if the shard is still catching up.
    #[must_use]
    pub(crate) fn cursor_of(&self, shard: u32) -> Option<usize> {
        if self.cursors.is_empty() {
            return None;
        }
        self.cursors
            .binary_search_by_key(&shard, |cursor| cursor.shard)
            .ok()
    }

    /// Takes up to `max_records` records and about `max_bytes` of payload, catch-up first;
    /// at least one record if any is queued and `max_records > 0`.
    #[must_use]
    pub(crate) fn take(&mut self, max_records: usize, max_bytes: usize) -> Vec<DeliveredRecord> {
        let mut taken = Vec::with_capacity(max_records.min(self.queued()));
        let mut taken_bytes: usize = 0;
        while taken.len() < max_records {
            let from_catch_up = !self.catch_up.is_empty();
            let queue = if from_catch_up {
                &mut self.catch_up
            } else {
                &mut self.live
            };
            let Some(front) = queue.front() else {
                break;
            };
            let len = front.payload.len();
            if !taken.is_empty() && taken_bytes.saturating_add(len) > max_bytes {
                break;
            }
            let Some(record) = queue.pop_front() else {
                unreachable!("front() just returned a record");
            };
            taken_bytes = taken_bytes.saturating_add(len);
            if !from_catch_up {
                assert!(
                    self.live_bytes >= payload_len(&record),
                    "live bytes cover the queue"
                );
                self.live_bytes -= payload_len(&record);
            }
            taken.push(record);
        }
        if self.live.is_empty() {
            assert_eq!(
                self.live_bytes, 0,
                "an empty live queue holds no live bytes"
            );
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
        let live_bytes: u64 = self.live.iter().map(payload_len).sum();
        assert_eq!(
            live_bytes, self.live_bytes,
            "live bytes == sum of live payload lengths"
        );
        assert!(
            self.cursors.windows(2).all(|w| w[0].shard < w[1].shard),
            "cursors ascending by shard, unique"
        );
        for cursor in &self.cursors {
            assert!(
                self.shards.binary_search(&cursor.shard).is_ok(),
                "cursors name selected shards"
            );
        }
        // Per shard, queued offsets are dense and ascending, catch-up before live; a shard
        // still catching up has no live record queued and nothing queued at or past its cursor.
        let mut last: HashMap<u32, u64> = HashMap::new();
        for (record, live) in self
            .catch_up
            .iter()
            .map(|record| (record, false))
            .chain(self.live.iter().map(|record| (record, true)))
        {
            assert!(
                self.shards.binary_search(&record.shard).is_ok(),
                "only selected shards"
            );
            if let Some(position) = self.cursor_of(record.shard) {
                assert!(!live, "a catching-up shard has no live record queued");
                assert!(
                    record.offset < self.cursors[position].next,
                    "queued catch-up lies below the cursor"
                );
            }
            // Dense but for offsets quarantined by `felix log repair` (records lost to
            // damage), which a catch-up skips (`Engine::handle_log_skip`); the simulation's
            // clients check density end to end where nothing is quarantined.
            if let Some(previous) = last.insert(record.shard, record.offset) {
                assert!(previous < record.offset, "per-shard offsets in order");
            }
        }
        for cursor in &self.cursors {
            if let Some(&newest) = last.get(&cursor.shard) {
                assert!(
                    newest < cursor.next,
                    "the cursor follows its queued records"
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
