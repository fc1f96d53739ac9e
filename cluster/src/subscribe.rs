//! Subscribing to replicated shards on any member (docs/cluster.md, "Subscribing").
//!
//! A subscription reads this member's copy of each selected shard: only applied entries have
//! offsets (`shard.rs`), and applied means committed, so a subscriber on any replica (leader
//! or follower) sees committed records only, in each shard's offset order, the same records
//! at the same offsets on every member.
//!
//! Delivery is pull-shaped, like the data plane's cross-core deliveries (`felix-core`'s
//! `subscribe.rs`): a subscription holds at most [`CREDITS`] batches in flight; the caller
//! gives a credit back for each batch it has written ([`crate::service::Service::credit`]).
//! A subscription with credits reads its next batch straight from the shard's log whenever
//! the shard has records past its cursor (after every round of the service). Nothing queues
//! per subscriber, so a slow subscriber never lags out: it reads behind, from the log, until
//! the records it wants are compacted away ([`SubscribeError::TooOld`]).

use std::collections::HashMap;

use crate::control::ControlState;
use crate::groups::Groups;
use crate::shard::ShardRecord;

/// Batches a subscription may have in flight (written by the caller and not yet credited).
pub const CREDITS: u32 = 4;

/// Where a shard's delivery starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The oldest record this member still holds of the shard.
    Earliest,
    /// The next record committed.
    Latest,
    /// This offset (at most the next offset; at least the oldest held).
    Offset(u64),
}

/// A delivered record: its shard and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub shard: u32,
    pub offset: u64,
    pub record: ShardRecord,
}

/// Why a subscription was refused or ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    #[error("stream {stream:?} is not a replicated stream of this cluster")]
    NoSuchStream { stream: String },
    #[error("stream {stream:?} has {shards} shards: there is no shard {shard}")]
    NoSuchShard {
        stream: String,
        shard: u32,
        shards: usize,
    },
    #[error(
        "shard {shard} of stream {stream:?} is not replicated on this member (its replicas: \
         {replicas:?}); subscribe on one of them"
    )]
    NotReplicatedHere {
        stream: String,
        shard: u32,
        replicas: Vec<u64>,
    },
    #[error("shard {shard}: offset {offset} is no longer held; the oldest is {oldest}")]
    TooOld {
        shard: u32,
        offset: u64,
        oldest: u64,
    },
    #[error("shard {shard}: offset {offset} is beyond the next offset to be committed ({next})")]
    BeyondEnd { shard: u32, offset: u64, next: u64 },
    #[error("stream {stream:?} was deleted")]
    Deleted { stream: String },
    #[error("subscription id {0} is in use")]
    IdInUse(u64),

    #[error("reading shard {shard}: {reason}")]
    Read { shard: u32, reason: String },
    #[error("the cluster service stopped")]
    Stopped,
}

/// What a subscriber hears, in this order: `Started` or `Refused`; then `Records` batches
/// (one per credit) until `Ended`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubscriptionEvent {
    /// Registered: `(shard, first offset delivered)` per selected shard, ascending.
    Started(Vec<(u32, u64)>),
    Refused(SubscribeError),
    /// Records of one or more selected shards, each shard's in offset order.
    Records(Vec<Delivered>),
    Ended(SubscribeError),
}

type SinkFn = Box<dyn FnMut(SubscriptionEvent) + Send>;

/// Where a subscription's events go: called on the cluster thread (it must not block). A sink
/// dropped before its subscription was refused or ended (the service stopped) hears
/// `Ended(Stopped)`, so no subscriber waits forever.
pub struct SubscriptionSink {
    send: Option<SinkFn>,
}

impl SubscriptionSink {
    pub fn new(send: impl FnMut(SubscriptionEvent) + Send + 'static) -> Self {
        SubscriptionSink {
            send: Some(Box::new(send)),
        }
    }

    fn event(&mut self, event: SubscriptionEvent) {
        let last = matches!(
            event,
            SubscriptionEvent::Refused(_) | SubscriptionEvent::Ended(_)
        );
        if let Some(send) = &mut self.send {
            send(event);
        }
        if last {
            self.send = None;
        }
    }
}

impl Drop for SubscriptionSink {
    fn drop(&mut self) {
        if let Some(mut send) = self.send.take() {
            send(SubscriptionEvent::Ended(SubscribeError::Stopped));
        }
    }
}

impl std::fmt::Debug for SubscriptionSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.send.is_some() {
            "SubscriptionSink(open)"
        } else {
            "SubscriptionSink(over)"
        })
    }
}

/// What a subscription asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeRequest {
    /// Chosen by the caller, unique among its open subscriptions on this member.
    pub id: u64,
    pub stream: String,
    /// `(shard, start)` per selected shard, each shard once.
    pub shards: Vec<(u32, Start)>,
    /// Bounds of one delivered batch.
    pub max_records: usize,
    pub max_bytes: usize,
}

#[derive(Debug)]
struct Cursor {
    shard: u32,
    group: u64,
    next: u64,
}

#[derive(Debug)]
struct Subscription {
    stream: String,
    cursors: Vec<Cursor>,
    /// The cursor to look at first in the next round (shards take turns).
    turn: usize,
    credits: u32,
    max_records: usize,
    max_bytes: usize,
    sink: SubscriptionSink,
}

/// The subscriptions served by this member's cluster thread.
#[derive(Debug, Default)]
pub struct Subscriptions {
    open: HashMap<u64, Subscription>,
}

impl Subscriptions {
    /// Open subscriptions.
    #[must_use]
    pub fn len(&self) -> usize {
        self.open.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Registers a subscription: its sink hears `Started` with the start offsets, or
    /// `Refused`. Its records follow from [`Subscriptions::pump`].
    pub fn add(
        &mut self,
        request: SubscribeRequest,
        mut sink: SubscriptionSink,
        state: &ControlState,
        groups: &Groups,
    ) {
        match self.register(&request, state, groups) {
            Ok(cursors) => {
                let mut started: Vec<(u32, u64)> =
                    cursors.iter().map(|c| (c.shard, c.next)).collect();
                started.sort_unstable();
                sink.event(SubscriptionEvent::Started(started));
                self.open.insert(
                    request.id,
                    Subscription {
                        stream: request.stream,
                        cursors,
                        turn: 0,
                        credits: CREDITS,
                        max_records: request.max_records.max(1),
                        max_bytes: request.max_bytes.max(1),
                        sink,
                    },
                );
            }
            Err(error) => sink.event(SubscriptionEvent::Refused(error)),
        }
    }

    fn register(
        &self,
        request: &SubscribeRequest,
        state: &ControlState,
        groups: &Groups,
    ) -> Result<Vec<Cursor>, SubscribeError> {
        if self.open.contains_key(&request.id) {
            return Err(SubscribeError::IdInUse(request.id));
        }
        let stream = &request.stream;
        let Some(placement) = state
            .streams
            .get(stream)
            .filter(|p| p.kind == crate::control::StreamKind::Durable)
        else {
            return Err(SubscribeError::NoSuchStream {
                stream: stream.clone(),
            });
        };
        let mut cursors = Vec::with_capacity(request.shards.len());
        for &(shard, start) in &request.shards {
            let Some(shard_placement) = placement.shards.get(shard as usize) else {
                return Err(SubscribeError::NoSuchShard {
                    stream: stream.clone(),
                    shard,
                    shards: placement.shards.len(),
                });
            };
            let group = crate::groups::group_id(placement.incarnation, shard);
            let Some((oldest, next)) = groups.range(group) else {
                return Err(SubscribeError::NotReplicatedHere {
                    stream: stream.clone(),
                    shard,
                    replicas: shard_placement.replicas.clone(),
                });
            };
            let from = match start {
                Start::Earliest => oldest,
                Start::Latest => next,
                Start::Offset(offset) if offset > next => {
                    return Err(SubscribeError::BeyondEnd {
                        shard,
                        offset,
                        next,
                    });
                }
                Start::Offset(offset) if offset < oldest => {
                    return Err(SubscribeError::TooOld {
                        shard,
                        offset,
                        oldest,
                    });
                }
                Start::Offset(offset) => offset,
            };
            cursors.push(Cursor {
                shard,
                group,
                next: from,
            });
        }
        Ok(cursors)
    }

    /// The caller wrote a batch of subscription `id`: it may have one more in flight.
    pub fn credit(&mut self, id: u64) {
        if let Some(subscription) = self.open.get_mut(&id) {
            subscription.credits = (subscription.credits + 1).min(CREDITS);
        }
    }

    /// The caller is gone: the subscription is forgotten (its sink hears nothing more).
    pub fn remove(&mut self, id: u64) {
        if let Some(mut subscription) = self.open.remove(&id) {
            subscription.sink.send = None;
        }
    }

    /// Sends every subscription with credits its next batches, read from the shards' logs;
    /// ends those whose shard is gone (stream deleted) or whose next records were compacted.
    pub fn pump(&mut self, groups: &Groups) {
        let mut ended = Vec::new();
        for (id, subscription) in &mut self.open {
            if let Err(error) = subscription.pump(groups) {
                ended.push((*id, error));
            }
        }
        for (id, error) in ended {
            if let Some(mut subscription) = self.open.remove(&id) {
                tracing::debug!(id, %error, "cluster subscription ended");
                subscription.sink.event(SubscriptionEvent::Ended(error));
            }
        }
    }

    /// Ends every subscription: the service stops.
    pub fn stop_all(&mut self) {
        for (_, mut subscription) in self.open.drain() {
            subscription
                .sink
                .event(SubscriptionEvent::Ended(SubscribeError::Stopped));
        }
    }
}

impl Subscription {
    fn pump(&mut self, groups: &Groups) -> Result<(), SubscribeError> {
        while self.credits > 0 {
            let mut records: Vec<Delivered> = Vec::new();
            let mut bytes = 0;
            let count = self.cursors.len();
            for step in 0..count {
                let position = (self.turn + step) % count;
                let cursor = &mut self.cursors[position];
                let Some((_, next)) = groups.range(cursor.group) else {
                    return Err(SubscribeError::Deleted {
                        stream: self.stream.clone(),
                    });
                };
                if cursor.next >= next {
                    continue;
                }
                let room = self.max_records - records.len();
                let read = groups
                    .read_bytes(cursor.group, cursor.next, room, self.max_bytes - bytes)
                    .map_err(|error| match error {
                        crate::shard::ReadError::Compacted { oldest } => SubscribeError::TooOld {
                            shard: cursor.shard,
                            offset: cursor.next,
                            oldest,
                        },
                        crate::shard::ReadError::Failed(reason) => SubscribeError::Read {
                            shard: cursor.shard,
                            reason,
                        },
                    })?;
                for (offset, record) in read {
                    cursor.next = offset + 1;
                    bytes += record.key.len() + record.payload.len();
                    records.push(Delivered {
                        shard: cursor.shard,
                        offset,
                        record,
                    });
                }
                if records.len() >= self.max_records || bytes >= self.max_bytes {
                    // This shard filled the batch: the next round starts with the next shard.
                    self.turn = (position + 1) % count;
                    break;
                }
            }
            if records.is_empty() {
                return Ok(());
            }
            self.credits -= 1;
            self.sink.event(SubscriptionEvent::Records(records));
        }
        Ok(())
    }
}
