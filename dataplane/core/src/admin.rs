//! Catalogue changes and descriptions.
//!
//! Every core's engine holds the whole catalogue (every stream, all shards) and only ever
//! receives publishes for the shards it owns. Changes are serialized through core 0, one at a
//! time, oldest first: core 0 validates a change, has a durable change persisted by its shell
//! ([`crate::CatalogWrite`]) before anything is applied, applies it, sends it to every other
//! core (which must apply it: a refusal there is a defect, asserted) and answers once all
//! applied. FIFO queues per pair keep every core's order equal to core 0's. `ListStreams` is
//! answered from the local catalogue; `DescribeStream` gathers each shard's state from its
//! owner core.

use felix_auth::Operation;
use felix_engine::{DURABLE_STREAM_ID_MAX, EngineError, ShardState, StreamDescription};
use felix_wire::{ErrorCode, Frame, StreamKind};

use crate::catalog::{CatalogChange, CatalogEntry};
use crate::config::{Now, StreamId};
use crate::core::{CatalogWrite, Core, Flow, Parked, Request, core_error};
use crate::message::{AdminRequest, CoreMessage};

/// Who asked for a catalogue change.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AdminOrigin {
    /// A stream of core 0.
    Local { stream: StreamId, request_id: u64 },
    /// Core `from`, answered with `AdminDone { token }`.
    Remote { from: u16, token: u64 },
}

/// Where core 0 is with one catalogue change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AdminState {
    /// Not started (an earlier change is still running).
    Queued,
    /// Waiting for the shell to persist catalogue write `write`.
    Persisting { write: u64 },
    /// Applied here; waiting for `waiting` other cores to apply it.
    Broadcasting { waiting: u16 },
}

/// One catalogue change on core 0.
#[derive(Debug)]
pub(crate) struct AdminOp {
    origin: AdminOrigin,
    request: AdminRequest,
    state: AdminState,
    /// The token of the broadcast (`Apply` / `Applied`).
    token: u64,
    /// The answer, once applied here.
    description: Option<StreamDescription>,
}

/// A describe gathering shard states from the owner cores (on the asking core).
#[derive(Debug)]
pub(crate) struct PendingDescribe {
    stream: StreamId,
    request_id: u64,
    description: StreamDescription,
    waiting: u16,
    error: Option<EngineError>,
}

impl Core {
    /// A `CreateStream` or `DeleteStream` frame: core 0 queues it; other cores forward it to
    /// core 0 and park the stream until the answer.
    pub(crate) fn request_admin(
        &mut self,
        stream: StreamId,
        request_id: u64,
        request: AdminRequest,
    ) -> Flow {
        let (operation, name) = match &request {
            AdminRequest::Create { name, .. } => (Operation::Create, name),
            AdminRequest::Delete { name } => (Operation::Delete, name),
        };
        if let Err(denied) = self.authorize(stream, operation, name) {
            self.write_error(stream, denied.to_frame(request_id));
            return Flow::Continue;
        }
        self.stream_mut(stream).parked = Some(Parked::Remote);
        if self.index == 0 {
            self.queue_admin(AdminOrigin::Local { stream, request_id }, request);
        } else {
            let token = self.token();
            let delete = matches!(request, AdminRequest::Delete { .. });
            self.requests.insert(
                token,
                Request::Admin {
                    stream,
                    request_id,
                    delete,
                },
            );
            self.send(
                0,
                CoreMessage::Admin {
                    from: self.index,
                    token,
                    request,
                },
            );
        }
        Flow::Blocked
    }

    /// Core 0: queues a change and runs it if it is the only one.
    pub(crate) fn queue_admin(&mut self, origin: AdminOrigin, request: AdminRequest) {
        assert_eq!(
            self.index, 0,
            "catalogue changes are serialized through core 0"
        );
        let token = self.token();
        self.admin_ops.push_back(AdminOp {
            origin,
            request,
            state: AdminState::Queued,
            token,
            description: None,
        });
        self.drive_admin();
    }

    /// Core 0: starts the head change, or finishes it; repeats while the head can go on.
    fn drive_admin(&mut self) {
        while let Some(head) = self.admin_ops.front() {
            match head.state {
                AdminState::Persisting { .. } => return,
                AdminState::Broadcasting { waiting } if waiting > 0 => return,
                AdminState::Broadcasting { .. } => {
                    let op = self.admin_ops.pop_front().expect("the head exists");
                    let description = op.description.expect("a broadcast change was applied");
                    self.answer_admin(op.origin, &op.request, Ok(description));
                }
                AdminState::Queued => {
                    if let Err(error) = self.start_admin() {
                        let op = self.admin_ops.pop_front().expect("the head exists");
                        self.answer_admin(op.origin, &op.request, Err(error));
                    }
                }
            }
        }
    }

    /// Core 0: validates the head change; a durable one is handed to the shell to persist,
    /// an in-memory one is applied and broadcast at once.
    fn start_admin(&mut self) -> Result<(), EngineError> {
        let head = self
            .admin_ops
            .front()
            .expect("drive_admin checked the head");
        let persist = match &head.request {
            AdminRequest::Create {
                name,
                shard_count,
                kind,
                ..
            } => {
                // The engine's own limits first: their messages name the settings
                // (FELIX_MAX_SHARDS_PER_STREAM, FELIX_MAX_STREAMS).
                if let Err(error) = self.engine.check_create(name, *shard_count, *kind) {
                    if error.code == ErrorCode::LimitExceeded {
                        let limit = if *shard_count > self.engine.config().max_shards {
                            crate::Limit::ShardsPerStream
                        } else {
                            crate::Limit::Streams
                        };
                        self.counters.limit(limit);
                    }
                    return Err(error);
                }
                // Its description must fit in one frame (docs/wire-protocol.md 4.6): 16 fixed
                // bytes, the name, 22 bytes per shard. The broker's settings are checked for
                // this at start-up; this keeps any configuration from answering a frame the
                // client cannot decode.
                let info_bytes = 16 + name.len() as u64 + 22 * u64::from(*shard_count);
                if info_bytes > u64::from(self.limits.max_frame_bytes) {
                    self.counters.limit(crate::Limit::ShardsPerStream);
                    return Err(core_error(
                        ErrorCode::LimitExceeded,
                        format!(
                            "a stream of {shard_count} shards takes {info_bytes} bytes to \
                             describe, over the frame limit of {} bytes (FELIX_MAX_FRAME_BYTES)",
                            self.limits.max_frame_bytes
                        ),
                    ));
                }
                // So must the list of every stream (docs/wire-protocol.md 4.7, no paging in
                // v1): 12 fixed bytes, 7 per stream plus its name. O(streams), per create.
                let list_bytes = 12
                    + 7
                    + name.len() as u64
                    + self
                        .engine
                        .list_streams()
                        .iter()
                        .map(|(listed, _, _)| 7 + listed.len() as u64)
                        .sum::<u64>();
                if list_bytes > u64::from(self.limits.max_frame_bytes) {
                    self.counters.limit(crate::Limit::Streams);
                    return Err(core_error(
                        ErrorCode::LimitExceeded,
                        format!(
                            "listing every stream would take {list_bytes} bytes, over the frame \
                             limit of {} bytes (FELIX_MAX_FRAME_BYTES)",
                            self.limits.max_frame_bytes
                        ),
                    ));
                }
                if *kind == StreamKind::Durable {
                    let stream_id = self.next_stream_id;
                    if stream_id > DURABLE_STREAM_ID_MAX {
                        return Err(core_error(
                            ErrorCode::StorageFailed,
                            format!(
                                "every durable stream id up to {DURABLE_STREAM_ID_MAX} has \
                                 been used"
                            ),
                        ));
                    }
                    Some(CatalogChange::Add(CatalogEntry {
                        name: name.clone(),
                        shards: *shard_count,
                        stream_id,
                    }))
                } else {
                    None
                }
            }
            AdminRequest::Delete { name } => {
                let description = self.engine.describe_stream(name)?;
                // Persist the removal first: once answered, the stream stays deleted.
                (description.kind == StreamKind::Durable)
                    .then(|| CatalogChange::Remove { name: name.clone() })
            }
        };
        match persist {
            Some(change) => {
                let write = self.token();
                self.catalog_writes
                    .push_back(CatalogWrite { id: write, change });
                self.admin_ops.front_mut().expect("the head exists").state =
                    AdminState::Persisting { write };
            }
            None => self.apply_and_broadcast(),
        }
        Ok(())
    }

    /// Core 0: the shell persisted (or failed to persist) catalogue write `write`.
    pub fn handle_catalog_written(&mut self, now: Now, write: u64, result: Result<(), String>) {
        let head = self
            .admin_ops
            .front_mut()
            .expect("a catalogue write belongs to the running change");
        assert_eq!(
            head.state,
            AdminState::Persisting { write },
            "catalogue writes are answered in order, one at a time"
        );
        match result {
            Ok(()) => {
                if let AdminRequest::Create {
                    kind: StreamKind::Durable,
                    stream_id,
                    ..
                } = &mut head.request
                {
                    *stream_id = Some(self.next_stream_id);
                    self.next_stream_id += 1;
                }
                self.apply_and_broadcast();
            }
            Err(error) => {
                tracing::error!(%error, "durable catalogue change failed");
                let op = self.admin_ops.pop_front().expect("the head exists");
                let error = core_error(
                    ErrorCode::StorageFailed,
                    format!("cannot persist the durable catalogue: {error}"),
                );
                self.answer_admin(op.origin, &op.request, Err(error));
            }
        }
        self.drive_admin();
        self.settle(now);
    }

    /// Core 0: applies the head change here (validated, and persisted if durable, so it
    /// cannot fail) and sends it to every other core.
    fn apply_and_broadcast(&mut self) {
        let (request, token) = {
            let head = self.admin_ops.front().expect("the running change");
            (head.request.clone(), head.token)
        };
        let description = self.apply(&request).unwrap_or_else(|error| {
            panic!("core 0 validated {request:?} before applying it, yet: {error}")
        });
        for core in 1..self.core_count {
            self.send(
                core,
                CoreMessage::Apply {
                    token,
                    request: request.clone(),
                },
            );
        }
        let head = self.admin_ops.front_mut().expect("the running change");
        head.description = Some(description);
        head.state = AdminState::Broadcasting {
            waiting: self.core_count - 1,
        };
    }

    /// A core other than 0: applies a change core 0 applied, and says so.
    pub(crate) fn apply_from_core_zero(&mut self, token: u64, request: &AdminRequest) {
        assert_ne!(self.index, 0, "core 0 applies its own changes");
        if let Err(error) = self.apply(request) {
            panic!(
                "core {} refused catalogue change {request:?} that core 0 applied: {error}",
                self.index
            );
        }
        self.send(0, CoreMessage::Applied { token });
    }

    /// Core 0: one more core applied the running change.
    pub(crate) fn handle_applied(&mut self, token: u64) {
        let head = self
            .admin_ops
            .front_mut()
            .expect("an Applied answers the running change");
        assert_eq!(head.token, token, "changes are broadcast one at a time");
        let AdminState::Broadcasting { waiting } = &mut head.state else {
            panic!("an Applied answers a broadcast");
        };
        *waiting -= 1;
        self.drive_admin();
    }

    /// Applies a catalogue change to this core's engine.
    fn apply(&mut self, request: &AdminRequest) -> Result<StreamDescription, EngineError> {
        match request {
            AdminRequest::Create {
                name,
                shard_count,
                kind: StreamKind::Durable,
                stream_id,
            } => {
                let stream_id = stream_id.expect("a durable create carries core 0's catalogue id");
                let created = self
                    .engine
                    .create_durable_stream(name, *shard_count, stream_id)?;
                self.durable_shards_landed(*shard_count);
                Ok(created)
            }
            AdminRequest::Create {
                name,
                shard_count,
                kind,
                ..
            } => self.engine.create_stream(name, *shard_count, *kind),
            AdminRequest::Delete { name } => {
                let description = self.engine.describe_stream(name)?;
                if let Some(meta) = self.engine.lookup(name) {
                    self.producers.forget_stream(meta.handle);
                }
                if let Some(stream_id) = self.engine.log_shard(name, 0).map(|id| id.stream_id()) {
                    // Their queued appends go with the stream.
                    self.journal
                        .retain(|entry| entry.log_shard.stream_id() != stream_id);
                }
                self.engine.delete_stream(name)?;
                Ok(description)
            }
        }
    }

    /// Core 0: answers a finished change to whoever asked.
    fn answer_admin(
        &mut self,
        origin: AdminOrigin,
        request: &AdminRequest,
        result: Result<StreamDescription, EngineError>,
    ) {
        match origin {
            AdminOrigin::Local { stream, request_id } => {
                let delete = matches!(request, AdminRequest::Delete { .. });
                self.write_admin_answer(stream, request_id, delete, result);
            }
            AdminOrigin::Remote { from, token } => {
                self.send(from, CoreMessage::AdminDone { token, result });
            }
        }
    }

    /// A core other than 0: core 0 answered a forwarded change.
    pub(crate) fn handle_admin_done(
        &mut self,
        token: u64,
        result: Result<StreamDescription, EngineError>,
    ) {
        let Some(Request::Admin {
            stream,
            request_id,
            delete,
        }) = self.requests.remove(&token)
        else {
            panic!("AdminDone {token} answers a forwarded change");
        };
        self.write_admin_answer(stream, request_id, delete, result);
    }

    fn write_admin_answer(
        &mut self,
        stream: StreamId,
        request_id: u64,
        delete: bool,
        result: Result<StreamDescription, EngineError>,
    ) {
        match result {
            Ok(_) if delete => self.write(stream, &Frame::Done { request_id }),
            Ok(description) => self.write_stream_info(stream, request_id, description),
            Err(error) => self.write_error(stream, error.to_frame(request_id)),
        }
        self.unpark(stream);
    }

    // ---- describe ----

    /// A `DescribeStream` frame: the local catalogue's description, with each shard's state
    /// taken from its owner core.
    pub(crate) fn start_describe(&mut self, stream: StreamId, request_id: u64, name: &str) -> Flow {
        if let Err(denied) = self.authorize(stream, Operation::Describe, name) {
            self.write_error(stream, denied.to_frame(request_id));
            return Flow::Continue;
        }
        let description = match self.engine.describe_stream(name) {
            Ok(description) => description,
            Err(_) if self.is_cluster_stream(name) => {
                self.describe_cluster_stream(stream, request_id, name);
                return Flow::Continue;
            }
            Err(error) => {
                self.write_error(stream, error.to_frame(request_id));
                return Flow::Continue;
            }
        };
        let owners = u16::try_from(description.shards.len())
            .unwrap_or(u16::MAX)
            .min(self.core_count);
        let describe = self.token();
        let mut waiting = 0;
        let index = self.index;
        for core in (0..owners).filter(|&core| core != index) {
            let token = self.token();
            self.requests.insert(token, Request::Describe { describe });
            self.send(
                core,
                CoreMessage::Describe {
                    from: self.index,
                    token,
                    stream: name.to_owned(),
                },
            );
            waiting += 1;
        }
        if waiting == 0 {
            self.write_stream_info(stream, request_id, description);
            return Flow::Continue;
        }
        self.describes.insert(
            describe,
            PendingDescribe {
                stream,
                request_id,
                description,
                waiting,
                error: None,
            },
        );
        self.stream_mut(stream).parked = Some(Parked::Remote);
        Flow::Blocked
    }

    /// The owner's side: the state of its own shards of `stream`.
    pub(crate) fn describe_for(&mut self, from: u16, token: u64, stream: &str) {
        let result = self.engine.describe_stream(stream).map(|description| {
            description
                .shards
                .into_iter()
                .filter(|state: &ShardState| self.owner(state.shard) == self.index)
                .collect()
        });
        self.send(from, CoreMessage::DescribeDone { token, result });
    }

    pub(crate) fn handle_describe_done(
        &mut self,
        token: u64,
        result: Result<Vec<ShardState>, EngineError>,
    ) {
        let Some(Request::Describe { describe }) = self.requests.remove(&token) else {
            panic!("DescribeDone {token} answers a describe");
        };
        let pending = self
            .describes
            .get_mut(&describe)
            .expect("a describe part answers a pending describe");
        match result {
            Ok(states) => {
                for state in states {
                    if let Some(slot) = pending.description.shards.get_mut(state.shard as usize) {
                        *slot = state;
                    }
                }
            }
            Err(error) => {
                pending.error.get_or_insert(error);
            }
        }
        pending.waiting -= 1;
        if pending.waiting > 0 {
            return;
        }
        let pending = self.describes.remove(&describe).expect("looked up above");
        match pending.error {
            Some(error) => self.write_error(pending.stream, error.to_frame(pending.request_id)),
            None => self.write_stream_info(pending.stream, pending.request_id, pending.description),
        }
        self.unpark(pending.stream);
    }
}
