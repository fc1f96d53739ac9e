//! The engine of one data-plane core: its streams (with their shards and replay rings), its
//! subscriptions, and the durable side (append requests, log reads, tracked publishes). See
//! the crate docs for the call and drain protocol.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;

use bytes::Bytes;
use felix_wire::{
    DeliveredRecord, ErrorCode, HashKind, Record, ShardAck, ShardSelection, StartPosition,
    StreamKind,
};

use crate::durable::{DurableShard, Tracker, Waiter, storage_full};
use crate::ring::Held;
use crate::shard::Shard;
use crate::stream::{Stream, StreamSlot, StreamTable, check_name};
use crate::subscription::{Cursor, Phase, Slot, SubState, Subscriptions, select_shards};
use crate::{
    AppendRequest, CATCH_UP_REFILL_RECORDS, DURABLE_SHARDS_MAX, DURABLE_STREAM_ID_MAX,
    DurableCounters, ERROR_MESSAGE_BYTES_MAX, EngineConfig, EngineCounters, EngineError,
    EngineEvent, LOG_READ_BYTES_MAX, LOG_READ_RECORDS_MAX, LogRead, LogRecord, LogShardId,
    PublishCompletion, PublishToken, RING_COPY_RATIO, RecordBuffers,
    SUBSCRIBER_QUEUE_LIVE_RECORDS_MAX, StreamDescription, StreamHandle, StreamMeta, Subscription,
    SubscriptionId, ring,
};

/// A subscription ended by the lag bound during a publish, detached when the publish ends.
#[derive(Debug)]
struct Lagged {
    slot: Slot,
    shards: Box<[u32]>,
}

/// All streams and shards of one core, with their subscribers.
pub struct Engine {
    config: EngineConfig,
    streams: StreamTable,
    subscriptions: Subscriptions,
    /// Bounded by the subscriptions: at most one `DeliveryReady` per subscription per drain of
    /// its queue, and one `SubscriptionEnded` per subscription.
    events: VecDeque<EngineEvent>,
    /// Counters other than `subscriptions_active` (derived from the slab).
    counters: EngineCounters,
    /// Scratch of `publish` / `publish_tracked` (each record's shard), kept to avoid an
    /// allocation per publish.
    routed_shards: Vec<u32>,
    /// Scratch of `publish_routed` (shards touched by the batch), kept to avoid an allocation
    /// per publish.
    touched_shards: Vec<u32>,
    /// Scratch of `publish_routed` and `handle_durable` (subscriptions ended by the lag bound).
    lagged: Vec<Lagged>,
    /// Whether durable streams may be created (`enable_durable`).
    durable_enabled: bool,
    /// Catalogue id -> slot of every durable stream, so log events reach their stream without
    /// hashing its name.
    durable_ids: HashMap<u32, StreamSlot>,
    /// Append requests in publish order. Bounded by the pending records, which ingress
    /// admission bounds (a durable publish holds its admission until durable): the shell
    /// moves them into the log while its pending bound has room, and leaves the rest here
    /// until the disk catches up (`peek_append`).
    appends: VecDeque<AppendRequest>,
    /// Log reads for catching-up subscriptions: at most one per catching-up (subscription,
    /// shard), plus stale ones of ended subscriptions that `poll_log_read` skips.
    log_reads: VecDeque<LogRead>,
    /// Tracked publishes and their completions.
    tracker: Tracker,
    /// Durable counters (`records_pending` is kept as a running gauge).
    durable_counters: DurableCounters,
    /// Id of the next record buffer ([`Held`]) the rings tell apart; never reused.
    next_buffer: u64,
}

impl Engine {
    #[must_use]
    pub fn new(config: EngineConfig) -> Engine {
        Engine {
            config,
            streams: StreamTable::default(),
            subscriptions: Subscriptions::new(),
            events: VecDeque::new(),
            counters: EngineCounters::default(),
            routed_shards: Vec::new(),
            touched_shards: Vec::new(),
            lagged: Vec::new(),
            durable_enabled: false,
            durable_ids: HashMap::new(),
            appends: VecDeque::new(),
            log_reads: VecDeque::new(),
            tracker: Tracker::default(),
            durable_counters: DurableCounters::default(),
            next_buffer: 0,
        }
    }

    /// Allows durable streams ([`Engine::create_durable_stream`],
    /// [`Engine::restore_durable_stream`]); the shell calls it once it has a log for this core.
    pub fn enable_durable(&mut self) {
        self.durable_enabled = true;
    }

    /// Whether durable streams may be created.
    #[must_use]
    pub fn durable_enabled(&self) -> bool {
        self.durable_enabled
    }

    /// Checks a create without doing it, changing nothing: `Ok` means the same create
    /// succeeds now. In-memory kind: the checks of [`Engine::create_stream`] (name, shard
    /// count 1..=max_shards, name free). `Durable`: those of [`Engine::create_durable_stream`]
    /// except the catalogue id's (durable enabled, name, shard count
    /// 1..=min(max_shards, DURABLE_SHARDS_MAX), name free). Both: fewer than `max_streams`
    /// streams held. A shard count of 0 is `InvalidArgument`, one over a limit (and a stream
    /// beyond `max_streams`) `LimitExceeded` with the limit in `detail`. Same errors as the
    /// create, so a shell can validate, persist a catalogue entry, then create knowing it
    /// succeeds.
    pub fn check_create(
        &self,
        name: &str,
        shard_count: u32,
        kind: StreamKind,
    ) -> Result<(), EngineError> {
        self.check_new_stream(name, shard_count, kind)?;
        if shard_count > self.config.max_shards {
            return Err(EngineError::new(
                ErrorCode::LimitExceeded,
                u64::from(self.config.max_shards),
                format!(
                    "shard count {shard_count} exceeds the limit of {} shards per stream \
                     (FELIX_MAX_SHARDS_PER_STREAM)",
                    self.config.max_shards
                ),
            ));
        }
        if self.streams.len() >= self.config.max_streams as usize {
            return Err(EngineError::new(
                ErrorCode::LimitExceeded,
                u64::from(self.config.max_streams),
                format!(
                    "the broker holds its limit of {} streams (FELIX_MAX_STREAMS)",
                    self.config.max_streams
                ),
            ));
        }
        Ok(())
    }

    /// What any new stream must satisfy, restored ones included: the configured limits
    /// (FELIX_MAX_STREAMS, FELIX_MAX_SHARDS_PER_STREAM) apply to creates only, so lowering one
    /// never stops a broker from restoring the streams it already has.
    fn check_new_stream(
        &self,
        name: &str,
        shard_count: u32,
        kind: StreamKind,
    ) -> Result<(), EngineError> {
        if kind == StreamKind::Durable && !self.durable_enabled {
            return Err(durable_disabled());
        }
        check_name(name, self.config.max_name_bytes)?;
        if shard_count == 0 {
            return Err(EngineError::invalid(
                "invalid shard count 0: a stream has at least 1 shard".to_owned(),
            ));
        }
        if kind == StreamKind::Durable && shard_count > DURABLE_SHARDS_MAX {
            return Err(EngineError::new(
                ErrorCode::LimitExceeded,
                u64::from(DURABLE_SHARDS_MAX),
                format!(
                    "shard count {shard_count} exceeds the limit of {DURABLE_SHARDS_MAX} shards \
                     of a durable stream"
                ),
            ));
        }
        if self.streams.contains(name) {
            return Err(EngineError::new(
                ErrorCode::StreamExists,
                0,
                format!("stream {name:?} already exists"),
            ));
        }
        Ok(())
    }

    /// Creates a stream. Names: 1..=max_name_bytes of `[A-Za-z0-9._-]`; shard count
    /// 1..=max_shards. Durable streams are refused here (`InvalidArgument`, before any other
    /// check): they need a catalogue id, see [`Engine::create_durable_stream`].
    pub fn create_stream(
        &mut self,
        name: &str,
        shard_count: u32,
        kind: StreamKind,
    ) -> Result<StreamDescription, EngineError> {
        if kind == StreamKind::Durable {
            return Err(if self.durable_enabled {
                EngineError::invalid(
                    "a durable stream is created with its catalogue id (create_durable_stream)"
                        .to_owned(),
                )
            } else {
                durable_disabled()
            });
        }
        self.check_create(name, shard_count, kind)?;
        let shards = (0..shard_count)
            .map(|_| Shard::new(self.config.ring_max_records, self.config.ring_max_bytes))
            .collect();
        let stream = Stream {
            name: Box::from(name),
            kind,
            shards,
            subscriptions: Vec::new(),
            stream_id: None,
        };
        let description = describe(&stream);
        self.streams.insert(stream);
        Ok(description)
    }

    /// Creates an empty durable stream (needs [`Engine::enable_durable`]). `stream_id` is
    /// the shell's catalogue id: at most [`DURABLE_STREAM_ID_MAX`], never reused, and not in
    /// use by another stream of this engine; shard `s` is stored in the log as
    /// `LogShardId::new(stream_id, s)`. Shard count 1..=min(max_shards, DURABLE_SHARDS_MAX).
    pub fn create_durable_stream(
        &mut self,
        name: &str,
        shard_count: u32,
        stream_id: u32,
    ) -> Result<StreamDescription, EngineError> {
        self.add_durable_stream(name, shard_count, stream_id, None)
    }

    /// Recreates a durable stream after a restart from the log's per-shard
    /// `(oldest_offset, next_offset)` (one pair per shard; `oldest <= next`): every record is
    /// durable in the log, the ring is empty, and catch-up reads come from the log. Same
    /// rules as [`Engine::create_durable_stream`].
    pub fn restore_durable_stream(
        &mut self,
        name: &str,
        shard_count: u32,
        stream_id: u32,
        offsets: &[(u64, u64)],
    ) -> Result<StreamDescription, EngineError> {
        self.add_durable_stream(name, shard_count, stream_id, Some(offsets))
    }

    fn add_durable_stream(
        &mut self,
        name: &str,
        shard_count: u32,
        stream_id: u32,
        offsets: Option<&[(u64, u64)]>,
    ) -> Result<StreamDescription, EngineError> {
        if offsets.is_some() {
            self.check_new_stream(name, shard_count, StreamKind::Durable)?;
        } else {
            self.check_create(name, shard_count, StreamKind::Durable)?;
        }
        if stream_id > DURABLE_STREAM_ID_MAX {
            return Err(EngineError::invalid(format!(
                "stream id {stream_id} is over the limit of {DURABLE_STREAM_ID_MAX}"
            )));
        }
        if let Some(offsets) = offsets {
            if offsets.len() != shard_count as usize {
                return Err(EngineError::invalid(format!(
                    "{} shard offsets given for a stream of {shard_count} shards",
                    offsets.len()
                )));
            }
            if let Some((shard, &(oldest, next))) = offsets
                .iter()
                .enumerate()
                .find(|(_, (oldest, next))| oldest > next)
            {
                return Err(EngineError::invalid(format!(
                    "shard {shard}: oldest offset {oldest} is beyond next offset {next}"
                )));
            }
        }
        if let Some(&other) = self.durable_ids.get(&stream_id) {
            return Err(EngineError::invalid(format!(
                "stream id {stream_id} is in use by stream {:?}",
                self.streams.get(other).name
            )));
        }
        let shards = (0..shard_count)
            .map(|shard| {
                let (oldest, next) = offsets.map_or((0, 0), |offsets| offsets[shard as usize]);
                let log_shard = LogShardId::new(stream_id, shard)
                    .expect("stream id and shard were checked against the id bits");
                Shard::new_durable(
                    self.config.ring_max_records,
                    self.config.ring_max_bytes,
                    DurableShard::new(log_shard, oldest, next),
                )
            })
            .collect();
        let stream = Stream {
            name: Box::from(name),
            kind: StreamKind::Durable,
            shards,
            subscriptions: Vec::new(),
            stream_id: Some(stream_id),
        };
        let description = describe(&stream);
        let slot = self.streams.insert(stream);
        self.durable_ids.insert(stream_id, slot);
        Ok(description)
    }

    /// The log shard id of `shard` of a durable stream; `None` for an unknown stream, an
    /// in-memory stream or a shard out of range.
    #[must_use]
    pub fn log_shard(&self, stream: &str, shard: u32) -> Option<LogShardId> {
        let target = self.streams.by_name(stream)?;
        let owner = target.shards.get(shard as usize)?;
        owner.durable.as_ref().map(|durable| durable.log_shard)
    }

    /// Offset below which every record of `shard` is durable (released to subscribers);
    /// `None` for an unknown stream, an in-memory stream or a shard out of range.
    #[must_use]
    pub fn durable_through(&self, stream: &str, shard: u32) -> Option<u64> {
        let target = self.streams.by_name(stream)?;
        let owner = target.shards.get(shard as usize)?;
        owner.durable.as_ref().map(|durable| durable.durable)
    }

    pub fn describe_stream(&self, name: &str) -> Result<StreamDescription, EngineError> {
        let stream = self
            .streams
            .by_name(name)
            .ok_or_else(|| EngineError::stream_not_found(name))?;
        Ok(describe(stream))
    }

    /// The handle, kind and shard count of the stream called `name`; one hash lookup. The
    /// handle stays valid until the stream is deleted.
    #[must_use]
    pub fn lookup(&self, name: &str) -> Option<StreamMeta> {
        let slot = self.streams.slot_of(name)?;
        let stream = self.streams.get(slot);
        Some(StreamMeta {
            handle: self.streams.handle(slot),
            kind: stream.kind,
            shard_count: stream.shard_count(),
        })
    }

    /// `(name, kind, shard_count)` of every stream, sorted by name.
    #[must_use]
    pub fn list_streams(&self) -> Vec<(String, StreamKind, u32)> {
        let mut streams: Vec<(String, StreamKind, u32)> = self
            .streams
            .iter()
            .map(|(_, stream)| (stream.name.to_string(), stream.kind, stream.shard_count()))
            .collect();
        streams.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        streams
    }

    /// Deletes a stream; its subscriptions end with `StreamNotFound` events. For a durable
    /// stream its pending records are dropped (with their queued append requests), tracked
    /// publishes still waiting fail with `StreamNotFound`, and later log events naming its
    /// log shards are ignored. The records already in the log stay there (the log deletes
    /// by retention only). Handles to the stream go stale, even once a stream of the same name
    /// is created again.
    pub fn delete_stream(&mut self, name: &str) -> Result<(), EngineError> {
        let (_, mut stream) = self
            .streams
            .remove(name)
            .ok_or_else(|| EngineError::stream_not_found(name))?;
        if let Some(stream_id) = stream.stream_id {
            let removed = self.durable_ids.remove(&stream_id);
            assert!(removed.is_some(), "a durable stream is catalogued");
            // O(queued appends): deleting a stream is rare.
            self.appends
                .retain(|request| request.log_shard.stream_id() != stream_id);
            let error = EngineError::new(
                ErrorCode::StreamNotFound,
                0,
                format!("stream {name:?} was deleted before the publish was durable"),
            );
            for shard in &mut stream.shards {
                let durable = shard
                    .durable
                    .as_mut()
                    .expect("a durable stream's shards are durable");
                let dropped = durable.pending.len() as u64;
                self.durable_counters.records_rolled_back += dropped;
                self.durable_counters.records_pending -= dropped;
                durable.pending.clear();
                for Waiter { slot, .. } in durable.waiters.drain(..) {
                    self.tracker.resolve(slot, Some(&error));
                }
            }
        }
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
    ///
    /// Durable stream: the same routing and offsets, but nothing reaches the ring or a
    /// subscriber yet: each record is held pending and queued as an [`AppendRequest`]
    /// ([`Engine::poll_append`]) until [`Engine::handle_durable`] covers it.
    pub fn publish(
        &mut self,
        now_us: u64,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<Vec<ShardAck>, EngineError> {
        self.publish_by_name(now_us, stream, records, None)
    }

    /// [`Engine::publish`], and tracks it: [`Engine::poll_completed_publish`] yields `token`
    /// once every record is durable (`Ok`: send the ack), or with the error to answer
    /// (`StorageFull` after a disk-full rollback of any of its records, `StreamNotFound` if
    /// the stream is deleted first). An in-memory publish completes at once. A refused
    /// publish (the `Err` returned here) is not tracked. O(1) per shard touched.
    pub fn publish_tracked(
        &mut self,
        now_us: u64,
        stream: &str,
        records: Vec<Record>,
        token: PublishToken,
    ) -> Result<Vec<ShardAck>, EngineError> {
        self.publish_by_name(now_us, stream, records, Some(token))
    }

    /// [`Engine::publish`] (token `None`) or [`Engine::publish_tracked`]: looks the stream up
    /// and routes each record by its key, then [`Engine::publish_routed`].
    fn publish_by_name(
        &mut self,
        now_us: u64,
        stream: &str,
        records: Vec<Record>,
        token: Option<PublishToken>,
    ) -> Result<Vec<ShardAck>, EngineError> {
        let Some(meta) = self.lookup(stream) else {
            return Err(EngineError::stream_not_found(stream));
        };
        let mut shards = std::mem::take(&mut self.routed_shards);
        shards.clear();
        shards.extend(
            records
                .iter()
                .map(|record| felix_wire::shard_for_key(&record.key, meta.shard_count)),
        );
        let result = self.publish_routed(now_us, meta.handle, records, &shards, token);
        self.routed_shards = shards;
        result
    }

    /// [`Engine::publish`] (token `None`) or [`Engine::publish_tracked`] (token `Some`) by
    /// handle, with each record's shard given by the caller: `shards[i]` is
    /// `felix_wire::shard_for_key(&records[i].key, meta.shard_count)`, so the engine neither
    /// hashes a key nor looks the name up. Same semantics as those: every check before the
    /// first change, dense per-shard offsets in batch order, one ack per shard touched in
    /// ascending shard order, and for a durable stream pending records, append requests and
    /// tracked completions.
    ///
    /// A stale handle (its stream was deleted, even if a stream of the same name exists now)
    /// is `StreamNotFound` and changes nothing. `shards.len() != records.len()`, or a shard at
    /// or past the stream's shard count, is a caller defect and panics (before any change).
    ///
    /// Each record is taken as a buffer of its own ([`RecordBuffers::Own`]); records decoded
    /// from a frame go through [`Engine::publish_routed_from`].
    pub fn publish_routed(
        &mut self,
        now_us: u64,
        stream: StreamHandle,
        records: Vec<Record>,
        shards: &[u32],
        token: Option<PublishToken>,
    ) -> Result<Vec<ShardAck>, EngineError> {
        self.publish_routed_from(now_us, stream, records, shards, token, RecordBuffers::Own)
    }

    /// [`Engine::publish_routed`] of records whose keys and payloads keep `buffers` alive:
    /// what each shard's replay ring charges against its byte bound.
    ///
    /// [`RecordBuffers::Shared`]: the buffer is charged once by each ring that holds any of
    /// its records (a frame spread over several shards is counted in each of their rings:
    /// over-counted, never under). Where a shard's records of the publish are less than
    /// 1/[`RING_COPY_RATIO`] of the buffer (a few small records of a big frame, typically a
    /// stream with many shards or records of very different sizes), or the buffer is over the
    /// ring's byte bound (which could then keep none of them), and the shard's ring is
    /// enabled, each of those records' key and payload is copied into one buffer of its own
    /// and charged that size: a copy of at most 1/`RING_COPY_RATIO` of the frame per shard in
    /// the first case, so the copy the receive path saves stays saved for the common batches.
    pub fn publish_routed_from(
        &mut self,
        now_us: u64,
        stream: StreamHandle,
        records: Vec<Record>,
        shards: &[u32],
        token: Option<PublishToken>,
        buffers: RecordBuffers,
    ) -> Result<Vec<ShardAck>, EngineError> {
        // Every check comes before the first change: a refused batch changes nothing.
        let Some(slot) = self.streams.resolve(stream) else {
            return Err(stale_handle(stream));
        };
        let target = self.streams.get_mut(slot);
        assert_eq!(
            shards.len(),
            records.len(),
            "publish_routed takes one shard per record"
        );
        let shard_count = target.shard_count();
        for (index, &shard) in shards.iter().enumerate() {
            assert!(
                shard < shard_count,
                "publish_routed: record {index} is routed to shard {shard}, but stream {:?} \
                 has {shard_count} shards",
                target.name
            );
        }
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

        let mut touched = std::mem::take(&mut self.touched_shards);
        let mut lagged = std::mem::take(&mut self.lagged);
        assert!(
            touched.is_empty() && lagged.is_empty(),
            "scratch is left empty"
        );
        let shared = match buffers {
            RecordBuffers::Own => None,
            RecordBuffers::Shared { len } => {
                // What each shard takes of the buffer decides whether its ring copies.
                for (record, &shard) in records.iter().zip(shards) {
                    target.shards[shard as usize].batch_bytes +=
                        ring::own_len(&record.key, &record.payload);
                }
                Some(Held {
                    id: next_id(&mut self.next_buffer),
                    len,
                })
            }
        };
        let mut payload_bytes: u64 = 0;
        for (Record { key, payload }, &shard) in records.into_iter().zip(shards) {
            let index = shard as usize;
            // Append: the shard gives the offset.
            let owner = &mut target.shards[index];
            if owner.batch_records == 0 {
                touched.push(shard);
            }
            owner.batch_records += 1;
            let offset = owner.assign_offset();
            let (key, payload, held) = match shared {
                Some(held)
                    if !ring_keeps_whole(owner.ring_bound(), held.len, owner.batch_bytes) =>
                {
                    let (key, payload) = own_copy(&key, &payload);
                    let held = own_held(&mut self.next_buffer, &payload);
                    (key, payload, held)
                }
                Some(held) => (key, payload, held),
                None => {
                    let held = own_held(&mut self.next_buffer, &payload);
                    (key, payload, held)
                }
            };
            let record = DeliveredRecord {
                shard,
                offset,
                timestamp_us: now_us,
                key,
                payload,
            };
            payload_bytes += ring::payload_len(&record);
            if let Some(durable) = target.shards[index].durable.as_mut() {
                // Held until the log makes it durable; the shell appends it.
                self.appends.push_back(AppendRequest {
                    log_shard: durable.log_shard,
                    offset,
                    timestamp_us: now_us,
                    key: record.key.clone(),
                    payload: record.payload.clone(),
                });
                durable.pending.push_back((record, held));
                continue;
            }
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
            target.shards[index].retain(record, held);
        }

        touched.sort_unstable();
        let mut acks = Vec::with_capacity(touched.len());
        let mut acked_records: u32 = 0;
        for &shard in &touched {
            let owner = &mut target.shards[shard as usize];
            let count = owner.batch_records;
            assert!(count > 0, "a touched shard took a record");
            owner.batch_records = 0;
            owner.batch_bytes = 0;
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

        if target.stream_id.is_some() {
            self.durable_counters.records_appended += u64::from(record_count);
            self.durable_counters.records_pending += u64::from(record_count);
        }
        if let Some(token) = token {
            if target.stream_id.is_some() {
                // One waiter per shard range; acks.len() <= shard count, a u32.
                let ranges = u32::try_from(acks.len()).expect("at most one ack per shard");
                let slot = self.tracker.insert(token, ranges);
                for ack in &acks {
                    let durable = target.shards[ack.shard as usize]
                        .durable
                        .as_mut()
                        .expect("a durable stream's shards are durable");
                    durable.waiters.push_back(Waiter {
                        end: ack.first_offset + u64::from(ack.count),
                        slot,
                    });
                }
            } else {
                self.tracker.complete_now(token);
            }
        }
        self.counters.records_appended += u64::from(record_count);
        self.counters.payload_bytes_appended += payload_bytes;
        Ok(acks)
    }

    /// Next append request for the per-core log, in publish order. The shell appends each
    /// (`Log::append(request.log_shard.0, ...)`) once the log has room for it (see
    /// [`Engine::peek_append`]); if the log refuses one, it calls
    /// [`Engine::handle_rejected`] with that request's offset, which also drops the shard's
    /// later requests still queued here.
    #[must_use]
    pub fn poll_append(&mut self) -> Option<AppendRequest> {
        self.appends.pop_front()
    }

    /// The next append request, left queued: the shell looks at its size and takes it with
    /// [`Engine::poll_append`] only when the log has room (a slow disk makes it wait here).
    #[must_use]
    pub fn peek_append(&self) -> Option<&AppendRequest> {
        self.appends.front()
    }

    /// Whether append requests are queued ([`Engine::peek_append`]). O(1).
    #[must_use]
    pub fn has_appends(&self) -> bool {
        !self.appends.is_empty()
    }

    /// Whether log reads are queued ([`Engine::poll_log_read`]); may count stale reads of
    /// ended subscriptions, like [`Engine::has_log_work`]. O(1).
    #[must_use]
    pub fn has_log_reads(&self) -> bool {
        !self.log_reads.is_empty()
    }

    /// Whether append requests ([`Engine::poll_append`]) or log reads
    /// ([`Engine::poll_log_read`]) are queued, so the shell pumps its log only when there is
    /// work. O(1). It may say `true` for a queue holding only reads of subscriptions that ended
    /// since (`poll_log_read` skips them); once both are drained it is `false`.
    #[must_use]
    pub fn has_log_work(&self) -> bool {
        !self.appends.is_empty() || !self.log_reads.is_empty()
    }

    /// Next finished tracked publish (see [`Engine::publish_tracked`]).
    #[must_use]
    pub fn poll_completed_publish(&mut self) -> Option<PublishCompletion> {
        self.tracker.poll()
    }

    /// The log made the records of `log_shard` below `through_offset` durable (the shell
    /// calls it on `LogEvent::Synced` for on_commit logs, on `Written` for periodic ones).
    /// Those not yet released move, in order, to the ring (bounds as for in-memory) and to
    /// live subscribers; tracked publishes whose every range is now durable complete.
    /// Idempotent for offsets already durable; unknown log shards (a deleted stream) are
    /// ignored. `through_offset` beyond the shard's next offset is a shell defect (assert).
    pub fn handle_durable(&mut self, log_shard: LogShardId, through_offset: u64) {
        let Some(&slot) = self.durable_ids.get(&log_shard.stream_id()) else {
            return;
        };
        let target = self.streams.get_mut(slot);
        let index = log_shard.shard() as usize;
        assert!(index < target.shards.len(), "the log shard's shard exists");
        assert!(
            through_offset <= target.shards[index].next_offset(),
            "only appended records become durable"
        );
        let mut lagged = std::mem::take(&mut self.lagged);
        assert!(lagged.is_empty(), "scratch is left empty");
        let mut released: u64 = 0;
        loop {
            let durable = target.shards[index]
                .durable
                .as_mut()
                .expect("a catalogued stream's shards are durable");
            if durable.durable >= through_offset {
                break;
            }
            let (record, held) = durable
                .pending
                .pop_front()
                .expect("pending holds every record from durable to next");
            assert_eq!(record.offset, durable.durable, "released in offset order");
            durable.durable += 1;
            released += 1;
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
            target.shards[index].retain(record, held);
        }
        let durable = target.shards[index]
            .durable
            .as_mut()
            .expect("a catalogued stream's shards are durable");
        while let Some(waiter) = durable.waiters.front()
            && waiter.end <= durable.durable
        {
            self.tracker.resolve(waiter.slot, None);
            durable.waiters.pop_front();
        }
        for Lagged { slot, shards } in lagged.drain(..) {
            target.detach(slot, &shards);
        }
        self.lagged = lagged;
        self.durable_counters.records_durable += released;
        self.durable_counters.records_pending -= released;
    }

    /// The log rejected the appends of `log_shard` from `from_offset` on (disk full: the
    /// log's next offset for the shard went back to it; or an append the log refused). The
    /// shard's next offset goes back to `from_offset`, its pending records and queued append
    /// requests at or past it are dropped, and tracked publishes with records there fail with
    /// `StorageFull`. Offsets at or past the shard's next offset change nothing; unknown log
    /// shards are ignored. `from_offset` below the durable offset is a shell defect (assert).
    pub fn handle_rejected(&mut self, log_shard: LogShardId, from_offset: u64) {
        let Some(&slot) = self.durable_ids.get(&log_shard.stream_id()) else {
            return;
        };
        let target = self.streams.get_mut(slot);
        let index = log_shard.shard() as usize;
        assert!(index < target.shards.len(), "the log shard's shard exists");
        let owner = &mut target.shards[index];
        if from_offset >= owner.next_offset() {
            return;
        }
        owner.roll_back_to(from_offset);
        let durable = owner
            .durable
            .as_mut()
            .expect("a catalogued stream's shards are durable");
        // from_offset >= durable (checked by roll_back_to) and < next: a pending index.
        let kept = usize::try_from(from_offset - durable.durable).expect("within pending");
        let dropped = (durable.pending.len() - kept) as u64;
        durable.pending.truncate(kept);
        let error = storage_full(log_shard, from_offset);
        while let Some(waiter) = durable.waiters.back()
            && waiter.end > from_offset
        {
            self.tracker.resolve(waiter.slot, Some(&error));
            durable.waiters.pop_back();
        }
        // O(queued appends): a rollback is rare (disk full).
        self.appends
            .retain(|request| request.log_shard != log_shard || request.offset < from_offset);
        self.durable_counters.records_rolled_back += dropped;
        self.durable_counters.records_pending -= dropped;
    }

    /// The log's oldest retained offset of `log_shard` moved to `oldest_offset` (after
    /// `Log::apply_retention`): positions below it are now `TooOld`. Never moves backwards,
    /// nor past the durable offset; unknown log shards are ignored.
    pub fn handle_retention(&mut self, log_shard: LogShardId, oldest_offset: u64) {
        let Some(durable) = self.durable_shard_mut(log_shard) else {
            return;
        };
        durable.log_oldest = durable.log_oldest.max(oldest_offset.min(durable.durable));
    }

    fn durable_shard_mut(&mut self, log_shard: LogShardId) -> Option<&mut DurableShard> {
        let slot = *self.durable_ids.get(&log_shard.stream_id())?;
        self.streams
            .get_mut(slot)
            .shards
            .get_mut(log_shard.shard() as usize)?
            .durable
            .as_deref_mut()
    }

    /// Registers a subscription; catch-up records from the ring are queued immediately.
    /// A position older than the ring fails with `TooOld` (detail = oldest offset held,
    /// message names the shard); a position beyond `next_offset` is `InvalidArgument`, and so
    /// are an empty selection, a shard out of range, a shard selected twice, and a start offset
    /// for a shard outside the selection (or given twice): those shard checks are
    /// [`select_shards`]'s, made first, then the offsets are checked in the order given.
    /// Catch-up is queued shard by shard, ascending; a `DeliveryReady` follows if anything
    /// was queued.
    ///
    /// Durable stream: `Latest` is the durable offset (records still pending are delivered
    /// when they become durable), `Earliest` the log's oldest retained offset (or the ring's,
    /// if older). A start below the ring catches up from the log through
    /// [`Engine::poll_log_read`]; a start past the durable offset (up to the next offset)
    /// waits for that record.
    pub fn subscribe(
        &mut self,
        stream: &str,
        shards: &ShardSelection,
        from: &StartPosition,
    ) -> Result<Subscription, EngineError> {
        let Some(stream_slot) = self.streams.slot_of(stream) else {
            return Err(EngineError::stream_not_found(stream));
        };
        let target = self.streams.get_mut(stream_slot);
        // The shard checks (selection, which shards the offsets name): one copy, shared with
        // a shell that checks before it splits a subscription over cores.
        let selected = select_shards(shards, from, target.shard_count())?;

        let mut start: Vec<(u32, u64)> = selected
            .iter()
            .map(|&shard| {
                let owner = &target.shards[shard as usize];
                let offset = match from {
                    StartPosition::Earliest => owner.oldest_offset(),
                    StartPosition::Latest | StartPosition::Offsets(_) => owner.released_offset(),
                };
                (shard, offset)
            })
            .collect();
        if let StartPosition::Offsets(positions) = from {
            for &(shard, offset) in positions {
                // select_shards checked that each start offset names a selected shard, once.
                let position = selected
                    .binary_search(&shard)
                    .expect("start offsets name selected shards");
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
                    return Err(too_old(shard, offset, oldest));
                }
                start[position].1 = offset;
            }
        }

        // Registered: from here on nothing fails.
        let mut catch_up = VecDeque::new();
        let mut cursors = Vec::new();
        for &(shard, offset) in &start {
            let owner = &target.shards[shard as usize];
            if offset > owner.released_offset() {
                // Durable only: in-memory starts are at most next_offset == released.
                cursors.push(Cursor {
                    shard,
                    next: offset,
                    phase: Phase::AwaitingStart,
                });
            } else if offset >= owner.ring_oldest() {
                catch_up.extend(owner.replay_from(offset).cloned());
            } else {
                // Durable only (in memory, the oldest offset is the ring's): read the log.
                cursors.push(Cursor {
                    shard,
                    next: offset,
                    phase: Phase::Parked,
                });
            }
        }
        let slot = self.subscriptions.insert(|id| SubState {
            id,
            stream: stream_slot,
            shards: selected,
            catch_up,
            live: VecDeque::new(),
            live_bytes: 0,
            cursors,
        });
        let state = self.subscriptions.get_mut(slot).expect("just inserted");
        for &shard in &state.shards {
            target.shards[shard as usize].subscribers.push(slot);
        }
        target.subscriptions.push(slot);
        let id = state.id;
        // Start the log reads. Subscribe checked each start against the log's oldest, so none
        // of them fails here; a failure would end the subscription through an event.
        let ended = resume_parked(
            &target.shards,
            state,
            &mut self.log_reads,
            &mut self.durable_counters,
        );
        if state.queued() > 0 {
            self.events.push_back(EngineEvent::DeliveryReady(id));
        }
        if let Err(error) = ended {
            self.end_subscription(slot, error);
        }
        Ok(Subscription { id, start })
    }

    /// Next log read for a catching-up subscription (see [`LogRead`]); reads of
    /// subscriptions that ended since they were asked for are skipped.
    #[must_use]
    pub fn poll_log_read(&mut self) -> Option<LogRead> {
        while let Some(read) = self.log_reads.pop_front() {
            if self.subscriptions.slot_of(read.subscription).is_some() {
                return Some(read);
            }
        }
        None
    }

    /// The answer to a [`LogRead`]: the records `Log::read` returned, in order. They are
    /// queued for the subscription (those at or past the durable offset are dropped: they
    /// will be released live), then the engine asks for the next read, or switches the shard
    /// to the ring and to live delivery once the ring covers it. An empty answer means the
    /// log holds nothing more from the read's offset: the shard switches to the ring, and if
    /// the ring does not reach back that far the subscription ends with `StorageFailed`
    /// (records would be missing), as it does when the records are not dense from the read's
    /// offset. Answers for ended subscriptions, or not matching an outstanding read, are
    /// ignored.
    pub fn handle_log_records(
        &mut self,
        subscription: SubscriptionId,
        log_shard: LogShardId,
        records: Vec<LogRecord>,
    ) {
        let Some((slot, position)) = self.outstanding_read(subscription, log_shard) else {
            return;
        };
        // outstanding_read found the catalogue id, naming the subscription's stream.
        let target = self.streams.get(self.durable_ids[&log_shard.stream_id()]);
        let shard = log_shard.shard();
        let owner = &target.shards[shard as usize];
        let state = self
            .subscriptions
            .get_mut(slot)
            .expect("outstanding_read found it");
        let was_empty = state.queued() == 0;
        let released = owner.released_offset();
        let answered_empty = records.is_empty();
        let mut failure = None;
        for record in records {
            let cursor = &mut state.cursors[position];
            if record.offset != cursor.next {
                failure = Some(EngineError::new(
                    ErrorCode::StorageFailed,
                    0,
                    format!(
                        "the log returned offset {} of shard {shard} where {} was expected",
                        record.offset, cursor.next
                    ),
                ));
                break;
            }
            if record.offset >= released {
                break;
            }
            cursor.next += 1;
            self.durable_counters.log_records_read += 1;
            state.catch_up.push_back(DeliveredRecord {
                shard,
                offset: record.offset,
                timestamp_us: record.timestamp_us,
                key: record.key,
                payload: record.payload,
            });
        }
        let next = state.cursors[position].next;
        let ring_oldest = owner.ring_oldest();
        if failure.is_none() && answered_empty && next < ring_oldest {
            failure = Some(EngineError::new(
                ErrorCode::StorageFailed,
                0,
                format!(
                    "the log holds no record of shard {shard} from offset {next}, below the \
                     oldest held in memory ({ring_oldest})"
                ),
            ));
        }
        let result = match failure {
            Some(error) => Err(error),
            None => advance_cursor(
                owner,
                state,
                position,
                &mut self.log_reads,
                &mut self.durable_counters,
            ),
        };
        if was_empty && state.queued() > 0 {
            self.events.push_back(EngineEvent::DeliveryReady(state.id));
        }
        if let Err(error) = result {
            self.end_subscription(slot, error);
        }
    }

    /// Part of the answer to a [`LogRead`]: the log holds no record from the read's offset up
    /// to `to_offset`, offsets `felix log repair` quarantined (records lost to damage: never
    /// reused). The subscription's cursor on that shard moves to `to_offset` (counted in
    /// `DurableCounters::quarantine_skipped`); the records from there, if any, are answered
    /// next with [`Engine::handle_log_records`]. The subscriber sees a gap of exactly those
    /// offsets. Ignored like [`Engine::handle_log_records`], and when `to_offset` is not past
    /// the cursor or reaches past the released records.
    pub fn handle_log_skip(
        &mut self,
        subscription: SubscriptionId,
        log_shard: LogShardId,
        to_offset: u64,
    ) {
        let Some((slot, position)) = self.outstanding_read(subscription, log_shard) else {
            return;
        };
        let target = self.streams.get(self.durable_ids[&log_shard.stream_id()]);
        let released = target.shards[log_shard.shard() as usize].released_offset();
        let state = self
            .subscriptions
            .get_mut(slot)
            .expect("outstanding_read found it");
        let cursor = &mut state.cursors[position];
        if to_offset <= cursor.next || to_offset > released {
            return;
        }
        self.durable_counters.quarantine_skipped += to_offset - cursor.next;
        cursor.next = to_offset;
    }

    /// The answer to a [`LogRead`] that the log refused because retention deleted the
    /// records (`OffsetTooOld { oldest }`): the subscription ends with `TooOld` (detail =
    /// `oldest_offset`), and the shard's oldest offset moves up as by
    /// [`Engine::handle_retention`]. Ignored like [`Engine::handle_log_records`].
    pub fn handle_log_read_too_old(
        &mut self,
        subscription: SubscriptionId,
        log_shard: LogShardId,
        oldest_offset: u64,
    ) {
        let Some((slot, position)) = self.outstanding_read(subscription, log_shard) else {
            return;
        };
        self.handle_retention(log_shard, oldest_offset);
        let state = self
            .subscriptions
            .get(slot)
            .expect("outstanding_read found it");
        let error = too_old(
            log_shard.shard(),
            state.cursors[position].next,
            oldest_offset,
        );
        self.end_subscription(slot, error);
    }

    /// The slot of `subscription` and the position of its cursor on `log_shard`'s shard, if
    /// a read for it is outstanding.
    fn outstanding_read(
        &self,
        subscription: SubscriptionId,
        log_shard: LogShardId,
    ) -> Option<(Slot, usize)> {
        let slot = self.subscriptions.slot_of(subscription)?;
        let &stream = self.durable_ids.get(&log_shard.stream_id())?;
        let state = self.subscriptions.get(slot)?;
        // Both name live streams, so equal slots are the same stream.
        if state.stream != stream {
            return None;
        }
        let position = state.cursor_of(log_shard.shard())?;
        (state.cursors[position].phase == Phase::Reading).then_some((slot, position))
    }

    /// Ends a live subscription: forgets it and tells the shell why.
    fn end_subscription(&mut self, slot: Slot, error: EngineError) {
        let state = self.subscriptions.remove(slot);
        // Deleting a stream ends its subscriptions, so a live subscription's stream exists.
        self.streams
            .get_mut(state.stream)
            .detach(slot, &state.shards);
        self.events
            .push_back(EngineEvent::SubscriptionEnded(state.id, error));
    }

    /// Forgets a subscription (client went away). Unknown ids are ignored.
    pub fn unsubscribe(&mut self, id: SubscriptionId) {
        let Some(slot) = self.subscriptions.slot_of(id) else {
            return;
        };
        let state = self.subscriptions.remove(slot);
        // Deleting a stream ends its subscriptions, so a live subscription's stream exists.
        self.streams
            .get_mut(state.stream)
            .detach(slot, &state.shards);
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
        if state.catch_up.len() < CATCH_UP_REFILL_RECORDS
            && state
                .cursors
                .iter()
                .any(|cursor| cursor.phase == Phase::Parked)
        {
            let stream = self.streams.get(state.stream);
            let was_empty = state.queued() == 0;
            let ended = resume_parked(
                &stream.shards,
                state,
                &mut self.log_reads,
                &mut self.durable_counters,
            );
            if was_empty && state.queued() > 0 {
                self.events.push_back(EngineEvent::DeliveryReady(state.id));
            }
            if let Err(error) = ended {
                self.end_subscription(slot, error);
            }
        }
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
        self.streams.by_name(stream).map(Stream::shard_count)
    }

    /// Records waiting in a subscription's queue; `None` if the subscription is not live.
    #[must_use]
    pub fn queued_records(&self, id: SubscriptionId) -> Option<usize> {
        let slot = self.subscriptions.slot_of(id)?;
        self.subscriptions.get(slot).map(SubState::queued)
    }

    /// Durable-stream counters (the shell exports them).
    #[must_use]
    pub fn durable_counters(&self) -> DurableCounters {
        self.durable_counters
    }

    /// Tracked publishes not yet completed.
    #[must_use]
    pub fn tracked_publishes(&self) -> usize {
        self.tracker.len()
    }

    /// Tracked publishes whose completion was not reported yet (failed publishes whose
    /// other shard ranges still wait are not counted: their failure was reported). O(tracked
    /// publishes): for invariant checks.
    #[must_use]
    pub fn unreported_publishes(&self) -> usize {
        self.tracker.unreported()
    }

    /// Checks every invariant of the engine (dense offsets, ring and queue byte sums, the
    /// links between streams, shards and subscriptions). O(everything held): for tests and
    /// debugging, not the hot path.
    pub fn assert_invariants(&self) {
        self.subscriptions.assert_invariants();
        self.streams.assert_invariants();
        let mut linked: usize = 0;
        for (stream_slot, stream) in self.streams.iter() {
            assert!(!stream.shards.is_empty(), "a stream has at least one shard");
            for (index, shard) in stream.shards.iter().enumerate() {
                let index = u32::try_from(index).expect("shard count fits a u32");
                shard.assert_invariants(index);
                for &slot in &shard.subscribers {
                    let state = self.subscriptions.get(slot).expect("listed slots are live");
                    assert_eq!(
                        state.stream, stream_slot,
                        "a subscription lists its own stream"
                    );
                    assert!(state.shards.binary_search(&index).is_ok(), "selected shard");
                }
            }
            for &slot in &stream.subscriptions {
                let state = self.subscriptions.get(slot).expect("listed slots are live");
                assert_eq!(
                    state.stream, stream_slot,
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
        self.assert_durable_invariants();
    }

    /// The durable part of [`Engine::assert_invariants`]: catalogue, append queue, pending
    /// gauge, tracked publishes and catch-up cursors.
    fn assert_durable_invariants(&self) {
        let mut pending: u64 = 0;
        let mut durable_streams = 0usize;
        for (slot, stream) in self.streams.iter() {
            let Some(stream_id) = stream.stream_id else {
                assert_ne!(
                    stream.kind,
                    StreamKind::Durable,
                    "durable streams have an id"
                );
                assert!(
                    stream.shards.iter().all(|shard| shard.durable.is_none()),
                    "in-memory shards have no log"
                );
                continue;
            };
            durable_streams += 1;
            assert_eq!(stream.kind, StreamKind::Durable);
            assert_eq!(
                self.durable_ids.get(&stream_id),
                Some(&slot),
                "the catalogue names the stream's slot"
            );
            for (index, shard) in stream.shards.iter().enumerate() {
                let durable = shard.durable.as_ref().expect("durable shards");
                assert_eq!(
                    Some(durable.log_shard),
                    LogShardId::new(stream_id, u32::try_from(index).expect("u32 shards")),
                    "log shard id = (stream_id << bits) | shard"
                );
                pending += durable.pending.len() as u64;
            }
        }
        assert_eq!(
            durable_streams,
            self.durable_ids.len(),
            "catalogue == streams"
        );
        assert_eq!(
            pending, self.durable_counters.records_pending,
            "the pending gauge counts pending records"
        );
        // Queued appends are pending records, ascending per log shard.
        let mut last: HashMap<LogShardId, u64> = HashMap::new();
        for request in &self.appends {
            let stream = self
                .streams
                .get(self.durable_ids[&request.log_shard.stream_id()]);
            let shard = &stream.shards[request.log_shard.shard() as usize];
            let durable = shard.durable.as_ref().expect("durable shards");
            assert!(
                request.offset >= durable.durable,
                "queued appends are pending"
            );
            assert!(
                request.offset < shard.next_offset(),
                "queued appends were given offsets"
            );
            if let Some(previous) = last.insert(request.log_shard, request.offset) {
                assert_eq!(previous + 1, request.offset, "appends dense, in order");
            }
        }
        self.tracker
            .assert_invariants(self.streams.iter().flat_map(|(_, stream)| {
                stream
                    .shards
                    .iter()
                    .filter_map(|shard| shard.durable.as_ref())
                    .flat_map(|durable| durable.waiters.iter())
            }));
        for (_, state) in self.subscriptions.iter() {
            let stream = self.streams.get(state.stream);
            for cursor in &state.cursors {
                let shard = &stream.shards[cursor.shard as usize];
                assert!(shard.durable.is_some(), "only durable shards have cursors");
                match cursor.phase {
                    Phase::AwaitingStart => {
                        assert!(cursor.next >= shard.released_offset(), "start not released")
                    }
                    Phase::Reading | Phase::Parked => {
                        assert!(cursor.next < shard.released_offset(), "catching up below")
                    }
                }
            }
        }
    }
}

/// Queues a freshly appended `record` for every subscription covering its shard; ends (and
/// collects in `lagged`) those it would push over their bounds.
/// Gives a record buffer its id.
fn next_id(next: &mut u64) -> u64 {
    let id = *next;
    // 2^64 buffers cannot be published in the life of a process.
    *next = id.checked_add(1).expect("buffer ids never wrap");
    id
}

/// The buffer of a record whose key and payload are buffers of their own: charged its
/// payload length (its key, at most `Limits::max_key_bytes`, is not counted; see
/// [`RecordBuffers::Own`]).
fn own_held(next: &mut u64, payload: &Bytes) -> Held {
    Held {
        id: next_id(next),
        len: payload.len() as u64,
    }
}

/// Whether a shard whose ring is `ring_bound` (`None`: disabled) keeps its records of a publish
/// as slices of their `buffer_len`-byte buffer, their keys and payloads being `batch_bytes`:
/// not when the buffer would be over `RING_COPY_RATIO` times what they are, nor over the
/// ring's bound ([`Engine::publish_routed_from`]).
fn ring_keeps_whole(ring_bound: Option<u64>, buffer_len: u64, batch_bytes: u64) -> bool {
    match ring_bound {
        None => true,
        Some(max_bytes) => {
            buffer_len <= max_bytes && buffer_len <= batch_bytes.saturating_mul(RING_COPY_RATIO)
        }
    }
}

/// A copy of `key` and `payload` in one buffer of exactly their size.
fn own_copy(key: &Bytes, payload: &Bytes) -> (Bytes, Bytes) {
    let mut buffer = bytes::BytesMut::with_capacity(key.len() + payload.len());
    buffer.extend_from_slice(key);
    buffer.extend_from_slice(payload);
    let mut payload = buffer.freeze();
    let key = payload.split_to(key.len());
    (key, payload)
}

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
        if let Some(position) = state.cursor_of(record.shard) {
            let cursor = state.cursors[position];
            match cursor.phase {
                // Still catching up: the log read reaches this record.
                Phase::Reading | Phase::Parked => continue,
                Phase::AwaitingStart if record.offset < cursor.next => continue,
                Phase::AwaitingStart => {
                    assert_eq!(record.offset, cursor.next, "released records are dense");
                    state.cursors.remove(position);
                }
            }
        }
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
    // Every record released to a subscribed shard so far was queued (or taken), except the
    // trigger: with nothing queued for a shard, it resumes at the shard's released offset,
    // or at its cursor while it catches up (or waits for its start).
    let mut resume: Vec<u64> = state
        .shards
        .iter()
        .map(|&shard| {
            if let Some(position) = state.cursor_of(shard) {
                state.cursors[position].next
            } else if shard == trigger.shard {
                trigger.offset
            } else {
                shards[shard as usize].released_offset()
            }
        })
        .collect();
    // Otherwise at its oldest queued record (walk newest first so the oldest wins).
    for queued in state.live.iter().rev().chain(state.catch_up.iter().rev()) {
        let position = state
            .shards
            .binary_search(&queued.shard)
            .expect("only selected shards are queued");
        resume[position] = queued.offset;
    }
    const ELLIPSIS: &str = " ...";
    let mut message = format!(
        "subscriber fell behind live delivery (over {queue_max_bytes} payload bytes or \
         {SUBSCRIBER_QUEUE_LIVE_RECORDS_MAX} records queued); resume from shard:next_offset"
    );
    let mut entry = String::new();
    for (shard, offset) in state.shards.iter().zip(&resume) {
        entry.clear();
        // Writing to a String cannot fail.
        write!(entry, " {shard}:{offset}").expect("String writes are infallible");
        if message.len() + entry.len() + ELLIPSIS.len() > ERROR_MESSAGE_BYTES_MAX {
            message.push_str(ELLIPSIS);
            break;
        }
        message.push_str(&entry);
    }
    message
}

/// Moves the catching-up cursor at `position` of `state` (on `owner`, its shard) on: to the
/// ring and live delivery when the ring covers it, else to its next log read, or parks it
/// while the catch-up queue is full. `Err` when the subscription must end (records gone).
fn advance_cursor(
    owner: &Shard,
    state: &mut SubState,
    position: usize,
    log_reads: &mut VecDeque<LogRead>,
    counters: &mut DurableCounters,
) -> Result<(), EngineError> {
    let cursor = state.cursors[position];
    assert_ne!(
        cursor.phase,
        Phase::AwaitingStart,
        "only catching-up cursors read"
    );
    assert!(
        cursor.next <= owner.released_offset(),
        "catch-up stays below the released records"
    );
    let ring_oldest = owner.ring_oldest();
    if cursor.next >= ring_oldest {
        // The ring holds everything from here to the released offset, and every later
        // record is released live: no gap, no duplicate.
        state
            .catch_up
            .extend(owner.replay_from(cursor.next).cloned());
        state.cursors.remove(position);
        return Ok(());
    }
    let durable = owner
        .durable
        .as_ref()
        .expect("only durable shards start below the ring");
    if cursor.next < durable.log_oldest {
        return Err(too_old(cursor.shard, cursor.next, durable.log_oldest));
    }
    if state.catch_up.len() >= CATCH_UP_REFILL_RECORDS {
        state.cursors[position].phase = Phase::Parked;
        return Ok(());
    }
    // next < ring_oldest, so at least one record is asked for.
    let below_ring = usize::try_from(ring_oldest - cursor.next).unwrap_or(usize::MAX);
    log_reads.push_back(LogRead {
        subscription: state.id,
        log_shard: durable.log_shard,
        from_offset: cursor.next,
        max_records: below_ring.min(LOG_READ_RECORDS_MAX),
        max_bytes: LOG_READ_BYTES_MAX,
    });
    state.cursors[position].phase = Phase::Reading;
    counters.log_reads += 1;
    Ok(())
}

/// Advances every parked cursor of `state` (on `shards`, its stream's); stops at the first
/// that ends the subscription.
fn resume_parked(
    shards: &[Shard],
    state: &mut SubState,
    log_reads: &mut VecDeque<LogRead>,
    counters: &mut DurableCounters,
) -> Result<(), EngineError> {
    // Newest position first: advancing may remove the cursor, which shifts later ones only.
    for position in (0..state.cursors.len()).rev() {
        let cursor = state.cursors[position];
        if cursor.phase == Phase::Parked {
            advance_cursor(
                &shards[cursor.shard as usize],
                state,
                position,
                log_reads,
                counters,
            )?;
        }
    }
    Ok(())
}

/// `TooOld` for a start (or catch-up position) `offset` below `oldest` on `shard`.
fn too_old(shard: u32, offset: u64, oldest: u64) -> EngineError {
    EngineError::new(
        ErrorCode::TooOld,
        oldest,
        format!(
            "offset {offset} of shard {shard} is older than the oldest record still held \
             ({oldest})"
        ),
    )
}

fn durable_disabled() -> EngineError {
    EngineError::invalid("durable streams are not available in this build yet".to_owned())
}

/// `StreamNotFound` for a handle whose stream was deleted (or of another engine).
fn stale_handle(handle: StreamHandle) -> EngineError {
    EngineError::new(
        ErrorCode::StreamNotFound,
        0,
        format!(
            "stream handle {}.{} is stale: its stream was deleted (look the stream up again)",
            handle.slot, handle.generation
        ),
    )
}

fn describe(stream: &Stream) -> StreamDescription {
    StreamDescription {
        name: stream.name.to_string(),
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
