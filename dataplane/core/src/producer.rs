//! Idempotent producers on the single broker (docs/semantics.md, "Idempotent producers"): per
//! shard, per producer, the last [`WINDOW`] batches' sequences and acks, kept by the core that
//! owns the shard. The rules follow the replicated shard's (cluster/src/shard.rs): a producer
//! numbers its batches on a shard 1, 2, 3, ...; sequence 0 asks for no deduplication.
//!
//! Checked once per `ProducerPublish` batch (one shard per batch): two hash lookups and a
//! slot of a fixed array, no allocation for a producer already known. A producer's first batch
//! on a shard inserts one map entry; once a shard remembers [`PRODUCERS_PER_SHARD_MAX`]
//! producers, a new one evicts the least recently used (a scan of that shard's table, on new
//! producers only, never per batch of a known one).

use felix_engine::StreamHandle;
use felix_wire::ShardAck;
use rustc_hash::FxHashMap;

/// Batches remembered per producer and shard: a producer may have this many batches of one
/// shard in flight (pipelined) and still have each retry answered with its original ack.
pub const WINDOW: usize = 5;

/// Producers remembered per shard; beyond it the least recently used one is forgotten (its
/// retries then get `OutOfSequence` with `detail` 1: the shard takes it as a new producer,
/// whose first batch is 1).
pub const PRODUCERS_PER_SHARD_MAX: usize = 1024;

/// The producer fields of a `ProducerPublish`: carried with its records to the shard's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerTag {
    pub producer: u64,
    pub sequence: u64,
    /// The one shard every record of the batch belongs to.
    pub shard: u32,
}

/// A durable producer batch the engine tracks until committed: settled into the table then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Produced {
    pub(crate) key: ShardKey,
    pub(crate) producer: u64,
    pub(crate) sequence: u64,
}

/// A shard of a stream of this core's engine.
pub(crate) type ShardKey = (StreamHandle, u32);

/// One remembered batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slot {
    sequence: u64,
    first_offset: u64,
    count: u32,
    /// The engine token of a durable batch not yet committed; 0 once committed (or in-memory).
    pending: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct ProducerState {
    /// The last sequence accepted (0: none).
    last: u64,
    /// Slot `sequence % WINDOW` holds that batch, if within the window.
    slots: [Slot; WINDOW],
    /// Tick of the last batch (for the least-recently-used eviction).
    used: u64,
}

#[derive(Debug, Default)]
struct ShardProducers {
    producers: FxHashMap<u64, ProducerState>,
}

/// What to do with a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Store it (then call [`Producers::accepted`]).
    New,
    /// Stored before and committed: answer this ack, store nothing.
    Duplicate(ShardAck),
    /// Stored before but not yet committed (durable): answer `Unavailable`, store nothing;
    /// a later retry gets the original ack.
    InFlight,
    /// Refused with `OutOfSequence`, `detail` = `expected` (1 when the producer is unknown on
    /// this shard, or forgotten: a new producer starts at 1), nothing stored.
    OutOfSequence { expected: u64, reason: &'static str },
}

/// Every shard's producers on one core.
#[derive(Debug, Default)]
pub(crate) struct Producers {
    shards: FxHashMap<ShardKey, ShardProducers>,
    tick: u64,
    /// Producers forgotten to make room (a counter for the metrics).
    pub(crate) evictions: u64,
}

impl Producers {
    /// The verdict on batch `sequence` of `producer` on shard `key`.
    pub(crate) fn check(&mut self, key: ShardKey, producer: u64, sequence: u64) -> Verdict {
        if sequence == 0 {
            return Verdict::New;
        }
        self.tick += 1;
        let state = self
            .shards
            .get_mut(&key)
            .and_then(|shard| shard.producers.get_mut(&producer));
        let Some(state) = state else {
            return if sequence == 1 {
                Verdict::New
            } else {
                // Expected 1: a client whose batch 1 was refused (ingress full) while its
                // batches 2.. were on their way retries them behind batch 1's own retry.
                Verdict::OutOfSequence {
                    expected: 1,
                    reason: "this shard knows no batch of the producer (a first batch is \
                             sequence 1; a producer forgotten after a restart or an eviction \
                             starts again with a new id)",
                }
            };
        };
        state.used = self.tick;
        let last = state.last;
        if sequence == last + 1 {
            return Verdict::New;
        }
        if sequence > last {
            return Verdict::OutOfSequence {
                expected: last + 1,
                reason: "the sequence skips ahead of the producer's next one",
            };
        }
        let slot = state.slots[slot_of(sequence)];
        if last - sequence >= WINDOW as u64 || slot.sequence != sequence {
            return Verdict::OutOfSequence {
                expected: last + 1,
                reason: "the sequence was stored before, longer ago than the batches the \
                         shard remembers per producer",
            };
        }
        if slot.pending != 0 {
            return Verdict::InFlight;
        }
        Verdict::Duplicate(ShardAck {
            shard: key.1,
            first_offset: slot.first_offset,
            count: slot.count,
        })
    }

    /// Batch `sequence` of `producer` was given `first_offset..first_offset + count` on shard
    /// `key`; `pending` is its engine token while it is not committed (0 when it is).
    pub(crate) fn accepted(
        &mut self,
        key: ShardKey,
        producer: u64,
        sequence: u64,
        ack: &ShardAck,
        pending: u64,
    ) {
        if sequence == 0 {
            return;
        }
        let tick = self.tick;
        let shard = self.shards.entry(key).or_default();
        if !shard.producers.contains_key(&producer)
            && shard.producers.len() >= PRODUCERS_PER_SHARD_MAX
        {
            let oldest = shard
                .producers
                .iter()
                .min_by_key(|(_, state)| state.used)
                .map(|(id, _)| *id);
            if let Some(oldest) = oldest {
                shard.producers.remove(&oldest);
                self.evictions += 1;
            }
        }
        let state = shard.producers.entry(producer).or_default();
        state.last = sequence;
        state.used = tick;
        state.slots[slot_of(sequence)] = Slot {
            sequence,
            first_offset: ack.first_offset,
            count: ack.count,
            pending,
        };
    }

    /// The durable batch `sequence` (engine token `token`) committed (`ok`) or failed. A
    /// failed batch and the producer's later ones are forgotten (the log rolled the shard
    /// back: they were not stored), so a retry stores them again.
    pub(crate) fn settled(
        &mut self,
        key: ShardKey,
        producer: u64,
        sequence: u64,
        token: u64,
        ok: bool,
    ) {
        let Some(state) = self
            .shards
            .get_mut(&key)
            .and_then(|shard| shard.producers.get_mut(&producer))
        else {
            return;
        };
        let slot = &mut state.slots[slot_of(sequence)];
        if slot.sequence != sequence || slot.pending != token {
            return;
        }
        if ok {
            slot.pending = 0;
            return;
        }
        for slot in &mut state.slots {
            if slot.sequence >= sequence {
                *slot = Slot::default();
            }
        }
        state.last = sequence - 1;
    }

    /// Forgets the shards of a deleted stream.
    pub(crate) fn forget_stream(&mut self, handle: StreamHandle) {
        self.shards.retain(|key, _| key.0 != handle);
    }
}

fn slot_of(sequence: u64) -> usize {
    // WINDOW is tiny: the remainder fits a usize.
    (sequence % WINDOW as u64) as usize
}

// ---- the producer journal of durable shards ----

/// The bit a durable stream's catalogue id gets in the log shard ids of its shards' producer
/// journals (docs/storage-format.md, "Producer journals"): journal of shard `s` of stream
/// `id` = `LogShardId::new(id | JOURNAL_STREAM_BIT, s)`. Streams whose id has this bit
/// already (the 524,288th durable stream created and later ones) keep no journal: their
/// producers are remembered in memory only.
pub const JOURNAL_STREAM_BIT: u32 = 1 << 19;

/// Journal records read back per shard at start-up (the newest): the producers of those
/// batches are remembered across the restart.
pub const JOURNAL_TAIL_RECORDS: u64 = 8192;

/// Payload bytes of a journal record: kind (1), producer (8), sequence (8), first offset
/// (8), count (4).
pub const JOURNAL_RECORD_BYTES: usize = 1 + 8 + 8 + 8 + 4;

/// A journal record: a producer batch stored at `first_offset..first_offset + count`.
const KIND_BATCH: u8 = 1;
/// A journal record: the data shard was rolled back to `first_offset` (a refused write);
/// batches recorded before it at or past that offset were not stored.
const KIND_ROLLBACK: u8 = 2;

/// The journal's log shard id of data log shard `data`, if its stream keeps one.
#[must_use]
pub fn journal_of(data: felix_engine::LogShardId) -> Option<felix_engine::LogShardId> {
    let stream_id = data.stream_id();
    if stream_id & JOURNAL_STREAM_BIT != 0 {
        return None;
    }
    felix_engine::LogShardId::new(stream_id | JOURNAL_STREAM_BIT, data.shard())
}

/// Whether log shard `shard` is a producer journal.
#[must_use]
pub fn is_journal(shard: u32) -> bool {
    felix_engine::LogShardId(shard).stream_id() & JOURNAL_STREAM_BIT != 0
}

/// The catalogue id of the stream whose data or journal log shard `shard` is.
#[must_use]
pub fn owning_stream_id(shard: u32) -> u32 {
    felix_engine::LogShardId(shard).stream_id() & !JOURNAL_STREAM_BIT
}

/// A durable producer batch the engine queued: its journal record goes to the log right
/// before the batch's first record (`DurableLog`, the pump).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalEntry {
    pub log_shard: felix_engine::LogShardId,
    pub first_offset: u64,
    pub count: u32,
    pub producer: u64,
    pub sequence: u64,
}

/// A journal record's payload for batch `entry`.
#[must_use]
pub fn batch_record(entry: &JournalEntry) -> [u8; JOURNAL_RECORD_BYTES] {
    encode_record(
        KIND_BATCH,
        entry.producer,
        entry.sequence,
        entry.first_offset,
        entry.count,
    )
}

/// A journal record's payload for a rollback of the data shard to `from_offset`.
#[must_use]
pub fn rollback_record(from_offset: u64) -> [u8; JOURNAL_RECORD_BYTES] {
    encode_record(KIND_ROLLBACK, 0, 0, from_offset, 0)
}

fn encode_record(
    kind: u8,
    producer: u64,
    sequence: u64,
    first_offset: u64,
    count: u32,
) -> [u8; JOURNAL_RECORD_BYTES] {
    let mut out = [0u8; JOURNAL_RECORD_BYTES];
    out[0] = kind;
    out[1..9].copy_from_slice(&producer.to_le_bytes());
    out[9..17].copy_from_slice(&sequence.to_le_bytes());
    out[17..25].copy_from_slice(&first_offset.to_le_bytes());
    out[25..29].copy_from_slice(&count.to_le_bytes());
    out
}

/// One batch as recovered from a journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Journaled {
    pub(crate) producer: u64,
    pub(crate) sequence: u64,
    pub(crate) first_offset: u64,
    pub(crate) count: u32,
}

/// The batches a journal's records (oldest first) still vouch for: those no later rollback
/// took back and whose records the data shard holds (`data_next`: its next offset), oldest
/// first. Records it cannot parse are skipped (counted in the returned number).
pub(crate) fn replay_journal<'a>(
    payloads: impl Iterator<Item = &'a [u8]>,
    data_next: u64,
) -> (Vec<Journaled>, usize) {
    let mut batches: Vec<Journaled> = Vec::new();
    let mut skipped = 0;
    for payload in payloads {
        let Ok(bytes) = <[u8; JOURNAL_RECORD_BYTES]>::try_from(payload) else {
            skipped += 1;
            continue;
        };
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let first_offset = u64_at(17);
        match bytes[0] {
            KIND_BATCH => batches.push(Journaled {
                producer: u64_at(1),
                sequence: u64_at(9),
                first_offset,
                count: u32::from_le_bytes(bytes[25..29].try_into().expect("4 bytes")),
            }),
            KIND_ROLLBACK => {
                batches.retain(|batch| batch.first_offset + u64::from(batch.count) <= first_offset)
            }
            _ => skipped += 1,
        }
    }
    batches.retain(|batch| batch.first_offset + u64::from(batch.count) <= data_next);
    (batches, skipped)
}

impl Producers {
    /// Rebuilds shard `key`'s producers from its journal's batches, oldest first (start-up).
    pub(crate) fn restore(&mut self, key: ShardKey, batches: &[Journaled]) {
        for batch in batches {
            self.tick += 1;
            let ack = ShardAck {
                shard: key.1,
                first_offset: batch.first_offset,
                count: batch.count,
            };
            self.accepted(key, batch.producer, batch.sequence, &ack, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(producer: u64, sequence: u64, first_offset: u64, count: u32) -> JournalEntry {
        JournalEntry {
            log_shard: felix_engine::LogShardId(0),
            first_offset,
            count,
            producer,
            sequence,
        }
    }

    #[test]
    fn replay_keeps_what_no_rollback_took_back_and_the_shard_holds() {
        // Proves the journal replay rules: a rollback record drops the batches before it that
        // reach past its offset (not those wholly below it, nor later ones), a batch reaching
        // past the data shard's next offset is dropped, and an unknown record is skipped.
        let records = [
            batch_record(&batch(1, 1, 0, 2)),
            batch_record(&batch(1, 2, 2, 3)),
            rollback_record(3),
            batch_record(&batch(1, 2, 3, 3)),
            batch_record(&batch(2, 1, 6, 4)),
        ];
        let mut unknown = [0u8; JOURNAL_RECORD_BYTES];
        unknown[0] = 9;
        let payloads = records
            .iter()
            .map(|record| &record[..])
            .chain([&unknown[..], &[1u8, 2, 3][..]]);
        let (batches, skipped) = replay_journal(payloads, 8);
        let kept: Vec<(u64, u64, u64)> = batches
            .iter()
            .map(|batch| (batch.producer, batch.sequence, batch.first_offset))
            .collect();
        assert_eq!(kept, vec![(1, 1, 0), (1, 2, 3)]);
        assert_eq!(skipped, 2);
    }

    #[test]
    fn journal_ids_are_apart_from_data_ids_and_map_back() {
        // Proves a journal's log shard id is never a data shard's, names the same stream and
        // shard, and a stream with the journal bit keeps none.
        let data = felix_engine::LogShardId::new(7, 42).expect("valid");
        let journal = journal_of(data).expect("a journal");
        assert_ne!(journal, data);
        assert!(is_journal(journal.0) && !is_journal(data.0));
        assert_eq!(owning_stream_id(journal.0), 7);
        assert_eq!(owning_stream_id(data.0), 7);
        assert_eq!(journal.shard(), 42);
        let high = felix_engine::LogShardId::new(JOURNAL_STREAM_BIT | 7, 0).expect("valid");
        assert_eq!(journal_of(high), None);
    }
}
