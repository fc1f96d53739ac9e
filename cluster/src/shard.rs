//! A replicated shard: the [`Machine`] a shard's Raft group applies (docs/cluster.md,
//! "Replicated shards"). Each Raft entry carries one publish batch; applying an entry gives
//! its records the shard's next dense offsets, so offsets are dense and in one order on every
//! replica and across leader changes (a new leader applies the same committed entries).
//!
//! Publishers are idempotent: a batch carries its producer id and a sequence number that
//! grows by one per batch. A batch whose sequence was already applied (a retry after a lost
//! ack or a leader change, which may commit both the original and the retry) is applied as a
//! *duplicate*: it takes no offsets and answers with the offsets the original got, so every
//! acknowledged record is in the shard exactly once.
//!
//! Only applied (committed) entries get offsets, so a reader that reads by offset reads
//! committed records only, on any replica.

use std::collections::BTreeMap;

use bytes::{Buf, BufMut, Bytes};
use serde::{Deserialize, Serialize};

use crate::node::Machine;

/// Bytes before the records of an encoded batch: producer, sequence, record count.
const BATCH_HEADER_BYTES: usize = 8 + 8 + 4;
/// Set in an encoded batch's record count when the client's producer id and sequence follow
/// the count (16 bytes): a batch published through `ProducerPublish` (docs/wire-protocol.md).
const CLIENT_FLAG: u32 = 1 << 31;
/// Bytes of the client's producer id and sequence.
const CLIENT_BYTES: usize = 8 + 8;
/// An encoded batch's header: producer, sequence, record count, the client's producer id and
/// sequence.
type FullHeader = (u64, u64, u32, Option<(u64, u64)>);
/// Bytes before each record's key: key length, payload length, timestamp.
const RECORD_HEADER_BYTES: usize = 2 + 4 + 8;

/// One record of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardRecord {
    pub timestamp_us: u64,
    pub key: Bytes,
    pub payload: Bytes,
}

/// A publish batch as a Raft entry carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub producer: u64,
    /// The producer's batch number on this shard, from 1, one more per batch.
    pub sequence: u64,
    /// The client's producer id and sequence, when the client published it as an idempotent
    /// producer: the shard applies each once, however many members it was retried through.
    pub client: Option<(u64, u64)>,
    pub records: Vec<ShardRecord>,
}

impl Batch {
    /// The entry data of this batch.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let body: usize = self
            .records
            .iter()
            .map(|r| RECORD_HEADER_BYTES + r.key.len() + r.payload.len())
            .sum();
        let mut out = Vec::with_capacity(BATCH_HEADER_BYTES + CLIENT_BYTES + body);
        out.put_u64(self.producer);
        out.put_u64(self.sequence);
        let count = u32::try_from(self.records.len()).expect("a batch below 2^31 records");
        assert!(count < CLIENT_FLAG, "a batch below 2^31 records");
        match self.client {
            Some((producer, sequence)) => {
                out.put_u32(count | CLIENT_FLAG);
                out.put_u64(producer);
                out.put_u64(sequence);
            }
            None => out.put_u32(count),
        }
        for record in &self.records {
            out.put_u16(u16::try_from(record.key.len()).expect("a key below 64 KiB"));
            out.put_u32(u32::try_from(record.payload.len()).expect("a payload below 4 GiB"));
            out.put_u64(record.timestamp_us);
            out.put_slice(&record.key);
            out.put_slice(&record.payload);
        }
        out
    }

    /// Reads only the header: producer, sequence and record count.
    pub fn header(data: &[u8]) -> Result<(u64, u64, u32), String> {
        let (producer, sequence, count, _) = Batch::full_header(data)?;
        Ok((producer, sequence, count))
    }

    /// The header with the client's producer id and sequence, if any, and where the records
    /// start.
    fn full_header(data: &[u8]) -> Result<FullHeader, String> {
        if data.len() < BATCH_HEADER_BYTES {
            return Err(format!("a batch of {} bytes has no header", data.len()));
        }
        let mut buf = data;
        let (producer, sequence, count) = (buf.get_u64(), buf.get_u64(), buf.get_u32());
        if count & CLIENT_FLAG == 0 {
            return Ok((producer, sequence, count, None));
        }
        if buf.len() < CLIENT_BYTES {
            return Err("a batch's client producer fields are cut short".to_owned());
        }
        let client = (buf.get_u64(), buf.get_u64());
        Ok((producer, sequence, count & !CLIENT_FLAG, Some(client)))
    }

    /// Decodes an entry's data; the records share `data`'s buffer.
    pub fn decode(data: &Bytes) -> Result<Batch, String> {
        let (producer, sequence, count, client) = Batch::full_header(data)?;
        let mut at = BATCH_HEADER_BYTES + if client.is_some() { CLIENT_BYTES } else { 0 };
        let mut records = Vec::with_capacity(usize::try_from(count).unwrap_or(0).min(1 << 16));
        for index in 0..count {
            let short = || format!("record {index} of {count} runs past the batch's end");
            let header = data.get(at..at + RECORD_HEADER_BYTES).ok_or_else(short)?;
            let mut header = header;
            let key_len = usize::from(header.get_u16());
            let payload_len = header.get_u32() as usize;
            let timestamp_us = header.get_u64();
            at += RECORD_HEADER_BYTES;
            let end = at + key_len + payload_len;
            if end > data.len() {
                return Err(short());
            }
            records.push(ShardRecord {
                timestamp_us,
                key: data.slice(at..at + key_len),
                payload: data.slice(at + key_len..end),
            });
            at = end;
        }
        if at != data.len() {
            return Err(format!(
                "{} bytes after the batch's records",
                data.len() - at
            ));
        }
        Ok(Batch {
            producer,
            sequence,
            client,
            records,
        })
    }
}

/// What applying a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardApplied {
    /// Raft index of the entry.
    pub index: u64,
    pub producer: u64,
    pub sequence: u64,
    /// Offsets of the batch's records: `first_offset..first_offset + count`.
    pub first_offset: u64,
    pub count: u32,
    /// The batch was applied before (a retry): it took no offsets, these are the original's.
    pub duplicate: bool,
    /// A sequence that skips ahead of the producer's next one: refused, nothing applied.
    pub out_of_order: bool,
}

/// Where a committed entry's records are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub first_offset: u64,
    pub count: u32,
    pub index: u64,
}

impl Span {
    /// The batch of this span's entry, read out of the group's log store `store`.
    pub fn batch<S: raft::Storage>(&self, store: &S) -> Result<Batch, String> {
        let entries = store
            .entries(
                self.index,
                self.index + 1,
                None,
                raft::GetEntriesContext::empty(false),
            )
            .map_err(|error| format!("entry {}: {error}", self.index))?;
        let entry = entries
            .first()
            .ok_or_else(|| format!("entry {} is missing", self.index))?;
        Batch::decode(&entry.data)
    }
}

/// Why records could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("the offset is no longer in the log; the oldest is {oldest}")]
    Compacted { oldest: u64 },
    #[error("{0}")]
    Failed(String),
}

/// Batches per producer whose offsets a shard keeps, so a retry of any of them (not only
/// the last) is answered with its offsets: a member that caught up from a snapshot never saw
/// its own batches applied, and re-proposes the ones still pending.
pub const RECENT_BATCHES: usize = 64;

/// A producer's last applied batch, and the offsets of its [`RECENT_BATCHES`] latest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerState {
    pub sequence: u64,
    pub first_offset: u64,
    pub count: u32,
    /// `(sequence, first_offset, count)` of the latest batches, oldest first (absent in
    /// snapshots of brokers before it).
    #[serde(default)]
    pub recent: std::collections::VecDeque<(u64, u64, u32)>,
}

/// The applied state of a replicated shard.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardState {
    applied: u64,
    next_offset: u64,
    producers: BTreeMap<u64, ProducerState>,
    /// Clients' idempotent producers (`Batch::client`): each batch applied once, whichever
    /// members it was proposed through (absent in snapshots of brokers before them).
    #[serde(default)]
    clients: BTreeMap<u64, ProducerState>,
    /// The spans of entries applied since the last snapshot, in offset order (records before
    /// the first span were compacted away).
    spans: Vec<Span>,
}

impl ShardState {
    /// The next offset a record will get: every offset below is committed.
    #[must_use]
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// The entry holding `offset` and the record's position in it, if still in the log.
    #[must_use]
    pub fn locate(&self, offset: u64) -> Option<(Span, usize)> {
        let position = self
            .spans
            .partition_point(|span| span.first_offset + u64::from(span.count) <= offset);
        let span = *self.spans.get(position)?;
        (span.first_offset <= offset).then(|| {
            let within = usize::try_from(offset - span.first_offset).expect("within a batch");
            (span, within)
        })
    }

    /// The oldest offset this copy still holds (the next offset when it holds none).
    #[must_use]
    pub fn oldest_offset(&self) -> u64 {
        self.spans
            .first()
            .map_or(self.next_offset, |span| span.first_offset)
    }

    /// Reads committed records from `from` out of the group's log store: `(offset, record)`
    /// in offset order, at most `max_records`, and no more once `max_bytes` of keys and
    /// payloads are read (at least one record, whatever its size). Empty when `from` is at
    /// the end; [`ReadError::Compacted`] when `from` was compacted away.
    pub fn read<S: raft::Storage>(
        &self,
        store: &S,
        from: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<(u64, ShardRecord)>, ReadError> {
        let mut out = Vec::new();
        let mut bytes = 0;
        let mut offset = from;
        while out.len() < max_records && bytes < max_bytes && offset < self.next_offset {
            let Some((span, within)) = self.locate(offset) else {
                return Err(ReadError::Compacted {
                    oldest: self.oldest_offset(),
                });
            };
            let batch = span.batch(store).map_err(ReadError::Failed)?;
            for (position, record) in batch.records.into_iter().enumerate().skip(within) {
                if out.len() == max_records || (bytes >= max_bytes && !out.is_empty()) {
                    return Ok(out);
                }
                bytes += record.key.len() + record.payload.len();
                out.push((span.first_offset + position as u64, record));
            }
            offset = span.first_offset + u64::from(span.count);
        }
        Ok(out)
    }

    /// Forgets the spans of entries up to `index` (compacted).
    pub fn compacted(&mut self, index: u64) {
        let keep = self.spans.partition_point(|span| span.index <= index);
        self.spans.drain(..keep);
    }
}

/// Notes batch `sequence` of `producer` at `first..first + count`: the producer's last is the
/// highest sequence seen, and the offsets of the batches within [`RECENT_BATCHES`] of it are
/// kept.
fn remember(
    producers: &mut BTreeMap<u64, ProducerState>,
    producer: u64,
    sequence: u64,
    first: u64,
    count: u32,
) {
    let state = producers.entry(producer).or_insert(ProducerState {
        sequence,
        first_offset: first,
        count,
        recent: std::collections::VecDeque::new(),
    });
    if sequence >= state.sequence {
        state.sequence = sequence;
        state.first_offset = first;
        state.count = count;
    }
    state.recent.push_back((sequence, first, count));
    let last = state.sequence;
    state
        .recent
        .retain(|(kept, ..)| kept + RECENT_BATCHES as u64 > last);
    while state.recent.len() > RECENT_BATCHES {
        state.recent.pop_front();
    }
}

impl Machine for ShardState {
    type Applied = ShardApplied;

    fn applied_index(&self) -> u64 {
        self.applied
    }

    fn apply(&mut self, index: u64, data: &[u8]) -> Result<ShardApplied, String> {
        let (producer, sequence, count, client) = Batch::full_header(data)?;
        self.applied = index;
        let mut applied = ShardApplied {
            index,
            producer,
            sequence,
            first_offset: self.next_offset,
            count,
            duplicate: false,
            out_of_order: false,
        };
        let last = self.producers.get(&producer).filter(|_| sequence != 0);
        match last {
            Some(last) if sequence <= last.sequence => {
                applied.duplicate = true;
                let kept = last
                    .recent
                    .iter()
                    .find(|(kept, ..)| *kept == sequence)
                    .map(|(_, first, count)| (*first, *count));
                match kept {
                    Some((first, count)) => {
                        applied.first_offset = first;
                        applied.count = count;
                    }
                    None if sequence == last.sequence => {
                        applied.first_offset = last.first_offset;
                        applied.count = last.count;
                    }
                    // Older than the batches kept: applied long ago, its offsets are not
                    // known any more (count 0: the producer answers that, never an ack).
                    None => applied.count = 0,
                }
                return Ok(applied);
            }
            // A gap: an earlier batch of the producer was lost on its way (the producer
            // proposes it again, then this one). A new producer starts at sequence 1, so a
            // lost first batch is a gap too. Sequence 0 is a producer that does not ask for
            // idempotence: never a duplicate, never a gap.
            Some(last) if sequence > last.sequence + 1 => {
                applied.out_of_order = true;
                applied.count = 0;
                return Ok(applied);
            }
            None if sequence > 1 => {
                applied.out_of_order = true;
                applied.count = 0;
                return Ok(applied);
            }
            _ => {}
        }
        // A client's retry through another member (or through this one after its member
        // producer gave up): the member's batch counts as applied, with the original's
        // offsets; none are taken. Clients' batches may commit out of order (retried through
        // different members), so a sequence below the last is new unless seen, within the
        // window; below the window its fate is unknown (count 0: never acknowledged).
        if let Some((id, client_sequence)) = client.filter(|(_, s)| *s != 0)
            && let Some(state) = self.clients.get(&id)
        {
            let seen = state
                .recent
                .iter()
                .find(|(kept, ..)| *kept == client_sequence)
                .map(|(_, first, count)| (*first, *count));
            let too_old = client_sequence + RECENT_BATCHES as u64 <= state.sequence;
            if seen.is_some() || too_old {
                let (first, kept) = seen.unwrap_or((0, 0));
                remember(&mut self.producers, producer, sequence, first, kept);
                applied.duplicate = true;
                applied.first_offset = first;
                applied.count = kept;
                return Ok(applied);
            }
        }
        if sequence != 0 {
            remember(
                &mut self.producers,
                producer,
                sequence,
                self.next_offset,
                count,
            );
        }
        if let Some((id, client_sequence)) = client.filter(|(_, s)| *s != 0) {
            remember(
                &mut self.clients,
                id,
                client_sequence,
                self.next_offset,
                count,
            );
        }
        if count > 0 {
            self.spans.push(Span {
                first_offset: self.next_offset,
                count,
                index,
            });
        }
        self.next_offset += u64::from(count);
        Ok(applied)
    }

    fn skip(&mut self, index: u64) {
        self.applied = index;
    }

    fn snapshot(&self) -> Vec<u8> {
        let mut state = self.clone();
        state.spans.clear();
        serde_json::to_vec(&state).expect("the state always serializes")
    }

    fn restore(data: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(data).map_err(|error| error.to_string())
    }

    fn compacted(&mut self, index: u64) {
        ShardState::compacted(self, index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(producer: u64, sequence: u64, n: usize) -> Batch {
        Batch {
            producer,
            sequence,
            client: None,
            records: (0..n)
                .map(|i| ShardRecord {
                    timestamp_us: i as u64,
                    key: Bytes::from(format!("k{i}")),
                    payload: Bytes::from(vec![i as u8; i * 3]),
                })
                .collect(),
        }
    }

    /// A retry of any of a producer's latest batches is answered with its own offsets (a
    /// member that caught up from a snapshot re-proposes batches it never saw applied); an
    /// older one is marked as offsets unknown (count 0), which the producer never acks.
    #[test]
    fn retries_of_the_latest_batches_get_their_own_offsets() {
        let mut state = ShardState::default();
        let mut index = 0;
        let mut offsets = Vec::new();
        for sequence in 1..=100 {
            index += 1;
            let applied = state
                .apply(index, &batch(7, sequence, 2).encode())
                .expect("applied");
            offsets.push(applied.first_offset);
        }
        let restored = ShardState::restore(&state.snapshot()).expect("restored");
        for state in [&mut state.clone(), &mut restored.clone()] {
            let kept = 100 - RECENT_BATCHES as u64 + 1;
            for sequence in [kept, 60, 99, 100] {
                index += 1;
                let retry = state
                    .apply(index, &batch(7, sequence, 2).encode())
                    .expect("applied");
                assert!(retry.duplicate);
                assert_eq!(retry.count, 2, "sequence {sequence}");
                assert_eq!(retry.first_offset, offsets[sequence as usize - 1]);
            }
            index += 1;
            let old = state
                .apply(index, &batch(7, kept - 1, 2).encode())
                .expect("applied");
            assert!(old.duplicate);
            assert_eq!(old.count, 0, "older than the batches kept");
            assert_eq!(state.next_offset(), 200, "no retry took offsets");
        }
    }

    #[test]
    fn batches_round_trip_and_damage_is_named() {
        let original = batch(7, 3, 5);
        let data = Bytes::from(original.encode());
        assert_eq!(Batch::decode(&data).unwrap(), original);
        assert!(Batch::decode(&data.slice(..data.len() - 1)).is_err());
        let mut longer = data.to_vec();
        longer.push(0);
        assert!(Batch::decode(&Bytes::from(longer)).is_err());
        assert!(Batch::decode(&Bytes::from_static(b"short")).is_err());
    }

    #[test]
    fn offsets_are_dense_and_retries_take_none() {
        let mut state = ShardState::default();
        let a = state.apply(1, &batch(1, 1, 3).encode()).unwrap();
        assert_eq!((a.first_offset, a.count, a.duplicate), (0, 3, false));
        state.skip(2);
        let b = state.apply(3, &batch(2, 1, 2).encode()).unwrap();
        assert_eq!(b.first_offset, 3);
        // Producer 1 retries batch 1 (its ack was lost): the original's offsets, no new ones.
        let retry = state.apply(4, &batch(1, 1, 3).encode()).unwrap();
        assert_eq!(
            (retry.first_offset, retry.count, retry.duplicate),
            (0, 3, true)
        );
        assert_eq!(state.next_offset(), 5);
        // A gap in a producer's sequence is refused.
        let gap = state.apply(5, &batch(1, 3, 1).encode()).unwrap();
        assert!(gap.out_of_order);
        assert_eq!(state.next_offset(), 5);
        assert_eq!(state.locate(4).unwrap().0.index, 3);
        assert_eq!(state.locate(0).unwrap(), (state.spans[0], 0));
        assert!(state.locate(5).is_none());
        state.compacted(1);
        assert!(state.locate(0).is_none());
        let restored = ShardState::restore(&state.snapshot()).unwrap();
        assert_eq!(restored.next_offset(), 5);
        assert_eq!(restored.applied_index(), 5);
    }
}
