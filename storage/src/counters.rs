//! Plain counters the broker exports; no metrics crate.
//!
//! Threads: updated and read on the log's core thread.

use std::cell::Cell;
use std::time::Duration;

/// Buckets of [`LatencyHistogram`]: bucket `i` counts samples in `[2^i, 2^(i+1))` microseconds
/// (bucket 0 also takes 0 us). 32 buckets reach 2^32 us = 71 minutes, past any real fsync.
pub const LATENCY_BUCKETS: usize = 32;

/// A log2 histogram of durations in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    pub buckets: [u64; LATENCY_BUCKETS],
    pub count: u64,
    pub sum_us: u64,
    pub max_us: u64,
}

impl LatencyHistogram {
    /// Adds one sample.
    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let bucket = (63 - us.max(1).leading_zeros()) as usize;
        self.buckets[bucket.min(LATENCY_BUCKETS - 1)] += 1;
        self.count += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        self.max_us = self.max_us.max(us);
    }

    /// Upper bound (exclusive, in microseconds) of the bucket holding quantile `q` (0..=1),
    /// or `None` without samples.
    pub fn quantile_upper_us(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(1u64 << (i + 1));
            }
        }
        Some(self.max_us)
    }

    /// Mean in microseconds, or 0 without samples.
    pub fn mean_us(&self) -> u64 {
        self.sum_us.checked_div(self.count).unwrap_or(0)
    }
}

/// Counters of one log (one data-plane core). Byte counts follow `docs/storage-format.md`:
/// `append_bytes == 28 * records + body_bytes` and
/// `body_bytes == key_bytes + payload_bytes`.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// Records written to the log (counted when their write completes).
    pub records: u64,
    /// Bytes of those records as framed on disk: 28 bytes of framing + body each.
    pub append_bytes: u64,
    /// Record bodies: key + payload.
    pub body_bytes: u64,
    /// Key bytes alone.
    pub key_bytes: u64,
    /// Payload bytes alone (what the broker calls payload).
    pub payload_bytes: u64,
    /// Completed rounds (writes, with or without a linked fdatasync; sync-only rounds too).
    pub rounds: u64,
    /// Bytes submitted to writes: records plus zero fill over a failed write's tail.
    pub write_bytes: u64,
    /// Completed fdatasyncs.
    pub fsyncs: u64,
    /// Records made durable by those fsyncs (fan-in: `fsync_records / fsyncs`).
    pub fsync_records: u64,
    /// Framed bytes made durable by those fsyncs.
    pub fsync_bytes: u64,
    /// Records rejected because the disk was full.
    pub rejected_records: u64,
    pub segments_created: u64,
    /// Segments whose file was made ahead, off the log's thread (`ahead.rs`).
    pub segments_made_ahead: u64,
    /// Time the log's thread spent starting each segment (header, fsyncs, rename; plus the
    /// preallocation when the file was not made ahead), sidecar of the closing one excluded.
    pub segment_start_latency: LatencyHistogram,
    pub segments_deleted: u64,
    /// Segment bytes (file sizes) deleted by retention.
    pub retention_deleted_bytes: u64,
    /// fdatasync latency as measured by the backend.
    pub fsync_latency: LatencyHistogram,
    /// Write latency (submission to completion of the write part) as measured by the backend.
    pub write_latency: LatencyHistogram,
    /// Records, bytes and time of the recovery at open.
    pub recovery_records: u64,
    pub recovery_bytes: u64,
    pub recovery_truncated_bytes: u64,
    pub recovery_us: u64,
    /// Closed segments recovery read from their sidecar index instead of scanning them, and
    /// bytes it scanned (the active segment, plus closed ones without a usable sidecar).
    pub recovery_sidecar_segments: u64,
    pub recovery_scanned_bytes: u64,
    /// Sidecar indexes written (when a segment closes, or by recovery for one without).
    pub sidecars_written: u64,
    /// Commit marks: idle rounds that wrote only a mark (+ fdatasync), and mark bytes written
    /// (marks in record rounds included; not in `write_bytes`).
    pub mark_rounds: u64,
    pub mark_bytes: u64,
    /// Gauge: offsets in the log's quarantined ranges (records lost to damage and quarantined
    /// by `felix log repair`); set at open.
    pub quarantined_records: u64,
    /// Quarantined offsets that reads skipped (each read that crosses a range counts it).
    /// A `Cell` because reads take `&self`; the log lives on one thread.
    pub quarantine_skipped_records: Cell<u64>,
    /// Catch-up read chunks (`log::READ_CHUNK_BYTES`) `Log::try_read` found in memory without
    /// blocking: in the page cache (`preadv2(RWF_NOWAIT)`), or among the chunks fetched for
    /// reads that waited (`reader.rs`). `Cell`s like the one above.
    pub read_cache_hits: Cell<u64>,
    /// Chunks the log's reader thread read from the disk for reads that missed the page
    /// cache (each such read answered later, off the core's thread).
    pub read_fetches: Cell<u64>,
    /// Segments and file bytes given back by releasing deleted streams' shards.
    pub released_segments: u64,
    pub released_bytes: u64,
    /// Rounds written with O_DIRECT (`LogConfig::direct_io`), and those whose tail block had
    /// to be read back from the file first (after recovery or a failed round).
    pub direct_rounds: u64,
    pub direct_tail_reads: u64,
    /// Zeros direct writes put past their rounds: padding to the block, and the zeros
    /// written ahead of small rounds (`log::ZERO_AHEAD_BYTES`).
    pub direct_padding_bytes: u64,
    /// Direct rounds submitted with nothing behind them, whose write the backend may make
    /// durable itself (RWF_DSYNC on io_uring) instead of an fdatasync after it.
    pub sync_by_write_rounds: u64,
    /// Records rounds submitted while another round was in flight (its write finished, its
    /// fdatasync still running; `LogConfig::rounds_in_flight`).
    pub overlapped_rounds: u64,
    /// Completions that came back before an older round's and were held until it completed
    /// (the log applies completions in round order).
    pub held_completions: u64,
    /// Rounds rejected because the round before them failed with ENOSPC while they were in
    /// flight (their bytes sit past the failed write).
    pub doomed_rounds: u64,
}

impl Counters {
    /// Average records per fsync (group-commit fan-in), 0 before the first fsync.
    pub fn records_per_fsync(&self) -> f64 {
        if self.fsyncs == 0 {
            0.0
        } else {
            self.fsync_records as f64 / self.fsyncs as f64
        }
    }

    /// Average framed bytes per fsync, 0 before the first fsync.
    pub fn bytes_per_fsync(&self) -> f64 {
        if self.fsyncs == 0 {
            0.0
        } else {
            self.fsync_bytes as f64 / self.fsyncs as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_quantiles() {
        // Samples land in log2 buckets and quantiles report the bucket's upper bound.
        let mut h = LatencyHistogram::default();
        for us in [0u64, 1, 100, 120, 130, 1000] {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count, 6);
        assert_eq!(h.buckets[0], 2);
        assert_eq!(h.buckets[6], 2); // 100, 120 in [64, 128)
        assert_eq!(h.buckets[7], 1); // 130 in [128, 256)
        assert_eq!(h.quantile_upper_us(0.5), Some(128));
        assert_eq!(h.quantile_upper_us(1.0), Some(1024));
        assert_eq!(h.max_us, 1000);
    }
}
