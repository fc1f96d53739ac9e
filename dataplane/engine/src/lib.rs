//! Felix shard engine: streams, shards, per-shard dense offsets, in-memory replay rings and
//! subscribers with live delivery in per-shard order.
//!
//! Owns: the stream table of one data-plane core, each shard's offset counter and replay ring,
//! and each subscription's delivery queue. It does not own sockets, framing, admission
//! (ingress queues) or metrics export: those belong to the broker's IO shell.
//!
//! Sans-IO (quinn-proto style): no sockets, files, threads, clocks or randomness. Input comes
//! in through calls with the time passed in (`now_us`, microseconds since the Unix epoch);
//! output is drained with `poll_*` calls. An `Engine` lives on one data-plane core and is used
//! from that core's thread only (the shell holds it in an `Rc<RefCell<_>>`).
//!
//! Output order: [`Engine::poll_event`] yields events in the order they arose (FIFO). A
//! `DeliveryReady(id)` is emitted once per transition of the subscription's queue from empty
//! to non-empty, so the shell drains [`Engine::poll_delivery`] until it returns nothing before
//! it waits for the next one. Events may still name a subscription that ended or was
//! unsubscribed since; `poll_delivery` then returns nothing.
//!
//! Durable streams are refused until storage lands; see `shard.rs` for where a log plugs in.

mod error;
mod ring;
mod shard;
mod stream;
mod subscription;

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;

use felix_wire::{
    DeliveredRecord, ErrorCode, HashKind, Record, ShardAck, ShardSelection, StartPosition,
    StreamKind,
};

pub use error::{ERROR_MESSAGE_MAX_BYTES, EngineError};
pub use subscription::SUBSCRIBER_QUEUE_MAX_LIVE_RECORDS;

use shard::Shard;
use stream::{Stream, check_name};
use subscription::{Slot, SubState, Subscriptions};

/// Tunables of one engine (the broker fills them from its configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Replay ring bound per shard, in records (default 1,024).
    pub ring_max_records: usize,
    /// Replay ring bound per shard, in payload bytes (default 64 MiB).
    pub ring_max_bytes: u64,
    /// Live records queued for one subscription beyond which it is ended with
    /// `SubscriberLagged` (payload bytes; default 64 MiB). Catch-up from the ring does not count.
    /// A live record that finds no other live record queued is always taken, so a subscriber
    /// that keeps up is never ended; [`SUBSCRIBER_QUEUE_MAX_LIVE_RECORDS`] bounds the count.
    pub subscriber_queue_max_bytes: u64,
    /// Largest shard count of a stream.
    pub max_shards: u32,
    /// Largest stream name in bytes.
    pub max_name_bytes: u16,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ring_max_records: 1024,
            ring_max_bytes: 64 * 1024 * 1024,
            subscriber_queue_max_bytes: 64 * 1024 * 1024,
            max_shards: felix_wire::Limits::DEFAULT.max_shards,
            max_name_bytes: felix_wire::Limits::DEFAULT.max_name_bytes,
        }
    }
}

/// Identifies one subscription within an engine. Never reused by an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubscriptionId(pub u64);

/// Description of one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardState {
    pub shard: u32,
    /// Oldest offset still in the ring; equals `next_offset` when the ring is empty.
    pub oldest_offset: u64,
    pub next_offset: u64,
    pub ring_records: usize,
    pub ring_bytes: u64,
}

/// Description of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamDescription {
    pub name: String,
    pub kind: StreamKind,
    pub hash: HashKind,
    pub shards: Vec<ShardState>,
}

/// Result of a successful subscribe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub id: SubscriptionId,
    /// `(shard, first offset to be delivered)` per subscribed shard, ascending shard order.
    pub start: Vec<(u32, u64)>,
}

/// Something the IO shell must act on, drained with [`Engine::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// The subscription has records waiting in [`Engine::poll_delivery`]. Emitted once per
    /// transition from empty to non-empty.
    DeliveryReady(SubscriptionId),
    /// The subscription is over (lagged, stream deleted); the shell sends the error and
    /// closes the subscription's stream. The engine has already forgotten it.
    SubscriptionEnded(SubscriptionId, EngineError),
}

/// Totals since start, for metrics (the shell reads them; no metric lives in the engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineCounters {
    pub records_appended: u64,
    pub payload_bytes_appended: u64,
    pub records_delivered: u64,
    pub subscriptions_active: u64,
}

/// A subscription ended by the lag bound during a publish, detached when the publish ends.
#[derive(Debug)]
struct Lagged {
    slot: Slot,
    shards: Box<[u32]>,
}

/// All streams and shards of one core, with their subscribers.
pub struct Engine {
    config: EngineConfig,
    streams: HashMap<Box<str>, Stream>,
    subscriptions: Subscriptions,
    /// Bounded by the subscriptions: at most one `DeliveryReady` per subscription per drain of
    /// its queue, and one `SubscriptionEnded` per subscription.
    events: VecDeque<EngineEvent>,
    /// Counters other than `subscriptions_active` (derived from the slab).
    counters: EngineCounters,
    /// Scratch of `publish` (shards touched by the batch), kept to avoid an allocation per
    /// publish.
    touched_shards: Vec<u32>,
    /// Scratch of `publish` (subscriptions ended by the lag bound).
    lagged: Vec<Lagged>,
}

impl Engine {
    #[must_use]
    pub fn new(config: EngineConfig) -> Engine {
        Engine {
            config,
            streams: HashMap::new(),
            subscriptions: Subscriptions::new(),
            events: VecDeque::new(),
            counters: EngineCounters::default(),
            touched_shards: Vec::new(),
            lagged: Vec::new(),
        }
    }

    /// Creates a stream. Names: 1..=max_name_bytes of `[A-Za-z0-9._-]`; shard count
    /// 1..=max_shards. Durable streams are refused (`InvalidArgument`) until storage lands.
    pub fn create_stream(
        &mut self,
        name: &str,
        shard_count: u32,
        kind: StreamKind,
    ) -> Result<StreamDescription, EngineError> {
        check_name(name, self.config.max_name_bytes)?;
        if shard_count == 0 || shard_count > self.config.max_shards {
            return Err(EngineError::invalid(format!(
                "invalid shard count {shard_count}: a stream has 1 to {} shards",
                self.config.max_shards
            )));
        }
        if kind == StreamKind::Durable {
            return Err(EngineError::invalid(
                "durable streams are not available in this build yet".to_owned(),
            ));
        }
        if self.streams.contains_key(name) {
            return Err(EngineError::new(
                ErrorCode::StreamExists,
                0,
                format!("stream {name:?} already exists"),
            ));
        }
        let shards = (0..shard_count)
            .map(|_| Shard::new(self.config.ring_max_records, self.config.ring_max_bytes))
            .collect();
        let stream = Stream {
            kind,
            shards,
            subscriptions: Vec::new(),
        };
        let description = describe(name, &stream);
        self.streams.insert(Box::from(name), stream);
        Ok(description)
    }

    pub fn describe_stream(&self, name: &str) -> Result<StreamDescription, EngineError> {
        let stream = self
            .streams
            .get(name)
            .ok_or_else(|| EngineError::stream_not_found(name))?;
        Ok(describe(name, stream))
    }

    /// `(name, kind, shard_count)` of every stream, sorted by name.
    #[must_use]
    pub fn list_streams(&self) -> Vec<(String, StreamKind, u32)> {
        let mut streams: Vec<(String, StreamKind, u32)> = self
            .streams
            .iter()
            .map(|(name, stream)| (name.to_string(), stream.kind, stream.shard_count()))
            .collect();
        streams.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        streams
    }

    /// Deletes a stream; its subscriptions end with `StreamNotFound` events.
    pub fn delete_stream(&mut self, name: &str) -> Result<(), EngineError> {
        let stream = self
            .streams
            .remove(name)
            .ok_or_else(|| EngineError::stream_not_found(name))?;
        for slot in stream.subscriptions {
            let state = self.subscriptions.remove(slot);
            let error = EngineError::new(
                ErrorCode::StreamNotFound,
                0,
                format!("stream {name:?} was deleted"),
            );
            self.events
                .push_back(EngineEvent::SubscriptionEnded(state.id, error));
        }
        Ok(())
    }

    /// Appends a batch: routes each record by `felix_wire::shard_for_key`, gives dense
    /// per-shard offsets in batch order, stamps `now_us`, pushes into rings (evicting oldest
    /// first by count and by bytes) and queues live delivery. All-or-nothing: a bad batch
    /// (unknown stream, empty) changes nothing. Returns one `ShardAck` per shard touched,
    /// ascending shard order.
    pub fn publish(
        &mut self,
        now_us: u64,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<Vec<ShardAck>, EngineError> {
        // Every check comes before the first change: a refused batch changes nothing.
        let Some(target) = self.streams.get_mut(stream) else {
            return Err(EngineError::stream_not_found(stream));
        };
        if records.is_empty() {
            return Err(EngineError::invalid(
                "a publish carries at least one record".to_owned(),
            ));
        }
        // `ShardAck::count` is a u32; the wire bounds batches far lower (max_batch_records).
        let Ok(record_count) = u32::try_from(records.len()) else {
            return Err(EngineError::invalid(format!(
                "a publish of {} records is over the limit of {}",
                records.len(),
                u32::MAX
            )));
        };

        let shard_count = target.shard_count();
        let mut touched = std::mem::take(&mut self.touched_shards);
        let mut lagged = std::mem::take(&mut self.lagged);
        assert!(
            touched.is_empty() && lagged.is_empty(),
            "scratch is left empty"
        );
        let mut payload_bytes: u64 = 0;
        for Record { key, payload } in records {
            let shard = felix_wire::shard_for_key(&key, shard_count);
            let index = shard as usize;
            // Append: the shard gives the offset.
            let owner = &mut target.shards[index];
            if owner.batch_records == 0 {
                touched.push(shard);
            }
            owner.batch_records += 1;
            let offset = owner.assign_offset();
            let record = DeliveredRecord {
                shard,
                offset,
                timestamp_us: now_us,
                key,
                payload,
            };
            payload_bytes += ring::payload_len(&record);
            // Release: live delivery, independent of the ring.
            if !target.shards[index].subscribers.is_empty() {
                fan_out(
                    &target.shards,
                    &record,
                    &mut self.subscriptions,
                    &mut self.events,
                    self.config.subscriber_queue_max_bytes,
                    &mut lagged,
                );
            }
            target.shards[index].retain(record);
        }

        touched.sort_unstable();
        let mut acks = Vec::with_capacity(touched.len());
        let mut acked_records: u32 = 0;
        for &shard in &touched {
            let owner = &mut target.shards[shard as usize];
            let count = owner.batch_records;
            assert!(count > 0, "a touched shard took a record");
            owner.batch_records = 0;
            acks.push(ShardAck {
                shard,
                first_offset: owner.next_offset() - u64::from(count),
                count,
            });
            acked_records += count;
        }
        assert_eq!(acked_records, record_count, "every record is acked once");
        for Lagged { slot, shards } in lagged.drain(..) {
            target.detach(slot, &shards);
        }
        touched.clear();
        self.touched_shards = touched;
        self.lagged = lagged;

        self.counters.records_appended += u64::from(record_count);
        self.counters.payload_bytes_appended += payload_bytes;
        Ok(acks)
    }

    /// Registers a subscription; catch-up records from the ring are queued immediately.
    /// A position older than the ring fails with `TooOld` (detail = oldest offset held,
    /// message names the shard); a position beyond `next_offset` is `InvalidArgument`, and so
    /// are an empty selection, a shard out of range, a shard selected twice, and a start offset
    /// for a shard outside the selection (or given twice). Catch-up is queued shard by shard,
    /// ascending; a `DeliveryReady` follows if anything was queued.
    pub fn subscribe(
        &mut self,
        stream: &str,
        shards: &ShardSelection,
        from: &StartPosition,
    ) -> Result<Subscription, EngineError> {
        let Some(target) = self.streams.get_mut(stream) else {
            return Err(EngineError::stream_not_found(stream));
        };
        let shard_count = target.shard_count();
        let out_of_range = |shard: u32| {
            EngineError::invalid(format!(
                "shard {shard} is out of range: stream {stream:?} has {shard_count} shards"
            ))
        };

        let selected: Box<[u32]> = match shards {
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

        let mut start: Vec<(u32, u64)> = selected
            .iter()
            .map(|&shard| {
                let owner = &target.shards[shard as usize];
                let offset = match from {
                    StartPosition::Earliest => owner.oldest_offset(),
                    StartPosition::Latest | StartPosition::Offsets(_) => owner.next_offset(),
                };
                (shard, offset)
            })
            .collect();
        if let StartPosition::Offsets(positions) = from {
            let mut listed = vec![false; selected.len()];
            for &(shard, offset) in positions {
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
                let owner = &target.shards[shard as usize];
                let next = owner.next_offset();
                let oldest = owner.oldest_offset();
                if offset > next {
                    return Err(EngineError::invalid(format!(
                        "offset {offset} of shard {shard} is beyond the next offset to be \
                         written ({next})"
                    )));
                }
                if offset < oldest {
                    return Err(EngineError::new(
                        ErrorCode::TooOld,
                        oldest,
                        format!(
                            "offset {offset} of shard {shard} is older than the oldest record \
                             still held ({oldest})"
                        ),
                    ));
                }
                start[position].1 = offset;
            }
        }

        // Registered: from here on nothing fails.
        let mut queue = VecDeque::new();
        for &(shard, offset) in &start {
            queue.extend(target.shards[shard as usize].replay_from(offset).cloned());
        }
        let catch_up_records = queue.len();
        let stream_name: Box<str> = Box::from(stream);
        let slot = self.subscriptions.insert(|id| SubState {
            id,
            stream: stream_name,
            shards: selected,
            queue,
            catch_up_records,
            live_bytes: 0,
        });
        let state = self.subscriptions.get(slot).expect("just inserted");
        for &shard in &state.shards {
            target.shards[shard as usize].subscribers.push(slot);
        }
        target.subscriptions.push(slot);
        let id = state.id;
        if catch_up_records > 0 {
            self.events.push_back(EngineEvent::DeliveryReady(id));
        }
        Ok(Subscription { id, start })
    }

    /// Forgets a subscription (client went away). Unknown ids are ignored.
    pub fn unsubscribe(&mut self, id: SubscriptionId) {
        let Some(slot) = self.subscriptions.slot_of(id) else {
            return;
        };
        let state = self.subscriptions.remove(slot);
        // Deleting a stream ends its subscriptions, so a live subscription's stream exists.
        let stream = self
            .streams
            .get_mut(&*state.stream)
            .expect("a live subscription's stream exists");
        stream.detach(slot, &state.shards);
    }

    /// Takes up to `max_records` queued records (and about `max_bytes` of payload; at least
    /// one record if any is queued and `max_records > 0`) of a subscription, per-shard order
    /// kept. Unknown or ended subscriptions yield nothing.
    #[must_use]
    pub fn poll_delivery(
        &mut self,
        id: SubscriptionId,
        max_records: usize,
        max_bytes: usize,
    ) -> Vec<DeliveredRecord> {
        let Some(slot) = self.subscriptions.slot_of(id) else {
            return Vec::new();
        };
        let state = self
            .subscriptions
            .get_mut(slot)
            .expect("the id map names occupied slots");
        let taken = state.take(max_records, max_bytes);
        self.counters.records_delivered += taken.len() as u64;
        taken
    }

    /// Next event for the shell, if any.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.events.pop_front()
    }

    #[must_use]
    pub fn counters(&self) -> EngineCounters {
        EngineCounters {
            subscriptions_active: self.subscriptions.len() as u64,
            ..self.counters
        }
    }

    /// The configuration the engine was built with.
    #[must_use]
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Shard count of a stream, without building a description.
    #[must_use]
    pub fn shard_count(&self, stream: &str) -> Option<u32> {
        self.streams.get(stream).map(Stream::shard_count)
    }

    /// Records waiting in a subscription's queue; `None` if the subscription is not live.
    #[must_use]
    pub fn queued_records(&self, id: SubscriptionId) -> Option<usize> {
        let slot = self.subscriptions.slot_of(id)?;
        self.subscriptions.get(slot).map(|state| state.queue.len())
    }

    /// Checks every invariant of the engine (dense offsets, ring and queue byte sums, the
    /// links between streams, shards and subscriptions). O(everything held): for tests and
    /// debugging, not the hot path.
    pub fn assert_invariants(&self) {
        self.subscriptions.assert_invariants();
        let mut linked: usize = 0;
        for (name, stream) in &self.streams {
            assert!(!stream.shards.is_empty(), "a stream has at least one shard");
            for (index, shard) in stream.shards.iter().enumerate() {
                let index = u32::try_from(index).expect("shard count fits a u32");
                shard.assert_invariants(index);
                for &slot in &shard.subscribers {
                    let state = self.subscriptions.get(slot).expect("listed slots are live");
                    assert_eq!(
                        &*state.stream, &**name,
                        "a subscription lists its own stream"
                    );
                    assert!(state.shards.binary_search(&index).is_ok(), "selected shard");
                }
            }
            for &slot in &stream.subscriptions {
                let state = self.subscriptions.get(slot).expect("listed slots are live");
                assert_eq!(
                    &*state.stream, &**name,
                    "a subscription lists its own stream"
                );
                let listings = state
                    .shards
                    .iter()
                    .filter(|&&shard| stream.shards[shard as usize].subscribers.contains(&slot))
                    .count();
                assert_eq!(
                    listings,
                    state.shards.len(),
                    "listed on each selected shard"
                );
                linked += 1;
            }
        }
        assert_eq!(
            linked,
            self.subscriptions.len(),
            "every subscription is linked"
        );
    }
}

/// Queues a freshly appended `record` for every subscription covering its shard; ends (and
/// collects in `lagged`) those it would push over their bounds.
fn fan_out(
    shards: &[Shard],
    record: &DeliveredRecord,
    subscriptions: &mut Subscriptions,
    events: &mut VecDeque<EngineEvent>,
    queue_max_bytes: u64,
    lagged: &mut Vec<Lagged>,
) {
    let len = ring::payload_len(record);
    for &slot in &shards[record.shard as usize].subscribers {
        // A subscription ended earlier in this publish stays listed until the publish ends.
        let Some(state) = subscriptions.get_mut(slot) else {
            continue;
        };
        if state.would_lag(len, queue_max_bytes) {
            let state = subscriptions.remove(slot);
            let error = EngineError::new(
                ErrorCode::SubscriberLagged,
                0,
                lag_message(&state, shards, record, queue_max_bytes),
            );
            events.push_back(EngineEvent::SubscriptionEnded(state.id, error));
            lagged.push(Lagged {
                slot,
                shards: state.shards,
            });
            continue;
        }
        if state.push_live(record.clone()) {
            events.push_back(EngineEvent::DeliveryReady(state.id));
        }
    }
}

/// The `SubscriberLagged` message: for each subscribed shard, the next offset the subscriber
/// would have received (`shard:next_offset`), so it can resume from there. `trigger` is the
/// record that did not fit (already given its offset, not queued).
fn lag_message(
    state: &SubState,
    shards: &[Shard],
    trigger: &DeliveredRecord,
    queue_max_bytes: u64,
) -> String {
    // Every record appended to a subscribed shard so far was queued (or taken), except the
    // trigger: with nothing queued for a shard, it resumes at the shard's next offset.
    let mut resume: Vec<u64> = state
        .shards
        .iter()
        .map(|&shard| {
            if shard == trigger.shard {
                trigger.offset
            } else {
                shards[shard as usize].next_offset()
            }
        })
        .collect();
    // Otherwise at its oldest queued record (walk newest first so the oldest wins).
    for queued in state.queue.iter().rev() {
        let position = state
            .shards
            .binary_search(&queued.shard)
            .expect("only selected shards are queued");
        resume[position] = queued.offset;
    }
    const ELLIPSIS: &str = " ...";
    let mut message = format!(
        "subscriber fell behind live delivery (over {queue_max_bytes} payload bytes or \
         {SUBSCRIBER_QUEUE_MAX_LIVE_RECORDS} records queued); resume from shard:next_offset"
    );
    let mut entry = String::new();
    for (shard, offset) in state.shards.iter().zip(&resume) {
        entry.clear();
        // Writing to a String cannot fail.
        write!(entry, " {shard}:{offset}").expect("String writes are infallible");
        if message.len() + entry.len() + ELLIPSIS.len() > ERROR_MESSAGE_MAX_BYTES {
            message.push_str(ELLIPSIS);
            break;
        }
        message.push_str(&entry);
    }
    message
}

fn describe(name: &str, stream: &Stream) -> StreamDescription {
    StreamDescription {
        name: name.to_owned(),
        kind: stream.kind,
        hash: HashKind::Fnv1a64Mod,
        shards: stream
            .shards
            .iter()
            .zip(0..)
            .map(|(shard, index)| shard.state(index))
            .collect(),
    }
}
