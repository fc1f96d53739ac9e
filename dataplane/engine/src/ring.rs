//! The replay ring of one in-memory shard: its newest records, bounded by a record count and by
//! the bytes of the buffers its records keep alive, oldest out first. Lives on the core that
//! owns the shard.

use std::collections::VecDeque;
use std::collections::vec_deque;

use felix_wire::DeliveredRecord;

/// Payload length as the `u64` the byte bounds use. `usize` is at most 64 bits on every target
/// Felix builds for, so the conversion is lossless.
#[must_use]
pub(crate) fn payload_len(record: &DeliveredRecord) -> u64 {
    record.payload.len() as u64
}

/// Key and payload lengths together.
#[must_use]
pub(crate) fn own_len(key: &[u8], payload: &[u8]) -> u64 {
    (key.len() + payload.len()) as u64
}

/// The buffer a record's key and payload `Bytes` keep alive (a `Bytes` slice keeps its whole
/// buffer): `id` tells buffers apart (every record sliced from one buffer has its id; the
/// engine never gives an id twice), `len` is the buffer's length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) id: u64,
    pub(crate) len: u64,
}

/// Consecutive records of the ring that keep one buffer alive.
#[derive(Debug)]
struct Run {
    held: Held,
    records: usize,
}

/// The newest records of one shard: the longest suffix of the shard's records that fits both
/// bounds, so the offsets held are always one contiguous range ending at `next_offset - 1`.
///
/// Records are kept in their delivered form: catch-up is a `Bytes` clone (reference count
/// increments), never a copy of a payload. Once the deques have grown to the bound they never
/// allocate again.
///
/// The byte bound counts what the records keep alive, not their payload lengths: each buffer
/// the records are slices of ([`Held`]) is charged once while the ring holds any record of it.
/// Records of one buffer enter consecutively (the records of one publish in one shard), so the
/// buffers form runs over the record deque: charged when a run starts, released when its last
/// record is evicted, O(1) per record. A buffer whose records are not consecutive (never the
/// case for the engine's) is charged once per run: over-counted, never under.
#[derive(Debug)]
pub(crate) struct ReplayRing {
    records: VecDeque<DeliveredRecord>,
    /// The buffers of `records`, oldest first; their record counts sum to `records.len()`.
    runs: VecDeque<Run>,
    /// Sum of `held.len` over `runs`.
    held_bytes: u64,
    max_records: usize,
    max_bytes: u64,
}

impl ReplayRing {
    #[must_use]
    pub(crate) fn new(max_records: usize, max_bytes: u64) -> ReplayRing {
        ReplayRing {
            records: VecDeque::new(),
            runs: VecDeque::new(),
            held_bytes: 0,
            max_records,
            max_bytes,
        }
    }

    /// Whether the ring keeps anything at all (either bound at 0 disables replay).
    #[must_use]
    pub(crate) fn is_enabled(&self) -> bool {
        self.max_records > 0 && self.max_bytes > 0
    }

    /// The byte bound.
    #[must_use]
    pub(crate) fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.records.len()
    }

    /// Bytes of the buffers the held records keep alive, each counted once.
    #[must_use]
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held_bytes
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

    /// Adds the shard's newest record, which keeps `held` alive, then evicts oldest first until
    /// both bounds hold.
    ///
    /// A record whose buffer alone is over `max_bytes` (or any record when replay is disabled)
    /// empties the ring: the ring is a suffix of the shard, so it cannot hold older records
    /// across a record it skipped.
    pub(crate) fn push(&mut self, record: DeliveredRecord, held: Held) {
        if let Some(newest) = self.records.back() {
            assert_eq!(newest.offset + 1, record.offset, "ring offsets are dense");
            assert_eq!(newest.shard, record.shard, "a ring holds one shard");
        }
        assert!(
            held.len >= payload_len(&record),
            "a buffer holds its records' payloads"
        );
        if !self.is_enabled() || held.len > self.max_bytes {
            self.records.clear();
            self.runs.clear();
            self.held_bytes = 0;
            return;
        }
        self.records.push_back(record);
        match self.runs.back_mut() {
            Some(run) if run.held.id == held.id => {
                assert_eq!(run.held.len, held.len, "one buffer has one length");
                run.records += 1;
            }
            _ => {
                self.runs.push_back(Run { held, records: 1 });
                self.held_bytes += held.len;
            }
        }
        while self.records.len() > self.max_records || self.held_bytes > self.max_bytes {
            // The loop runs only while the ring is over a bound, and the newest record and its
            // buffer alone are within both bounds (checked above), so an older record is
            // always there.
            self.records
                .pop_front()
                .expect("an over-bound ring holds a record older than the newest");
            let oldest = self.runs.front_mut().expect("every record is in a run");
            oldest.records -= 1;
            if oldest.records == 0 {
                self.held_bytes -= oldest.held.len;
                self.runs.pop_front();
            }
        }
        assert!(self.records.len() <= self.max_records);
        assert!(self.held_bytes <= self.max_bytes);
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
        assert!(self.held_bytes <= self.max_bytes);
        if !self.is_enabled() {
            assert!(self.records.is_empty(), "a disabled ring holds nothing");
        }
        let oldest = self.oldest_offset(next_offset);
        for (expected, record) in (oldest..next_offset).zip(&self.records) {
            assert_eq!(
                record.offset, expected,
                "ring offsets are dense up to next_offset - 1"
            );
            assert_eq!(record.shard, shard, "a ring holds one shard");
        }
        let mut bytes: u64 = 0;
        let mut records: usize = 0;
        let mut held = self.records.iter();
        for (index, run) in self.runs.iter().enumerate() {
            assert!(run.records > 0, "a run holds a record");
            if index > 0 {
                assert_ne!(
                    self.runs[index - 1].held.id,
                    run.held.id,
                    "a buffer's consecutive records are one run"
                );
            }
            for record in held.by_ref().take(run.records) {
                assert!(run.held.len >= payload_len(record));
            }
            bytes += run.held.len;
            records += run.records;
        }
        assert_eq!(records, self.records.len(), "every record is in one run");
        assert_eq!(
            bytes, self.held_bytes,
            "ring bytes == sum of the held buffers' lengths"
        );
    }

    /// The buffers the ring holds, oldest first (tests).
    #[cfg(test)]
    fn buffers(&self) -> Vec<(u64, u64, usize)> {
        self.runs
            .iter()
            .map(|run| (run.held.id, run.held.len, run.records))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    /// A record of shard 0 at `offset` whose payload is `payload_len` bytes of `buffer`.
    fn sliced(buffer: &Bytes, offset: u64, payload_len: usize) -> DeliveredRecord {
        DeliveredRecord {
            shard: 0,
            offset,
            timestamp_us: 1,
            key: Bytes::new(),
            payload: buffer.slice(..payload_len),
        }
    }

    #[test]
    fn records_of_one_buffer_charge_it_once() {
        // Proves records sliced from one buffer count the buffer once, however many the ring
        // holds, and each distinct buffer counts its whole length.
        let mut ring = ReplayRing::new(100, 10_000);
        let frame = Bytes::from(vec![7u8; 4_000]);
        for offset in 0..10 {
            ring.push(sliced(&frame, offset, 10), Held { id: 1, len: 4_000 });
        }
        assert_eq!(ring.len(), 10);
        assert_eq!(ring.held_bytes(), 4_000);
        let other = Bytes::from(vec![7u8; 3_000]);
        ring.push(sliced(&other, 10, 10), Held { id: 2, len: 3_000 });
        assert_eq!(ring.held_bytes(), 7_000);
        assert_eq!(ring.buffers(), vec![(1, 4_000, 10), (2, 3_000, 1)]);
        ring.assert_invariants(0, 11);
    }

    #[test]
    fn a_byte_bound_evicts_as_the_held_buffers_require() {
        // Proves a ring bounded at 10,000 bytes holding 10-byte records sliced from 4,000-byte
        // buffers keeps only two buffers' records (8,000 bytes), where payload counting would
        // have kept all 30 records (300 bytes) and 12,000 bytes alive.
        let mut ring = ReplayRing::new(1_000, 10_000);
        let mut offset = 0;
        for id in 0..3 {
            let frame = Bytes::from(vec![1u8; 4_000]);
            for _ in 0..10 {
                ring.push(sliced(&frame, offset, 10), Held { id, len: 4_000 });
                offset += 1;
                assert!(ring.held_bytes() <= 10_000);
                ring.assert_invariants(0, offset);
            }
        }
        assert_eq!(ring.held_bytes(), 8_000);
        assert_eq!(ring.len(), 20);
        assert_eq!(ring.oldest_offset(offset), 10);
        assert_eq!(ring.buffers(), vec![(1, 4_000, 10), (2, 4_000, 10)]);
    }

    #[test]
    fn evicting_the_last_record_of_a_buffer_releases_it() {
        // Proves a buffer stays charged while any of its records is held, and is released
        // exactly when its last record leaves (here by the record-count bound).
        let mut ring = ReplayRing::new(3, 1_000_000);
        let first = Bytes::from(vec![0u8; 5_000]);
        let second = Bytes::from(vec![0u8; 6_000]);
        ring.push(sliced(&first, 0, 1), Held { id: 1, len: 5_000 });
        ring.push(sliced(&first, 1, 1), Held { id: 1, len: 5_000 });
        ring.push(sliced(&second, 2, 1), Held { id: 2, len: 6_000 });
        assert_eq!(ring.held_bytes(), 11_000);
        // Offset 0 leaves: offset 1 still keeps the first buffer.
        ring.push(sliced(&second, 3, 1), Held { id: 2, len: 6_000 });
        assert_eq!(ring.held_bytes(), 11_000);
        assert_eq!(ring.buffers(), vec![(1, 5_000, 1), (2, 6_000, 2)]);
        // Offset 1, the first buffer's last record, leaves: the buffer is released.
        ring.push(sliced(&second, 4, 1), Held { id: 2, len: 6_000 });
        assert_eq!(ring.held_bytes(), 6_000);
        assert_eq!(ring.buffers(), vec![(2, 6_000, 3)]);
        ring.assert_invariants(0, 5);
    }

    #[test]
    fn a_buffer_over_the_bound_empties_the_ring() {
        // Proves a record whose buffer alone is over the byte bound is not kept, and the ring
        // stays a suffix of the shard (empty).
        let mut ring = ReplayRing::new(10, 1_000);
        let small = Bytes::from(vec![0u8; 100]);
        ring.push(sliced(&small, 0, 100), Held { id: 1, len: 100 });
        let huge = Bytes::from(vec![0u8; 2_000]);
        ring.push(sliced(&huge, 1, 1), Held { id: 2, len: 2_000 });
        assert_eq!(ring.len(), 0);
        assert_eq!(ring.held_bytes(), 0);
        ring.assert_invariants(0, 2);
    }
}
