//! In-memory cluster streams (docs/cluster.md, "In-memory streams"): each shard has one copy,
//! kept by its owner (the member placement chose to lead it) in a ring of the newest records.
//!
//! - A publish entering the owner is appended at once. One entering another member is
//!   forwarded to the owner over the peer connections ([`DataFrame::Publish`]) and answered
//!   when the owner's [`DataFrame::Published`] comes back, or `Timeout` at its deadline (the
//!   records may then be stored: the outcome is unknown, as for a replicated publish).
//! - A subscriber on another member *pulls*: its member asks the owner for the records from
//!   its cursor ([`DataFrame::Fetch`]); the owner answers at once when it has some, else holds
//!   the fetch until records arrive or [`FETCH_HOLD_TICKS`] pass (a long poll). A fetch not
//!   answered in [`FETCH_RETRY_TICKS`] is sent again; the answer names its first offset and the
//!   subscriber takes only the records at its cursor, so a lost or repeated message costs a
//!   retry, never a gap or a duplicate.
//! - A restarted owner starts its shards empty, at offset 0, as a single broker's in-memory
//!   stream does after a restart.
//!
//! Data frames travel on the peer connections with the group id [`DATA_GROUP`], beside the Raft
//! messages (best effort, like them).

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes};

use crate::control::{ControlState, StreamKind};
use crate::publish::{PublishAck, PublishAnswer, PublishError};
use crate::shard::{Batch, ReadError, ShardRecord};

/// The group id of data frames on the peer connections (no shard group has it: a shard
/// group's id is its stream's incarnation shifted over 16 bits).
pub const DATA_GROUP: u64 = u64::MAX;

/// Bytes of keys and payloads an owner keeps per in-memory shard; older records are dropped.
pub const SHARD_RING_BYTES_MAX: usize = 64 << 20;

/// Ticks (of `service::TICK`) an owner holds a fetch that found nothing new.
pub const FETCH_HOLD_TICKS: u64 = 10;

/// Ticks a fetch may go unanswered before it is sent again.
pub const FETCH_RETRY_TICKS: u64 = 20;

/// Identifies an in-memory shard across members: its stream's incarnation and its number.
pub type ShardKey = (u64, u32);

/// The ring of one in-memory shard on its owner.
#[derive(Debug)]
pub struct MemoryShard {
    pub stream: String,
    records: VecDeque<(u64, ShardRecord)>,
    next_offset: u64,
    bytes: usize,
}

fn record_bytes(record: &ShardRecord) -> usize {
    record.key.len() + record.payload.len()
}

impl MemoryShard {
    fn new(stream: String) -> MemoryShard {
        MemoryShard {
            stream,
            records: VecDeque::new(),
            next_offset: 0,
            bytes: 0,
        }
    }

    /// Appends `records`; returns the first one's offset. The oldest records leave the ring
    /// while it holds more than [`SHARD_RING_BYTES_MAX`] (never the newest).
    pub fn append(&mut self, records: Vec<ShardRecord>) -> u64 {
        let first = self.next_offset;
        for record in records {
            self.bytes += record_bytes(&record);
            self.records.push_back((self.next_offset, record));
            self.next_offset += 1;
        }
        while self.bytes > SHARD_RING_BYTES_MAX && self.records.len() > 1 {
            if let Some((_, old)) = self.records.pop_front() {
                self.bytes -= record_bytes(&old);
            }
        }
        first
    }

    /// `(oldest offset held, next offset)`.
    #[must_use]
    pub fn range(&self) -> (u64, u64) {
        let oldest = self
            .records
            .front()
            .map_or(self.next_offset, |(offset, _)| *offset);
        (oldest, self.next_offset)
    }

    /// Records from `from`: at most `max_records`, and no more once `max_bytes` are read (at
    /// least one). Empty at the end; `Compacted` when `from` left the ring.
    pub fn read(
        &self,
        from: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<(u64, ShardRecord)>, ReadError> {
        let (oldest, next) = self.range();
        if from < oldest {
            return Err(ReadError::Compacted { oldest });
        }
        let mut out = Vec::new();
        let mut bytes = 0;
        let skip = usize::try_from(from - oldest)
            .unwrap_or(usize::MAX)
            .min(self.records.len());
        for (offset, record) in self.records.range(skip..) {
            if *offset >= next
                || out.len() >= max_records
                || (bytes >= max_bytes && !out.is_empty())
            {
                break;
            }
            bytes += record_bytes(record);
            out.push((*offset, record.clone()));
        }
        Ok(out)
    }
}

/// A fetch an owner holds until records arrive (a long poll).
#[derive(Debug)]
struct HeldFetch {
    from_member: u64,
    request: u64,
    key: ShardKey,
    from: u64,
    max_records: u32,
    max_bytes: u32,
    held_at: u64,
}

/// The in-memory shards this member owns, and the fetches it holds.
#[derive(Debug)]
pub struct MemoryShards {
    id: u64,
    owned: BTreeMap<ShardKey, MemoryShard>,
    held: Vec<HeldFetch>,
}

impl MemoryShards {
    #[must_use]
    pub fn new(id: u64) -> MemoryShards {
        MemoryShards {
            id,
            owned: BTreeMap::new(),
            held: Vec::new(),
        }
    }

    /// Starts (empty) the in-memory shards placed on this member that are not kept yet, and
    /// drops those whose stream is gone.
    pub fn reconcile(&mut self, state: &ControlState) {
        let mut wanted = BTreeMap::new();
        for stream in state.streams.values() {
            if stream.kind != StreamKind::InMemory {
                continue;
            }
            for (shard, placement) in stream.shards.iter().enumerate() {
                if placement.leader == self.id {
                    let shard = u32::try_from(shard).unwrap_or(u32::MAX);
                    wanted.insert((stream.incarnation, shard), stream.name.clone());
                }
            }
        }
        self.owned.retain(|key, _| wanted.contains_key(key));
        for (key, name) in wanted {
            self.owned
                .entry(key)
                .or_insert_with(|| MemoryShard::new(name));
        }
    }

    /// The shard `key` if this member owns it.
    #[must_use]
    pub fn get(&self, key: ShardKey) -> Option<&MemoryShard> {
        self.owned.get(&key)
    }

    /// Appends to an owned shard; returns the first offset, or `None` when not owned here.
    /// Fetches held for the shard are answered (`out`: frames to send, by member).
    pub fn append(
        &mut self,
        key: ShardKey,
        records: Vec<ShardRecord>,
        out: &mut Vec<(u64, DataFrame)>,
    ) -> Option<u64> {
        let shard = self.owned.get_mut(&key)?;
        let first = shard.append(records);
        self.answer_held(|held| held.key == key, out);
        Some(first)
    }

    /// A member's fetch: answered now when the shard has records from `from` (or `from` left
    /// the ring, or the shard is not here), else held until records arrive or
    /// [`FETCH_HOLD_TICKS`] pass.
    pub fn fetch(
        &mut self,
        from_member: u64,
        fetch: &Fetch,
        tick: u64,
        out: &mut Vec<(u64, DataFrame)>,
    ) {
        let held = HeldFetch {
            from_member,
            request: fetch.request,
            key: fetch.key,
            from: fetch.from,
            max_records: fetch.max_records,
            max_bytes: fetch.max_bytes,
            held_at: tick,
        };
        let waits = self
            .owned
            .get(&fetch.key)
            .is_some_and(|shard| shard.range().1 == fetch.from);
        if waits {
            // One held fetch per (member, request): a retry replaces its first copy.
            self.held
                .retain(|h| !(h.from_member == from_member && h.request == fetch.request));
            self.held.push(held);
        } else {
            out.push((from_member, self.answer(&held)));
        }
    }

    /// A tick: fetches held for [`FETCH_HOLD_TICKS`] are answered (empty).
    pub fn tick(&mut self, tick: u64, out: &mut Vec<(u64, DataFrame)>) {
        self.answer_held(|held| tick - held.held_at >= FETCH_HOLD_TICKS, out);
    }

    fn answer_held(&mut self, due: impl Fn(&HeldFetch) -> bool, out: &mut Vec<(u64, DataFrame)>) {
        let (answer, keep): (Vec<HeldFetch>, Vec<HeldFetch>) =
            std::mem::take(&mut self.held).into_iter().partition(due);
        self.held = keep;
        for held in answer {
            out.push((held.from_member, self.answer(&held)));
        }
    }

    fn answer(&self, held: &HeldFetch) -> DataFrame {
        let result = match self.owned.get(&held.key) {
            None => Err(FetchRefusal::NotHere),
            Some(shard) => shard
                .read(
                    held.from,
                    held.max_records as usize,
                    held.max_bytes as usize,
                )
                .map(|records| {
                    let (oldest, next) = shard.range();
                    Fetched {
                        oldest,
                        next,
                        records,
                    }
                })
                .map_err(|error| match error {
                    ReadError::Compacted { oldest } => FetchRefusal::TooOld { oldest },
                    ReadError::Failed(_) => FetchRefusal::NotHere,
                }),
        };
        DataFrame::Fetched {
            request: held.request,
            result,
        }
    }
}

/// A publish forwarded to its shard's owner, waiting for the answer.
#[derive(Debug)]
struct Forward {
    answer: PublishAnswer,
    count: u32,
    deadline: Instant,
    timeout: Duration,
}

/// This member's publishes forwarded to other members' in-memory shards.
#[derive(Debug, Default)]
pub struct Forwards {
    waiting: BTreeMap<u64, Forward>,
    next_request: u64,
}

impl Forwards {
    /// Forwards `records` to `owner` (`out`: the frame to send); `answer` hears the owner's
    /// answer, or `Timeout` at `deadline`.
    pub fn forward(
        &mut self,
        owner: u64,
        key: ShardKey,
        records: Vec<ShardRecord>,
        (deadline, timeout): (Instant, Duration),
        answer: PublishAnswer,
        out: &mut Vec<(u64, DataFrame)>,
    ) {
        let request = self.next_request;
        self.next_request += 1;
        let count = u32::try_from(records.len()).unwrap_or(u32::MAX);
        self.waiting.insert(
            request,
            Forward {
                answer,
                count,
                deadline,
                timeout,
            },
        );
        out.push((
            owner,
            DataFrame::Publish {
                request,
                key,
                records,
            },
        ));
    }

    /// The owner answered forward `request`.
    pub fn answered(&mut self, request: u64, first_offset: Option<u64>, from: u64) {
        let Some(forward) = self.waiting.remove(&request) else {
            return;
        };
        forward.answer.answer(match first_offset {
            Some(first_offset) => Ok(PublishAck {
                first_offset,
                count: forward.count,
            }),
            None => Err(PublishError::NotOwner { member: from }),
        });
    }

    /// Forwards that could not be sent, or whose deadline passed, are answered.
    pub fn expire(&mut self, now: Instant) {
        let due: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(_, forward)| forward.deadline <= now)
            .map(|(request, _)| *request)
            .collect();
        for request in due {
            if let Some(forward) = self.waiting.remove(&request) {
                forward
                    .answer
                    .answer(Err(PublishError::Timeout(forward.timeout)));
            }
        }
    }

    /// A forward whose frame could not be queued for its owner is answered at once.
    pub fn unsent(&mut self, request: u64, owner: u64) {
        if let Some(forward) = self.waiting.remove(&request) {
            forward
                .answer
                .answer(Err(PublishError::OwnerUnreachable { member: owner }));
        }
    }
}

/// A subscriber's member asks the owner for records of shard `key` from `from`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    pub request: u64,
    pub key: ShardKey,
    pub from: u64,
    pub max_records: u32,
    pub max_bytes: u32,
}

/// The owner's answer to a fetch: its range, and the records from the fetch's offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub oldest: u64,
    pub next: u64,
    pub records: Vec<(u64, ShardRecord)>,
}

/// Why an owner did not answer a fetch with records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchRefusal {
    /// The offset left the owner's ring; `oldest` is the oldest it holds.
    TooOld { oldest: u64 },
    /// The member does not own the shard (the stream was deleted, or it restarted elsewhere).
    NotHere,
}

/// A frame between members about in-memory shards (group [`DATA_GROUP`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataFrame {
    Publish {
        request: u64,
        key: ShardKey,
        records: Vec<ShardRecord>,
    },
    /// The first offset the records got, or `None` when the receiver does not own the shard.
    Published {
        request: u64,
        first_offset: Option<u64>,
    },
    Fetch(Fetch),
    Fetched {
        request: u64,
        result: Result<Fetched, FetchRefusal>,
    },
    /// A member asks a replica of a replicated shard for committed records its record log
    /// misses (`records.rs`, "Holes"); the key names the shard group.
    RecordsFetch(Fetch),
    /// The replica's answer, from its copy.
    RecordsFetched {
        request: u64,
        result: Result<Fetched, FetchRefusal>,
    },
}

const PUBLISH: u8 = 1;
const PUBLISHED: u8 = 2;
const FETCH: u8 = 3;
const FETCHED: u8 = 4;
const RECORDS_FETCH: u8 = 5;
const RECORDS_FETCHED: u8 = 6;

impl DataFrame {
    /// The frame's bytes (without the group id).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            DataFrame::Publish {
                request,
                key,
                records,
            } => {
                out.put_u8(PUBLISH);
                out.put_u64(*request);
                put_key(&mut out, *key);
                out.extend_from_slice(&batch(records.clone()));
            }
            DataFrame::Published {
                request,
                first_offset,
            } => {
                out.put_u8(PUBLISHED);
                out.put_u64(*request);
                match first_offset {
                    Some(first) => {
                        out.put_u8(1);
                        out.put_u64(*first);
                    }
                    None => out.put_u8(0),
                }
            }
            DataFrame::Fetch(fetch) | DataFrame::RecordsFetch(fetch) => {
                let kind = if matches!(self, DataFrame::Fetch(_)) {
                    FETCH
                } else {
                    RECORDS_FETCH
                };
                out.put_u8(kind);
                out.put_u64(fetch.request);
                put_key(&mut out, fetch.key);
                out.put_u64(fetch.from);
                out.put_u32(fetch.max_records);
                out.put_u32(fetch.max_bytes);
            }
            DataFrame::Fetched { request, result }
            | DataFrame::RecordsFetched { request, result } => {
                let kind = if matches!(self, DataFrame::Fetched { .. }) {
                    FETCHED
                } else {
                    RECORDS_FETCHED
                };
                out.put_u8(kind);
                out.put_u64(*request);
                match result {
                    Ok(fetched) => {
                        out.put_u8(0);
                        out.put_u64(fetched.oldest);
                        out.put_u64(fetched.next);
                        let first = fetched.records.first().map_or(0, |(offset, _)| *offset);
                        out.put_u64(first);
                        let records = fetched.records.iter().map(|(_, r)| r.clone()).collect();
                        out.extend_from_slice(&batch(records));
                    }
                    Err(FetchRefusal::TooOld { oldest }) => {
                        out.put_u8(1);
                        out.put_u64(*oldest);
                    }
                    Err(FetchRefusal::NotHere) => out.put_u8(2),
                }
            }
        }
        out
    }

    /// Decodes a frame; the records share `data`'s buffer.
    pub fn decode(data: &Bytes) -> Result<DataFrame, String> {
        let mut buf = data.clone();
        let need = |buf: &Bytes, n: usize, what: &str| {
            if buf.remaining() < n {
                Err(format!("a data frame ends inside its {what}"))
            } else {
                Ok(())
            }
        };
        need(&buf, 9, "header")?;
        let kind = buf.get_u8();
        let request = buf.get_u64();
        let frame = match kind {
            PUBLISH => {
                need(&buf, 12, "shard")?;
                let key = (buf.get_u64(), buf.get_u32());
                let batch = Batch::decode(&buf)?;
                DataFrame::Publish {
                    request,
                    key,
                    records: batch.records,
                }
            }
            PUBLISHED => {
                need(&buf, 1, "outcome")?;
                let first_offset = match buf.get_u8() {
                    0 => None,
                    _ => {
                        need(&buf, 8, "offset")?;
                        Some(buf.get_u64())
                    }
                };
                DataFrame::Published {
                    request,
                    first_offset,
                }
            }
            FETCH | RECORDS_FETCH => {
                need(&buf, 12 + 8 + 4 + 4, "fetch")?;
                let fetch = Fetch {
                    request,
                    key: (buf.get_u64(), buf.get_u32()),
                    from: buf.get_u64(),
                    max_records: buf.get_u32(),
                    max_bytes: buf.get_u32(),
                };
                if kind == FETCH {
                    DataFrame::Fetch(fetch)
                } else {
                    DataFrame::RecordsFetch(fetch)
                }
            }
            FETCHED | RECORDS_FETCHED => {
                need(&buf, 1, "outcome")?;
                let result = match buf.get_u8() {
                    0 => {
                        need(&buf, 24, "range")?;
                        let oldest = buf.get_u64();
                        let next = buf.get_u64();
                        let first = buf.get_u64();
                        let batch = Batch::decode(&buf)?;
                        Ok(Fetched {
                            oldest,
                            next,
                            records: (first..).zip(batch.records).collect(),
                        })
                    }
                    1 => {
                        need(&buf, 8, "oldest offset")?;
                        Err(FetchRefusal::TooOld {
                            oldest: buf.get_u64(),
                        })
                    }
                    _ => Err(FetchRefusal::NotHere),
                };
                if kind == FETCHED {
                    DataFrame::Fetched { request, result }
                } else {
                    DataFrame::RecordsFetched { request, result }
                }
            }
            other => return Err(format!("unknown data frame kind {other}")),
        };
        Ok(frame)
    }
}

fn put_key(out: &mut Vec<u8>, (incarnation, shard): ShardKey) {
    out.put_u64(incarnation);
    out.put_u32(shard);
}

fn batch(records: Vec<ShardRecord>) -> Vec<u8> {
    Batch {
        producer: 0,
        sequence: 0,
        client: None,
        records,
    }
    .encode()
}

/// The key of shard `shard` of in-memory stream `stream`, by the control plane's state.
#[must_use]
pub fn shard_key(state: &ControlState, stream: &str, shard: u32) -> Option<(ShardKey, u64)> {
    let placement = state
        .streams
        .get(stream)
        .filter(|p| p.kind == StreamKind::InMemory)?;
    let owner = placement.shards.get(shard as usize)?.leader;
    Some(((placement.incarnation, shard), owner))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u64, size: usize) -> ShardRecord {
        ShardRecord {
            timestamp_us: n,
            key: Bytes::from(format!("k{n}")),
            payload: Bytes::from(vec![b'x'; size]),
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_records_and_reads_by_offset() {
        let mut shard = MemoryShard::new("s".to_owned());
        assert_eq!(shard.append(vec![record(0, 10), record(1, 10)]), 0);
        assert_eq!(shard.append(vec![record(2, 10)]), 2);
        assert_eq!(shard.range(), (0, 3));
        let read = shard.read(1, 10, usize::MAX).unwrap();
        assert_eq!(read.iter().map(|(o, _)| *o).collect::<Vec<_>>(), vec![1, 2]);
        assert!(shard.read(3, 10, usize::MAX).unwrap().is_empty());
        assert_eq!(
            shard.read(0, 10, 1).unwrap().len(),
            1,
            "at least one record"
        );
        // Past the byte bound the oldest leave.
        let big = SHARD_RING_BYTES_MAX / 2;
        shard.append(vec![record(3, big), record(4, big)]);
        let (oldest, next) = shard.range();
        assert_eq!(next, 5);
        assert!(oldest >= 3, "{oldest}");
        assert_eq!(
            shard.read(0, 10, usize::MAX),
            Err(ReadError::Compacted { oldest })
        );
    }

    #[test]
    fn data_frames_round_trip() {
        let frames = vec![
            DataFrame::Publish {
                request: 7,
                key: (3, 2),
                records: vec![record(1, 3), record(2, 0)],
            },
            DataFrame::Published {
                request: 7,
                first_offset: Some(40),
            },
            DataFrame::Published {
                request: 8,
                first_offset: None,
            },
            DataFrame::Fetch(Fetch {
                request: 9,
                key: (3, 2),
                from: 5,
                max_records: 256,
                max_bytes: 1 << 20,
            }),
            DataFrame::Fetched {
                request: 9,
                result: Ok(Fetched {
                    oldest: 1,
                    next: 7,
                    records: vec![(5, record(5, 1)), (6, record(6, 2))],
                }),
            },
            DataFrame::Fetched {
                request: 10,
                result: Err(FetchRefusal::TooOld { oldest: 4 }),
            },
            DataFrame::Fetched {
                request: 11,
                result: Err(FetchRefusal::NotHere),
            },
            DataFrame::RecordsFetch(Fetch {
                request: 12,
                key: (3, 2),
                from: 5,
                max_records: 4096,
                max_bytes: 1 << 20,
            }),
            DataFrame::RecordsFetched {
                request: 12,
                result: Ok(Fetched {
                    oldest: 0,
                    next: 9,
                    records: vec![(5, record(5, 1))],
                }),
            },
            DataFrame::RecordsFetched {
                request: 13,
                result: Err(FetchRefusal::TooOld { oldest: 4 }),
            },
        ];
        for frame in frames {
            let bytes = Bytes::from(frame.encode());
            assert_eq!(DataFrame::decode(&bytes).unwrap(), frame);
            assert!(
                DataFrame::decode(&bytes.slice(..bytes.len() - 1)).is_err() || bytes.len() <= 10
            );
        }
        assert!(DataFrame::decode(&Bytes::from_static(&[9; 9])).is_err());
    }

    #[test]
    fn an_owner_holds_a_fetch_until_records_arrive_or_time_passes() {
        let mut state = ControlState::default();
        state.streams.insert(
            "m".to_owned(),
            crate::control::StreamPlacement {
                name: "m".to_owned(),
                kind: StreamKind::InMemory,
                replicas: 1,
                incarnation: 5,
                shards: vec![crate::placement::ShardPlacement {
                    replicas: vec![1],
                    leader: 1,
                    core: 0,
                }],
                fsync: Default::default(),
            },
        );
        let mut shards = MemoryShards::new(1);
        shards.reconcile(&state);
        let mut out = Vec::new();
        let fetch = Fetch {
            request: 1,
            key: (5, 0),
            from: 0,
            max_records: 10,
            max_bytes: 1 << 20,
        };
        shards.fetch(2, &fetch, 0, &mut out);
        assert!(out.is_empty(), "held: nothing to read yet");
        assert_eq!(shards.append((5, 0), vec![record(0, 1)], &mut out), Some(0));
        let [
            (
                2,
                DataFrame::Fetched {
                    request: 1,
                    result: Ok(fetched),
                },
            ),
        ] = &out[..]
        else {
            panic!("{out:?}")
        };
        assert_eq!(fetched.records.len(), 1);
        out.clear();
        // Held again from the end; answered empty after the hold.
        shards.fetch(
            2,
            &Fetch {
                from: 1,
                ..fetch.clone()
            },
            3,
            &mut out,
        );
        shards.tick(3 + FETCH_HOLD_TICKS - 1, &mut out);
        assert!(out.is_empty());
        shards.tick(3 + FETCH_HOLD_TICKS, &mut out);
        assert!(
            matches!(&out[..], [(2, DataFrame::Fetched { result: Ok(f), .. })] if f.records.is_empty())
        );
        // Not owned (stream gone): refused.
        shards.reconcile(&ControlState::default());
        out.clear();
        shards.fetch(2, &fetch, 20, &mut out);
        assert!(matches!(
            &out[..],
            [(
                2,
                DataFrame::Fetched {
                    result: Err(FetchRefusal::NotHere),
                    ..
                }
            )]
        ));
        assert_eq!(shards.append((5, 0), vec![record(1, 1)], &mut out), None);
    }
}
