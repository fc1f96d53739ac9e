//! The in-memory sparse per-shard index: offset -> (segment, file position).

use std::collections::VecDeque;

/// Default log distance between two index entries of one shard: 4 MiB. A read scans at
/// most about this much of the log (all shards interleaved) before it reaches its first
/// record or jumps to the next entry; the index costs at most 24 bytes per shard per 4 MiB
/// of log (~290 KB per GiB with 48 busy shards).
pub const DEFAULT_INDEX_INTERVAL_BYTES: u64 = 4 << 20;

/// One index entry: the record `offset` of a shard starts at `position` of segment `segment`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    pub offset: u64,
    pub segment: u64,
    pub position: u64,
}

/// A shard's entries, in offset order. The rule is a pure function of the record positions,
/// so recovery rebuilds exactly the index the writer built: an entry for the shard's first
/// record in each segment, and for any record at least `interval` bytes after the shard's
/// previous entry in the same segment. Hence between a record and the shard's next record
/// without an entry there are fewer than `interval` bytes of log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardIndex {
    entries: VecDeque<IndexEntry>,
}

impl ShardIndex {
    /// Notes a record written at `position` of `segment`.
    pub fn add(&mut self, offset: u64, segment: u64, position: u64, interval: u64) {
        let wanted = match self.entries.back() {
            None => true,
            Some(last) => {
                assert!(last.offset < offset, "index offsets increase");
                assert!(
                    (last.segment, last.position) < (segment, position),
                    "index positions increase"
                );
                last.segment != segment || position - last.position >= interval
            }
        };
        if wanted {
            self.entries.push_back(IndexEntry {
                offset,
                segment,
                position,
            });
        }
    }

    /// Appends an entry read from a sidecar index, which the writer built with the same rule.
    /// Panics if it does not follow the last entry (the sidecar decoder checked the order
    /// within a segment, and segments are loaded in sequence order).
    pub fn push(&mut self, entry: IndexEntry) {
        if let Some(last) = self.entries.back() {
            assert!(last.offset < entry.offset, "index offsets increase");
            assert!(
                (last.segment, last.position) < (entry.segment, entry.position),
                "index positions increase"
            );
        }
        self.entries.push_back(entry);
    }

    /// The entries of segment `seq`, in order.
    pub fn entries_in_segment(&self, seq: u64) -> impl Iterator<Item = &IndexEntry> {
        let start = self.entries.partition_point(|e| e.segment < seq);
        self.entries
            .range(start..)
            .take_while(move |e| e.segment == seq)
    }

    /// Drops the entries of segments older than `first_kept_segment`.
    pub fn drop_segments_before(&mut self, first_kept_segment: u64) {
        while self
            .entries
            .front()
            .is_some_and(|e| e.segment < first_kept_segment)
        {
            self.entries.pop_front();
        }
    }

    /// The last entry at or before `offset`, where a scan for `offset` starts.
    pub fn seek(&self, offset: u64) -> Option<IndexEntry> {
        let after = self.entries.partition_point(|e| e.offset <= offset);
        self.entries.get(after.checked_sub(1)?).copied()
    }

    /// The first entry in a segment after `segment`, where a scan that reached the end of
    /// `segment` continues.
    pub fn first_in_segment_after(&self, segment: u64) -> Option<IndexEntry> {
        let at = self.entries.partition_point(|e| e.segment <= segment);
        self.entries.get(at).copied()
    }

    /// The first entry (the shard's oldest stored record), if any.
    pub fn first(&self) -> Option<IndexEntry> {
        self.entries.front().copied()
    }

    /// All entries, oldest first.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = &IndexEntry> {
        self.entries.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_rule_and_seek() {
        // Entries appear at each segment's first record and every `interval` bytes; seek finds the floor.
        let mut ix = ShardIndex::default();
        let interval = 100;
        for i in 0..10u64 {
            ix.add(i, 0, 4096 + i * 40, interval);
        }
        ix.add(10, 1, 4096, interval);
        let offsets: Vec<u64> = ix.entries().map(|e| e.offset).collect();
        assert_eq!(offsets, vec![0, 3, 6, 9, 10]);
        assert_eq!(ix.seek(5).map(|e| e.offset), Some(3));
        assert_eq!(ix.seek(10).map(|e| e.segment), Some(1));
        assert_eq!(ix.first_in_segment_after(0).map(|e| e.offset), Some(10));
        ix.drop_segments_before(1);
        assert_eq!(ix.first().map(|e| e.offset), Some(10));
        assert!(ix.seek(3).is_none());
    }
}
