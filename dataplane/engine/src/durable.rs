//! Durable streams, the engine's side: log shard ids, the requests the shell carries to the
//! per-core log (appends, reads), the records it hands back, and the tracking of acked
//! publishes until every shard range they wrote is durable. Lives on the engine's core.
//!
//! The engine never touches the log (it stays sans-IO): the shell drains
//! [`crate::Engine::poll_append`] into `Log::append`, answers [`crate::Engine::poll_log_read`]
//! with `Log::read`, and reports the log's events with `handle_durable` / `handle_rejected`.

use std::collections::VecDeque;

use bytes::Bytes;
use felix_wire::{DeliveredRecord, ErrorCode};

use crate::ring::Held;
use crate::{EngineError, SubscriptionId};

/// Bits of a [`LogShardId`] that carry the shard number; the rest carry the stream id.
pub const LOG_SHARD_BITS: u32 = 12;

/// Largest catalogue stream id a durable stream may have: the 20 bits above the shard bits.
pub const DURABLE_STREAM_ID_MAX: u32 = u32::MAX >> LOG_SHARD_BITS;

/// The protocol's largest shard count fits the shard bits of a log shard id. A build whose
/// wire limits grew past it must widen `LOG_SHARD_BITS` (and migrate stored logs).
const _: () = assert!(felix_wire::Limits::DEFAULT.max_shards <= 1 << LOG_SHARD_BITS);

/// Largest shard count of a durable stream (every shard needs a log shard id).
pub const DURABLE_SHARDS_MAX: u32 = 1 << LOG_SHARD_BITS;

/// Records asked for by one log read: 256 records of 4 KiB (the reference's middle payload)
/// are 1 MiB, the byte bound below, so neither bound is much looser than the other.
pub const LOG_READ_RECORDS_MAX: usize = 256;

/// Key + payload bytes asked for by one log read: 1 MiB, four of the log's 256 KiB read
/// chunks, so one read amortises its index seek without holding much memory per subscriber.
pub const LOG_READ_BYTES_MAX: usize = 1024 * 1024;

/// Catch-up records queued for a subscription at or above which its next log read waits
/// (parked) until `poll_delivery` drains the queue below it: two reads' worth, so a reader
/// that keeps polling always has the next batch on its way. Bounds the memory a catching-up
/// subscription holds to about this plus one read per catching-up shard.
pub const CATCH_UP_REFILL_RECORDS: usize = 2 * LOG_READ_RECORDS_MAX;

/// The `shard` id of one durable (stream, shard) in the per-core log:
/// `(stream_id << LOG_SHARD_BITS) | shard`. Stable across restarts because `stream_id` comes
/// from the shell's catalogue and is never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogShardId(pub u32);

impl LogShardId {
    /// The id of `shard` of the durable stream with catalogue id `stream_id`. `None` when
    /// `stream_id > DURABLE_STREAM_ID_MAX` or `shard >= DURABLE_SHARDS_MAX`.
    #[must_use]
    pub fn new(stream_id: u32, shard: u32) -> Option<LogShardId> {
        if stream_id > DURABLE_STREAM_ID_MAX || shard >= DURABLE_SHARDS_MAX {
            return None;
        }
        Some(LogShardId((stream_id << LOG_SHARD_BITS) | shard))
    }

    /// The catalogue id of the stream.
    #[must_use]
    pub fn stream_id(self) -> u32 {
        self.0 >> LOG_SHARD_BITS
    }

    /// The shard number within the stream.
    #[must_use]
    pub fn shard(self) -> u32 {
        self.0 & (DURABLE_SHARDS_MAX - 1)
    }
}

/// A record the shell must append to the per-core log (`Log::append(log_shard.0, offset,
/// timestamp_us, &key, &payload)`), drained in publish order with
/// [`crate::Engine::poll_append`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendRequest {
    pub log_shard: LogShardId,
    pub offset: u64,
    pub timestamp_us: u64,
    pub key: Bytes,
    pub payload: Bytes,
}

/// A log read the shell must perform for a catching-up subscription (`Log::read(log_shard.0,
/// from_offset, max_records, max_bytes)`) and answer with
/// [`crate::Engine::handle_log_records`] (or [`crate::Engine::handle_log_read_too_old`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogRead {
    pub subscription: SubscriptionId,
    pub log_shard: LogShardId,
    pub from_offset: u64,
    /// At least 1; never reaches past the records the replay ring holds.
    pub max_records: usize,
    pub max_bytes: usize,
}

/// A record read back from the log (the shell maps `felix_storage::Record` to it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub offset: u64,
    pub timestamp_us: u64,
    pub key: Bytes,
    pub payload: Bytes,
}

/// The shell's name for one tracked publish (e.g. connection and request id packed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublishToken(pub u64);

/// The outcome of a tracked publish, drained with [`crate::Engine::poll_completed_publish`]:
/// `Ok` once every record is durable (send the ack), or the error to answer with
/// (`StorageFull` after a disk-full rollback, `StreamNotFound` when the stream was deleted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishCompletion {
    pub token: PublishToken,
    pub result: Result<(), EngineError>,
}

/// Totals for durable streams since start (gauges say so).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DurableCounters {
    /// Gauge: records given an offset and not yet durable (nor rolled back).
    pub records_pending: u64,
    /// Records handed to the shell as append requests.
    pub records_appended: u64,
    /// Records made durable by `handle_durable` (released to the ring and subscribers).
    pub records_durable: u64,
    /// Records dropped by `handle_rejected` (disk full) or by deleting their stream.
    pub records_rolled_back: u64,
    /// Log reads issued for catch-up.
    pub log_reads: u64,
    /// Records read from the log and queued for catch-up.
    pub log_records_read: u64,
    /// Quarantined offsets catch-up reads skipped (records lost to damage,
    /// [`crate::Engine::handle_log_skip`]).
    pub quarantine_skipped: u64,
}

/// The engine-side state of one durable shard.
#[derive(Debug)]
pub(crate) struct DurableShard {
    pub(crate) log_shard: LogShardId,
    /// Records below are durable and released (in the ring's reach and delivered live).
    pub(crate) durable: u64,
    /// The log's oldest retained offset (records below are gone); at most `durable`.
    pub(crate) log_oldest: u64,
    /// Records `durable..next_offset` waiting for `handle_durable`, oldest first, each with
    /// the buffer it keeps alive (what the ring charges once it is released).
    pub(crate) pending: VecDeque<(DeliveredRecord, Held)>,
    /// Tracked publishes waiting on this shard, by ascending end offset.
    pub(crate) waiters: VecDeque<Waiter>,
}

impl DurableShard {
    #[must_use]
    pub(crate) fn new(log_shard: LogShardId, oldest: u64, next: u64) -> DurableShard {
        assert!(
            oldest <= next,
            "the log's oldest offset is at most its next"
        );
        DurableShard {
            log_shard,
            durable: next,
            log_oldest: oldest,
            pending: VecDeque::new(),
            waiters: VecDeque::new(),
        }
    }
}

/// One shard range of a tracked publish: complete once the shard is durable through `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Waiter {
    /// End (exclusive) of the publish's range on this shard.
    pub(crate) end: u64,
    pub(crate) slot: TrackSlot,
}

/// Index of a tracked publish in the tracker's slab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TrackSlot(u32);

#[derive(Debug)]
struct Tracked {
    token: PublishToken,
    /// Shard ranges not yet resolved (durable, rolled back or deleted).
    remaining: u32,
    /// The failure already reported, if any; later resolutions report nothing.
    failed: bool,
}

/// Tracked publishes: a slab of tokens with the count of shard ranges each still waits for.
/// Each range is one `Waiter` in its shard's FIFO, resolved once, so tracking costs O(1)
/// amortized per shard range.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    slots: Vec<Option<Tracked>>,
    free: Vec<TrackSlot>,
    /// Bounded by the tracked publishes: one completion per token.
    completions: VecDeque<PublishCompletion>,
}

impl Tracker {
    /// Tracks a publish that waits for `ranges` shard ranges (at least one).
    pub(crate) fn insert(&mut self, token: PublishToken, ranges: u32) -> TrackSlot {
        assert!(ranges > 0, "a tracked publish waits for at least one range");
        let tracked = Tracked {
            token,
            remaining: ranges,
            failed: false,
        };
        if let Some(slot) = self.free.pop() {
            let entry = &mut self.slots[slot.0 as usize];
            assert!(entry.is_none(), "free slots are empty");
            *entry = Some(tracked);
            return slot;
        }
        // More than 2^32 publishes in flight would exhaust memory long before.
        let slot = TrackSlot(u32::try_from(self.slots.len()).expect("fewer than 2^32 slots"));
        self.slots.push(Some(tracked));
        slot
    }

    /// A publish that completes at once (nothing to wait for).
    pub(crate) fn complete_now(&mut self, token: PublishToken) {
        self.completions.push_back(PublishCompletion {
            token,
            result: Ok(()),
        });
    }

    /// One range of the publish in `slot` is resolved: durable (`error` None) or failed.
    pub(crate) fn resolve(&mut self, slot: TrackSlot, error: Option<&EngineError>) {
        let index = slot.0 as usize;
        let tracked = self.slots[index]
            .as_mut()
            .expect("a waiter names a tracked publish");
        assert!(tracked.remaining > 0, "a range is resolved once");
        tracked.remaining -= 1;
        if let Some(error) = error
            && !tracked.failed
        {
            tracked.failed = true;
            self.completions.push_back(PublishCompletion {
                token: tracked.token,
                result: Err(error.clone()),
            });
        }
        if tracked.remaining == 0 {
            let failed = tracked.failed;
            let token = tracked.token;
            self.slots[index] = None;
            self.free.push(slot);
            if !failed {
                self.completions.push_back(PublishCompletion {
                    token,
                    result: Ok(()),
                });
            }
        }
    }

    pub(crate) fn poll(&mut self) -> Option<PublishCompletion> {
        self.completions.pop_front()
    }

    /// Publishes still tracked.
    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Tracked publishes whose outcome is not reported yet: a failed publish whose other
    /// ranges still wait (e.g. queued for the log on a shard the rejection did not touch)
    /// stays tracked until they resolve, but its failure is already reported.
    #[must_use]
    pub(crate) fn unreported(&self) -> usize {
        self.slots.iter().flatten().filter(|t| !t.failed).count()
    }

    /// Checks that each tracked publish has exactly `remaining` waiters among `waiters`.
    pub(crate) fn assert_invariants<'a>(&self, waiters: impl Iterator<Item = &'a Waiter>) {
        let mut counted = vec![0u32; self.slots.len()];
        for waiter in waiters {
            counted[waiter.slot.0 as usize] += 1;
        }
        for (slot, count) in self.slots.iter().zip(counted) {
            match slot {
                Some(tracked) => assert_eq!(tracked.remaining, count, "one waiter per range"),
                None => assert_eq!(count, 0, "waiters name tracked publishes"),
            }
        }
        for slot in &self.free {
            assert!(
                self.slots[slot.0 as usize].is_none(),
                "free slots are empty"
            );
        }
    }
}

/// The error a tracked publish fails with when its records were rolled back (disk full).
#[must_use]
pub(crate) fn storage_full(log_shard: LogShardId, from_offset: u64) -> EngineError {
    EngineError::new(
        ErrorCode::StorageFull,
        0,
        format!(
            "the durable log's disk is full: records of shard {} from offset {from_offset} were \
             not stored",
            log_shard.shard()
        ),
    )
}
