//! The replay ring of one in-memory shard: its newest records, bounded by a record count and by
//! payload bytes, oldest out first. Lives on the core that owns the shard.

use std::collections::VecDeque;
use std::collections::vec_deque;

use felix_wire::DeliveredRecord;

/// Payload length as the `u64` the byte bounds use. `usize` is at most 64 bits on every target
/// Felix builds for, so the conversion is lossless.
#[must_use]
pub(crate) fn payload_len(record: &DeliveredRecord) -> u64 {
    record.payload.len() as u64
}

/// The newest records of one shard: the longest suffix of the shard's records that fits both
/// bounds, so the offsets held are always one contiguous range ending at `next_offset - 1`.
///
/// Records are kept in their delivered form: catch-up is a `Bytes` clone (reference count
/// increments), never a copy of a payload. Once the deque has grown to the bound it never
/// allocates again.
#[derive(Debug)]
pub(crate) struct ReplayRing {
    records: VecDeque<DeliveredRecord>,
    /// Sum of `payload.len()` over `records`.
    payload_bytes: u64,
    max_records: usize,
    max_bytes: u64,
}

impl ReplayRing {
    #[must_use]
    pub(crate) fn new(max_records: usize, max_bytes: u64) -> ReplayRing {
        ReplayRing {
            records: VecDeque::new(),
            payload_bytes: 0,
            max_records,
            max_bytes,
        }
    }

    /// Whether the ring keeps anything at all (either bound at 0 disables replay).
    #[must_use]
    pub(crate) fn is_enabled(&self) -> bool {
        self.max_records > 0 && self.max_bytes > 0
    }

    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.records.len()
    }

    #[must_use]
    pub(crate) fn payload_bytes(&self) -> u64 {
        self.payload_bytes
    }

    /// Offset of the oldest record held, given the shard's `next_offset`; equals `next_offset`
    /// when the ring is empty.
    #[must_use]
    pub(crate) fn oldest_offset(&self, next_offset: u64) -> u64 {
        let held = self.records.len() as u64;
        assert!(
            held <= next_offset,
            "a ring never holds more records than were appended"
        );
        next_offset - held
    }

    /// Adds the shard's newest record, then evicts oldest first until both bounds hold.
    ///
    /// A record whose payload alone is over `max_bytes` (or any record when replay is disabled)
    /// empties the ring: the ring is a suffix of the shard, so it cannot hold older records
    /// across a record it skipped.
    pub(crate) fn push(&mut self, record: DeliveredRecord) {
        if let Some(newest) = self.records.back() {
            assert_eq!(newest.offset + 1, record.offset, "ring offsets are dense");
            assert_eq!(newest.shard, record.shard, "a ring holds one shard");
        }
        let len = payload_len(&record);
        if !self.is_enabled() || len > self.max_bytes {
            self.records.clear();
            self.payload_bytes = 0;
            return;
        }
        self.records.push_back(record);
        self.payload_bytes += len;
        while self.records.len() > self.max_records || self.payload_bytes > self.max_bytes {
            // The loop runs only while the ring is over a bound, and the newest record alone
            // is within both bounds (checked above), so an older record is always there.
            let oldest = self
                .records
                .pop_front()
                .expect("an over-bound ring holds a record older than the newest");
            self.payload_bytes -= payload_len(&oldest);
        }
        assert!(self.records.len() <= self.max_records);
        assert!(self.payload_bytes <= self.max_bytes);
    }

    /// The records from `offset` to the newest, oldest first. `offset` must lie in
    /// `oldest_offset(next_offset)..=next_offset` (the caller has checked it).
    pub(crate) fn records_from(
        &self,
        offset: u64,
        next_offset: u64,
    ) -> vec_deque::Iter<'_, DeliveredRecord> {
        let oldest = self.oldest_offset(next_offset);
        assert!(offset >= oldest, "catch-up starts inside the ring");
        assert!(
            offset <= next_offset,
            "catch-up starts at most at the next offset"
        );
        // offset - oldest <= records.len(), which is a usize.
        let skip = usize::try_from(offset - oldest).expect("skip is at most the ring length");
        self.records.range(skip..)
    }

    /// Checks every invariant of the ring; O(records held). `shard` and `next_offset` are the
    /// owning shard's.
    pub(crate) fn assert_invariants(&self, shard: u32, next_offset: u64) {
        assert!(self.records.len() <= self.max_records);
        assert!(self.payload_bytes <= self.max_bytes);
        if !self.is_enabled() {
            assert!(self.records.is_empty(), "a disabled ring holds nothing");
        }
        let oldest = self.oldest_offset(next_offset);
        let mut bytes: u64 = 0;
        for (expected, record) in (oldest..next_offset).zip(&self.records) {
            assert_eq!(
                record.offset, expected,
                "ring offsets are dense up to next_offset - 1"
            );
            assert_eq!(record.shard, shard, "a ring holds one shard");
            bytes += payload_len(record);
        }
        assert_eq!(
            bytes, self.payload_bytes,
            "ring bytes == sum of payload lengths"
        );
    }
}
