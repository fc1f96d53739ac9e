//! Publishing on one core: admission through the ingress queue, the shard of each record
//! computed once, the split by owner core, the parts' answers merged into one `Ack`, and the
//! owner's side of a forwarded part (docs/semantics.md, 3 Publishing).
//!
//! A publish holds its ingress job from admission until every part is answered: applied here
//! (in-memory), committed here (durable), or answered by its owner core. A durable ack is one
//! output of the machine: the engine's completion resolves the part, the merged `Ack` is
//! encoded on the stream it answers and the stream's writer is woken.

use felix_auth::Operation;
use felix_engine::{EngineError, PublishToken, RecordBuffers, StreamMeta};
use felix_wire::{AckMode, ErrorCode, ErrorFrame, Frame, Publish, Record, ShardAck, StreamKind};

use crate::producer::{JournalEntry, Produced, ProducerTag, Verdict};

use crate::admission::{Decision, Policy, Ticket};
use crate::cluster::Target;
use crate::config::{INGRESS_EXHAUSTED_MESSAGE, Now, StreamId};
use crate::core::{Core, Flow, Parked, Request, sort_acks};
use crate::message::CoreMessage;

/// An admitted publish whose parts are not all answered yet (origin core).
#[derive(Debug)]
pub(crate) struct PendingPublish {
    pub(crate) stream: StreamId,
    request_id: u64,
    ack: AckMode,
    payload_bytes: u64,
    records: u64,
    /// Parts still to be answered (this core's durable part, and one per owner core).
    parts: u16,
    acks: Vec<ShardAck>,
    /// The first error a part answered with; the publish answers it.
    error: Option<EngineError>,
}

impl PendingPublish {
    /// A publish waiting for `parts` answers.
    pub(crate) fn new(
        stream: StreamId,
        request_id: u64,
        ack: AckMode,
        payload_bytes: u64,
        records: u64,
        parts: u16,
    ) -> PendingPublish {
        PendingPublish {
            stream,
            request_id,
            ack,
            payload_bytes,
            records,
            parts,
            acks: Vec::new(),
            error: None,
        }
    }
}

/// A durable publish (or part) the engine tracks until its records are committed.
#[derive(Debug)]
pub(crate) enum Tracked {
    /// This core's part of pending publish `publish` (its acks are already merged).
    Local {
        publish: u64,
        /// A producer batch: settled in the producer table once committed or failed.
        produced: Option<Produced>,
    },
    /// A part forwarded by core `from`: answer `PublishDone { token }` with `acks`.
    Remote {
        from: u16,
        token: u64,
        acks: Vec<ShardAck>,
        produced: Option<Produced>,
    },
}

impl Tracked {
    /// The producer batch this is, if any.
    pub(crate) fn produced(&self) -> Option<Produced> {
        match self {
            Tracked::Local { produced, .. } | Tracked::Remote { produced, .. } => *produced,
        }
    }
}

impl Core {
    /// A `Publish` frame: admit it, then run it, or park the stream while it waits for room.
    pub(crate) fn handle_publish(
        &mut self,
        now: Now,
        stream: StreamId,
        publish: Publish,
        producer: Option<ProducerTag>,
    ) -> Flow {
        self.counters.publishes += 1;
        let payload_bytes: u64 = publish
            .records
            .iter()
            .map(|record| record.payload.len() as u64)
            .sum();
        // Authorized by name before the lookup, so a refusal says nothing of the stream.
        if let Err(denied) = self.authorize(stream, Operation::Publish, &publish.stream) {
            self.answer_publish(stream, publish.request_id, publish.ack, Err(denied));
            return Flow::Continue;
        }
        // The stream's name is resolved here, once; the engine is then reached by handle.
        let Some(target) = self.target(&publish.stream) else {
            let error = EngineError::stream_not_found(&publish.stream);
            self.answer_publish(stream, publish.request_id, publish.ack, Err(error));
            return Flow::Continue;
        };
        let kind = match &target {
            Target::Local(meta) => meta.kind,
            // Replicated streams are durable: acked publishes wait for ingress room.
            Target::Cluster(_) => StreamKind::Durable,
        };
        match self.admission.handle_request(
            now.at,
            payload_bytes,
            self.policy(now, publish.ack, kind),
        ) {
            Decision::Admitted => {
                self.run_target(now, stream, publish, producer, target, payload_bytes);
                Flow::Continue
            }
            Decision::Shed => {
                self.counters.shed += 1;
                Flow::Continue
            }
            Decision::Refused => {
                self.refuse_publish(stream, publish.request_id);
                Flow::Continue
            }
            Decision::Waiting(ticket) => {
                self.counters.waits += 1;
                self.waiters.insert(ticket, stream);
                self.stream_mut(stream).parked = Some(Parked::Admission {
                    ticket,
                    publish,
                    producer,
                    payload_bytes,
                });
                Flow::Blocked
            }
        }
    }

    /// What a publish does when the ingress queue is full (docs/semantics.md, 3 Publishing).
    fn policy(&self, now: Now, ack: AckMode, kind: StreamKind) -> Policy {
        match ack {
            AckMode::FireAndForget if self.ingress.fire_and_forget_waits => {
                Policy::Wait { deadline: None }
            }
            AckMode::FireAndForget => Policy::Shed,
            // Durable streams ack after commit by default.
            AckMode::Acked if self.ingress.ack_on_commit || kind == StreamKind::Durable => {
                Policy::Wait {
                    deadline: Some(now.at + self.ingress.commit_wait),
                }
            }
            AckMode::Acked => Policy::Refuse,
        }
    }

    fn refuse_publish(&mut self, stream: StreamId, request_id: u64) {
        self.counters.refused += 1;
        self.write_error(
            stream,
            ErrorFrame {
                request_id,
                code: ErrorCode::IngressBudgetExhausted,
                detail: 0,
                message: INGRESS_EXHAUSTED_MESSAGE.to_owned(),
            },
        );
    }

    /// A parked publish got its room: run it (its stream may have been deleted meanwhile;
    /// the name is resolved again) and let its stream go on.
    pub(crate) fn admit_waiter(&mut self, now: Now, ticket: Ticket) {
        let stream = self
            .waiters
            .remove(&ticket)
            .expect("every admission waiter is registered");
        let Some(Parked::Admission {
            ticket: parked,
            publish,
            producer,
            payload_bytes,
        }) = self.stream_mut(stream).parked.take()
        else {
            panic!("a waiter's stream is parked on its publish");
        };
        assert_eq!(parked, ticket, "a stream parks one publish at a time");
        self.unpark(stream);
        match self.target(&publish.stream) {
            Some(target) => {
                self.run_target(now, stream, publish, producer, target, payload_bytes);
            }
            None => {
                self.complete_job(now, payload_bytes);
                let error = EngineError::stream_not_found(&publish.stream);
                self.answer_publish(stream, publish.request_id, publish.ack, Err(error));
            }
        }
    }

    /// A parked publish's deadline passed: it is refused, and its stream goes on.
    pub(crate) fn expire_waiter(&mut self, ticket: Ticket) {
        let stream = self
            .waiters
            .remove(&ticket)
            .expect("every admission waiter is registered");
        let Some(Parked::Admission { publish, .. }) = self.stream_mut(stream).parked.take() else {
            panic!("a waiter's stream is parked on its publish");
        };
        self.unpark(stream);
        self.refuse_publish(stream, publish.request_id);
    }

    /// Runs an admitted publish on its stream: this broker's own, or the cluster's.
    fn run_target(
        &mut self,
        now: Now,
        stream: StreamId,
        publish: Publish,
        producer: Option<ProducerTag>,
        target: Target,
        payload_bytes: u64,
    ) {
        match target {
            Target::Local(meta) => {
                self.run_publish(now, stream, publish, producer, meta, payload_bytes);
            }
            // Replicated streams: the producer fields go with the batch to the shard's Raft
            // group, which applies it once (cluster/src/shard.rs).
            Target::Cluster(shard_count) => {
                self.run_cluster_publish(
                    now,
                    stream,
                    publish,
                    producer,
                    shard_count,
                    payload_bytes,
                );
            }
        }
    }

    /// An admitted publish: each record's shard is computed here, once; the records this core
    /// owns go to its engine, the others to their owners in one message per owner core.
    fn run_publish(
        &mut self,
        now: Now,
        stream: StreamId,
        publish: Publish,
        producer: Option<ProducerTag>,
        meta: StreamMeta,
        payload_bytes: u64,
    ) {
        let Publish {
            request_id,
            ack,
            stream: name,
            records,
        } = publish;
        let record_count = records.len() as u64;
        let durable = meta.kind == StreamKind::Durable;
        let mut shards = std::mem::take(&mut self.scratch_shards);
        shards.clear();
        let mut local = true;
        let mut key_payload_bytes: usize = 0;
        for record in &records {
            let shard = felix_wire::shard_for_key(&record.key, meta.shard_count);
            local &= self.owner(shard) == self.index;
            shards.push(shard);
            key_payload_bytes += record.key.len() + record.payload.len();
        }
        // The decoder sliced every key and payload out of the frame (or of the QUIC chunks it
        // arrived in, copying only what straddles two): each record keeps the whole frame
        // alive, which is what the replay rings charge (RecordBuffers; docs/semantics.md).
        let producer_len = if producer.is_some() {
            felix_wire::PRODUCER_FIELDS_LEN
        } else {
            0
        };
        let buffers = RecordBuffers::Shared {
            len: (felix_wire::encoded_publish_len(&name, records.len(), key_payload_bytes)
                + producer_len) as u64,
        };
        let pending = PendingPublish::new(stream, request_id, ack, payload_bytes, record_count, 0);
        if let Some(tag) = producer {
            // One shard per producer batch: the shard named, and every record's key there.
            let misrouted = shards.iter().position(|&shard| shard != tag.shard);
            if tag.shard >= meta.shard_count || misrouted.is_some() {
                self.scratch_shards = shards;
                self.complete_job(now, payload_bytes);
                let message = match misrouted {
                    _ if tag.shard >= meta.shard_count => format!(
                        "producer_publish names shard {} of a stream of {} shards",
                        tag.shard, meta.shard_count
                    ),
                    Some(index) => format!(
                        "producer_publish names shard {} but record {index}'s key belongs to \
                         another shard: a producer batch holds one shard's records",
                        tag.shard
                    ),
                    None => String::new(),
                };
                let error = EngineError::new(ErrorCode::InvalidArgument, 0, message);
                self.answer_publish(stream, request_id, ack, Err(error));
                return;
            }
            if self.owner(tag.shard) == self.index {
                self.scratch_shards = shards;
                self.run_produced(now, pending, &name, records, tag, meta, buffers);
                return;
            }
        }
        if local {
            // The common case (a core-aware client): no split, no allocation here.
            let token = if durable { self.token() } else { 0 };
            let result = self.engine.publish_routed_from(
                now.unix_us,
                meta.handle,
                records,
                &shards,
                durable.then_some(PublishToken(token)),
                buffers,
            );
            self.scratch_shards = shards;
            match result {
                Ok(acks) if durable => {
                    self.tracked.insert(
                        token,
                        Tracked::Local {
                            publish: token,
                            produced: None,
                        },
                    );
                    self.hold(
                        token,
                        PendingPublish {
                            parts: 1,
                            acks,
                            ..pending
                        },
                    );
                }
                result => {
                    self.complete_job(now, payload_bytes);
                    self.finish_publish(&pending, result);
                }
            }
            return;
        }
        let mut parts: Vec<(Vec<Record>, Vec<u32>)> = (0..self.core_count)
            .map(|_| (Vec::new(), Vec::new()))
            .collect();
        for (record, &shard) in records.into_iter().zip(&shards) {
            let part = &mut parts[usize::from(self.owner(shard))];
            part.0.push(record);
            part.1.push(shard);
        }
        self.scratch_shards = shards;
        let publish_token = self.token();
        let mut pending = pending;
        for (core, (records, shards)) in (0..self.core_count).zip(parts) {
            if records.is_empty() {
                continue;
            }
            if core == self.index {
                let result = self.engine.publish_routed_from(
                    now.unix_us,
                    meta.handle,
                    records,
                    &shards,
                    durable.then_some(PublishToken(publish_token)),
                    buffers,
                );
                match result {
                    Ok(acks) => {
                        pending.acks.extend(acks);
                        if durable {
                            pending.parts += 1;
                            self.tracked.insert(
                                publish_token,
                                Tracked::Local {
                                    publish: publish_token,
                                    produced: None,
                                },
                            );
                        }
                    }
                    Err(error) => {
                        pending.error.get_or_insert(error);
                    }
                }
                continue;
            }
            self.counters.cross_core_hops += 1;
            let token = self.token();
            self.requests.insert(
                token,
                Request::PublishPart {
                    publish: publish_token,
                },
            );
            pending.parts += 1;
            self.send(
                core,
                CoreMessage::Publish {
                    from: self.index,
                    token,
                    stream: name.clone(),
                    shard_count: meta.shard_count,
                    records,
                    shards,
                    buffers,
                    now_us: now.unix_us,
                    producer: producer.map(Box::new),
                },
            );
        }
        if pending.parts == 0 {
            self.complete_job(now, payload_bytes);
            let result = take_result(&mut pending);
            self.finish_publish(&pending, result);
        } else {
            self.hold(publish_token, pending);
        }
    }

    /// Keeps a publish until its parts are answered; its stream owes the answer.
    pub(crate) fn hold(&mut self, token: u64, pending: PendingPublish) {
        if let Some(state) = self.streams.get_mut(&pending.stream) {
            state.owed += 1;
        }
        self.publishes.insert(token, pending);
    }

    /// One part of pending publish `publish` was answered.
    pub(crate) fn resolve_part(
        &mut self,
        now: Now,
        publish: u64,
        result: Result<Vec<ShardAck>, EngineError>,
    ) {
        let pending = self
            .publishes
            .get_mut(&publish)
            .expect("a part answers a pending publish");
        match result {
            Ok(acks) => pending.acks.extend(acks),
            Err(error) => {
                pending.error.get_or_insert(error);
            }
        }
        pending.parts -= 1;
        if pending.parts > 0 {
            return;
        }
        let mut pending = self
            .publishes
            .remove(&publish)
            .expect("looked up just above");
        self.complete_job(now, pending.payload_bytes);
        let result = take_result(&mut pending);
        self.finish_publish(&pending, result);
        self.answered(pending.stream);
    }

    /// An admitted publish finished: its ingress job frees (admitting the next waiter, handled
    /// by `settle`).
    pub(crate) fn complete_job(&mut self, now: Now, payload_bytes: u64) {
        self.admission.handle_complete(now.at, payload_bytes);
    }

    /// Counts a finished publish and writes its answer.
    fn finish_publish(
        &mut self,
        pending: &PendingPublish,
        result: Result<Vec<ShardAck>, EngineError>,
    ) {
        if result.is_ok() {
            self.counters.payload_bytes += pending.payload_bytes;
            self.counters.records += pending.records;
        }
        self.answer_publish(pending.stream, pending.request_id, pending.ack, result);
    }

    /// Writes a publish's answer (an acked one) and counts it.
    fn answer_publish(
        &mut self,
        stream: StreamId,
        request_id: u64,
        ack: AckMode,
        result: Result<Vec<ShardAck>, EngineError>,
    ) {
        match (result, ack) {
            (Ok(mut shards), AckMode::Acked) => {
                self.counters.publishes_acked += 1;
                self.counters.acks += 1;
                sort_acks(&mut shards);
                self.write(stream, &Frame::Ack(felix_wire::Ack { request_id, shards }));
            }
            (Ok(_), AckMode::FireAndForget) => self.counters.publishes_fire_and_forget += 1,
            (Err(error), AckMode::Acked) => {
                self.counters.acked_failed += 1;
                self.write_error(stream, error.to_frame(request_id));
            }
            (Err(error), AckMode::FireAndForget) => {
                tracing::debug!(%error, "fire-and-forget publish refused");
                self.counters.fire_and_forget_failed += 1;
                self.counters.error(error.code);
            }
        }
    }

    /// The owner's side of a forwarded part: append (in-memory: answer now; durable: answer
    /// once committed).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn publish_for(
        &mut self,
        from: u16,
        token: u64,
        stream: &str,
        shard_count: u32,
        records: Vec<Record>,
        shards: &[u32],
        buffers: RecordBuffers,
        now_us: u64,
        producer: Option<ProducerTag>,
    ) {
        // A stream deleted (and maybe re-created with another shard count) since the sender
        // resolved it is not the stream the part was meant for.
        let meta = self
            .engine
            .lookup(stream)
            .filter(|meta| meta.shard_count == shard_count);
        let Some(meta) = meta else {
            let error = EngineError::stream_not_found(stream);
            self.send(
                from,
                CoreMessage::PublishDone {
                    token,
                    result: Err(error),
                },
            );
            return;
        };
        assert!(
            shards.iter().all(|&shard| self.owner(shard) == self.index),
            "a forwarded part holds only the receiver's shards"
        );
        let key = producer.map(|tag| (meta.handle, tag.shard));
        if let (Some(tag), Some(key)) = (producer, key)
            && let Some(answer) = self.producer_verdict(key, tag)
        {
            self.send(
                from,
                CoreMessage::PublishDone {
                    token,
                    result: answer,
                },
            );
            return;
        }
        let produced = producer.zip(key).map(|(tag, key)| Produced {
            key,
            producer: tag.producer,
            sequence: tag.sequence,
        });
        if meta.kind != StreamKind::Durable {
            let result = self.engine.publish_routed_from(
                now_us,
                meta.handle,
                records,
                shards,
                None,
                buffers,
            );
            if let (Some(produced), Ok(acks)) = (produced, &result) {
                self.producer_accepted(produced, acks, 0);
            }
            self.send(from, CoreMessage::PublishDone { token, result });
            return;
        }
        let tracked = self.token();
        match self.engine.publish_routed_from(
            now_us,
            meta.handle,
            records,
            shards,
            Some(PublishToken(tracked)),
            buffers,
        ) {
            Ok(acks) => {
                if let (Some(produced), Some(tag)) = (produced, producer) {
                    self.producer_accepted(produced, &acks, tracked);
                    self.journal_batch(stream, tag, &acks);
                }
                self.tracked.insert(
                    tracked,
                    Tracked::Remote {
                        from,
                        token,
                        acks,
                        produced,
                    },
                );
            }
            Err(error) => self.send(
                from,
                CoreMessage::PublishDone {
                    token,
                    result: Err(error),
                },
            ),
        }
    }
}

impl Core {
    /// A producer batch of a shard this core owns (the publish arrived here): deduplicated,
    /// then stored as a one-part publish.
    #[allow(clippy::too_many_arguments)]
    fn run_produced(
        &mut self,
        now: Now,
        pending: PendingPublish,
        name: &str,
        records: Vec<Record>,
        tag: ProducerTag,
        meta: StreamMeta,
        buffers: RecordBuffers,
    ) {
        let key = (meta.handle, tag.shard);
        if let Some(answer) = self.producer_verdict(key, tag) {
            self.complete_job(now, pending.payload_bytes);
            self.answer_publish(pending.stream, pending.request_id, pending.ack, answer);
            return;
        }
        let produced = Produced {
            key,
            producer: tag.producer,
            sequence: tag.sequence,
        };
        let durable = meta.kind == StreamKind::Durable;
        let token = if durable { self.token() } else { 0 };
        let mut shards = std::mem::take(&mut self.scratch_shards);
        shards.clear();
        shards.resize(records.len(), tag.shard);
        let result = self.engine.publish_routed_from(
            now.unix_us,
            meta.handle,
            records,
            &shards,
            durable.then_some(PublishToken(token)),
            buffers,
        );
        self.scratch_shards = shards;
        match result {
            Ok(acks) if durable => {
                self.producer_accepted(produced, &acks, token);
                self.journal_batch(name, tag, &acks);
                self.tracked.insert(
                    token,
                    Tracked::Local {
                        publish: token,
                        produced: Some(produced),
                    },
                );
                self.hold(
                    token,
                    PendingPublish {
                        parts: 1,
                        acks,
                        ..pending
                    },
                );
            }
            result => {
                if let Ok(acks) = &result {
                    self.producer_accepted(produced, acks, 0);
                }
                self.complete_job(now, pending.payload_bytes);
                self.finish_publish(&pending, result);
            }
        }
    }

    /// The owner's verdict on a producer batch: `None` to store it, else the answer it gets
    /// without storing anything (the original ack, or a refusal).
    fn producer_verdict(
        &mut self,
        key: crate::producer::ShardKey,
        tag: ProducerTag,
    ) -> Option<Result<Vec<ShardAck>, EngineError>> {
        match self.producers.check(key, tag.producer, tag.sequence) {
            Verdict::New => None,
            Verdict::Duplicate(ack) => {
                self.counters.producer_duplicates += 1;
                Some(Ok(vec![ack]))
            }
            // `detail` = the sequence: an `unavailable` a client may retry as it is (a
            // replicated stream's, which stores nothing twice only by luck, has detail 0).
            Verdict::InFlight => Some(Err(EngineError::new(
                ErrorCode::Unavailable,
                tag.sequence,
                format!(
                    "batch {} of producer {:016x} on shard {} is still being stored; publish it \
                     again",
                    tag.sequence, tag.producer, tag.shard
                ),
            ))),
            Verdict::OutOfSequence { expected, reason } => {
                self.counters.producer_out_of_sequence += 1;
                Some(Err(EngineError::new(
                    ErrorCode::OutOfSequence,
                    expected,
                    format!(
                        "batch {} of producer {:016x} on shard {} refused: {reason}",
                        tag.sequence, tag.producer, tag.shard
                    ),
                )))
            }
        }
    }

    /// A durable producer batch was queued in the engine (`acks`: its shard's offsets): its
    /// journal record will precede its records in the log (`DurableLog::pump_journaled`).
    fn journal_batch(&mut self, stream: &str, tag: ProducerTag, acks: &[ShardAck]) {
        if tag.sequence == 0 {
            return;
        }
        let (Some(ack), Some(log_shard)) = (acks.first(), self.engine.log_shard(stream, tag.shard))
        else {
            return;
        };
        self.journal.push_back(JournalEntry {
            log_shard,
            first_offset: ack.first_offset,
            count: ack.count,
            producer: tag.producer,
            sequence: tag.sequence,
        });
    }

    /// A producer batch got its offsets (`acks`, one entry: its shard's).
    fn producer_accepted(&mut self, produced: Produced, acks: &[ShardAck], pending: u64) {
        if let Some(ack) = acks.first() {
            self.producers.accepted(
                produced.key,
                produced.producer,
                produced.sequence,
                ack,
                pending,
            );
        }
    }
}

/// The merged result of a publish whose parts are all answered.
fn take_result(pending: &mut PendingPublish) -> Result<Vec<ShardAck>, EngineError> {
    match pending.error.take() {
        Some(error) => Err(error),
        None => Ok(std::mem::take(&mut pending.acks)),
    }
}
